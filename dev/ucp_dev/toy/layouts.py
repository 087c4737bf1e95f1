"""The toy model's layouts described to ucp_dcp: pattern rules and index maps for one rank.

:func:`ucp_options` needs only the model config, the topology and the rank's mesh coordinate (no
Trainer, no process group), so a rank's planner options can be made for any layout, also one that
is not running; :func:`trainer_options` is the same for a built :class:`~ucp_dev.toy.parallel.Trainer`.
The result is the keyword arguments of ``UCPSavePlanner`` / ``UCPLoadPlanner`` (and ``ucp_dcp.save``
/ ``ucp_dcp.load``).
"""

from __future__ import annotations

from ucp_dcp.layout.index_maps import Chunk, IndexMap
from ucp_dcp.layout.patterns import Fused, Padded, Reduce, Replicated, Tied

from .model import ModelConfig
from .parallel import Topology, Trainer, layer_split, stage_ids


def ucp_options(cfg: ModelConfig, topo: Topology, coord: dict[str, int], model_only: bool = False) -> dict:
    """The pattern rules and index maps that describe this model's layouts to ucp_dcp, for the rank
    at mesh coordinate ``coord`` (keys ``pp``, ``dpr``, ``dp``, ``ep``, ``tp``; only ``pp`` and
    ``ep`` matter) of ``topo``: ``{"patterns": [...], "stage_map": ..., "expert_map": ...}``.
    ``model_only``: for a state dict of the model alone (``{"model": ...}``, e.g. a Hugging Face
    import), without the train-state rule."""
    hd, t = cfg.head_dim, topo
    patterns = [
        Fused(
            r"(.*)\.attn\.wqkv\.weight",
            [
                (r"\1.attn.wq.weight", cfg.n_heads * hd),
                (r"\1.attn.wk.weight", cfg.n_kv_heads * hd),
                (r"\1.attn.wv.weight", cfg.n_kv_heads * hd),
            ],
            blocks=cfg.n_kv_heads,
        ),  # group-major
        Tied("tok_embeddings.weight", (r"output\.weight",)),
        Padded(r"tok_embeddings\.weight", size=cfg.vocab),
        Replicated(r".*norm\.weight|.*\.router\.weight|.*res_gain", check="error"),
    ]
    if any(cfg.ffn_kind(i) == "dense" for i in range(cfg.n_layers)):  # [w1_r; w3_r] per TP rank
        patterns.insert(
            1,
            Fused(
                r"(.*)\.ffn\.w13\.weight",
                [(r"\1.ffn.w1.weight", cfg.ffn_dim), (r"\1.ffn.w3.weight", cfg.ffn_dim)],
                blocks="tp",
            ),
        )
    if not model_only:
        patterns.append(Reduce(r"train_state\.tokens_seen", "sum"))
    split = layer_split(cfg, t.n_stages)
    stage_map = IndexMap(
        "layers",
        [
            Chunk(tuple(split[sid]), (f"model.c{v}", f"optim.c{v}"), sid)
            for v, sid in enumerate(stage_ids(t, coord["pp"]))
        ],
        total=cfg.n_layers,
    )
    n_local = cfg.n_experts // t.ep  # expert lists: local expert j on EP rank e is global e * n_local + j
    expert_map = IndexMap("experts", [Chunk(coord["ep"] * n_local, (), coord["ep"])], total=cfg.n_experts)
    out = {"patterns": patterns, "stage_map": stage_map}
    if cfg.list_moe_layers:  # no expert lists: no expert numbering to map
        out["expert_map"] = expert_map
    return out


def trainer_options(cfg: ModelConfig, tr: Trainer) -> dict:
    """:func:`ucp_options` for a built trainer (its job's topology and this rank's coordinate)."""
    return ucp_options(cfg, tr.job.topo, tr.job.coord)
