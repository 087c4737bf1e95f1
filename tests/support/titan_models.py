"""torchtitan models next to transformers ones, in one process (tests/torchtitan/test_mappings.py,
tests/torchtitan/test_hf_deepseek.py, tests/e2e/test_titan_hf_moe.py, tests/e2e/test_to_stock.py): build a
torchtitan model, its logits, a transformers model from a folder or a random one from a mapping's config,
and the fp32 comparison of the two. The jobs (torchrun of the CPU launcher) are ``ucp_dev.testing.titan``'s.
"""

from __future__ import annotations

import warnings

import torch


def _titan(model_config):
    with torch.device("meta"):
        m = model_config.build()
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights(buffer_device=None)
    return m.eval()


def _titan_logits(m, tokens):
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return m(tokens, positions=pos, attention_masks=m.get_attention_masks(pos))


def _from_pretrained(folder):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.eval()


def _close(a, b):
    """fp32 logits of two implementations: max |a - b| <= 1e-5 of the logit scale."""
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    assert scale > 1.0 and diff <= 1e-5 * scale, (diff, scale)


def fp32_experts(patch):
    """torchtitan's ``GroupedExperts`` compute in bf16 by design (inputs and weights cast before
    ``_grouped_mm``); to compare with fp32 transformers at the dense tests' 1e-5 the experts run the
    same math in fp32: rows grouped by expert, ``counts[e]`` rows each (rows past them stay zero)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    def forward(self, x, counts):
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        out, start = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype), 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            out[start : start + n] = (F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T
            start += n
        return out

    patch(GroupedExperts, "forward", forward)  # monkeypatch.setattr in a test, dist.patch in a task


def hf_model(mapping, folder, seed=0):
    """A random transformers model built from the mapping's config.json, saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(mapping.config)
    arch = cfg.pop("architectures")
    config = AutoConfig.for_model(**cfg)
    config.architectures = arch
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from 1 and weights large enough that a wrong row order shows
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    hf.save_pretrained(folder)
    return hf
