"""Driven by tests/e2e/test_titan_trainer.py under torchrun: torchtitan components without the Trainer.

Builds the GQA debug model with torchtitan's own parallelize function (FSDP2, optionally TP), one
AdamW step, then saves and loads with the checkpoint manager while counting ``DTensor.redistribute``
calls on fused ``wqkv`` tensors. Prints one JSON line on rank 0.

    torchrun --nproc-per-node 2 tests/support/titan_driver.py OUT_DIR DP TP FUSED_ATOMS(0|1) [SPMD_BACKEND]

SPMD_BACKEND is torchtitan's ``parallelism.spmd_backend`` (default ``partial_dtensor``); under
``spmd_types`` the forward runs inside torchtitan's SPMD context, as the Trainer runs it, and FSDP
needs the launcher's patch (s) (data-parallel layouts only).
"""

import json
import sys

from ucp_dev.testing.titan import cpu_launch  # the CPU patches, before torchtitan is imported

cpu_launch.patch_device()
cpu_launch.patch_torchtitan()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402

from ucp_dev.testing.config_registry import llama3_debugmodel_gqa_ucp  # noqa: E402
from ucp_dev.testing.titan.jobs import CPU_ATTENTION  # noqa: E402

out, dp, tp, fused_atoms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
backend = sys.argv[5] if len(sys.argv) > 5 else "partial_dtensor"
dist.init_process_group("gloo")
torch.manual_seed(0)
cfg = llama3_debugmodel_gqa_ucp()
cfg.checkpoint.fused_qkv_atoms = fused_atoms
P, T = cfg.parallelism, cfg.training
P.spmd_backend, P.data_parallel_shard_degree, P.tensor_parallel_degree = backend, dp, tp
T.seq_len, T.local_batch_size, T.steps, T.mixed_precision_param = 32, 2, 1, "float32"
cfg.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(cfg.model_spec))
cfg.checkpoint.enable, cfg.checkpoint.interval = True, 1
pd = ParallelDims.from_config(P, dist.get_world_size())
dist_utils.set_spmd_backend(P.spmd_backend)
spec, mc = cfg.model_spec, cfg.model_spec.model
mc.update_from_config(config=cfg)
cfg.override.imports = [CPU_ATTENTION]
apply_overrides(cfg.override, cfg)


def build(seed):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = mc.build()
    model = spec.parallelize_fn(
        model,
        parallel_dims=pd,
        training=T,
        parallelism=P,
        compile_config=cfg.compile,
        ac_config=cfg.activation_checkpoint,
        dump_folder=out,
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opt = cfg.optimizer.build(model_parts=[model])
    lrs = cfg.lr_scheduler.build(optimizers=opt, training_steps=4)
    return model, opt, lrs


class TrainState:
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def manager(model, opt, lrs, ts):
    return cfg.checkpoint.build(
        dataloader=None,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=lrs,
        states={"train_state": ts},
        sd_adapter=None,
        base_folder=out,
    )


def full_state(model, opt):
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"param/{n}": full(p) for n, p in model.named_parameters()}
    for o in opt.optimizers:
        for p, st in o.state.items():
            state.update({f"state/{names[id(p)]}/{k}": full(v) for k, v in st.items()})
    return state


calls = {"now": None, "save": 0, "load": 0}
wqkv_shapes = set()
real_redistribute = DTensor.redistribute


def counting_redistribute(self, *a, **k):
    if calls["now"] and tuple(self.shape) in wqkv_shapes:
        calls[calls["now"]] += 1
    return real_redistribute(self, *a, **k)


DTensor.redistribute = counting_redistribute

model, opt, lrs = build(0)
wqkv_shapes.update(tuple(p.shape) for n, p in model.named_parameters() if "wqkv" in n)
tokens = torch.randint(0, 2000, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank()))
with dist_utils.get_spmd_context(parallel_dims=pd)():  # a no-op unless spmd_types
    logits = model(tokens[:, :-1])
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
opt.step()
ts = TrainState()
ts.step, ts.ntokens_seen = 1, 64 * (dist.get_rank() + 1)
saved = full_state(model, opt)
calls["now"] = "save"
m1 = manager(model, opt, lrs, ts)
m1.save(1)
calls["now"] = None

model2, opt2, lrs2 = build(1)
ts2 = TrainState()
calls["now"] = "load"
m2 = manager(model2, opt2, lrs2, ts2)
m2.load(1)
calls["now"] = None
loaded = full_state(model2, opt2)
diffs = [k for k in saved if not torch.equal(saved[k], loaded[k])]
counts = torch.tensor([ts2.ntokens_seen])
gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, counts)
if dist.get_rank() == 0:
    print(
        json.dumps(
            {
                "backend": pd.spmd_backend,
                "save_redistributes": calls["save"],
                "load_redistributes": calls["load"],
                "diffs": diffs,
                "entries": len(saved),
                "ntokens_seen": [int(c) for c in gathered],
            }
        )
    )
for m in (m1, m2):
    m.close()
dist.barrier()
dist.destroy_process_group()
