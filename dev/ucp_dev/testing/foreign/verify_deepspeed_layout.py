"""Check the documented DeepSpeed ZeRO / universal layouts against DeepSpeed's own view, without deepspeed.

    python -m ucp_dev.testing.foreign.verify_deepspeed_layout DIR [DIR ...]

DIR is an output of ``make_deepspeed.py``. Every pickle is opened with an unpickler that knows only
torch, ``collections.OrderedDict`` and stand-ins for the three DeepSpeed classes the files hold
(``LossScaler``, ``ZeroStageEnum``, ``fragment_address``); anything else is refused, and
``deepspeed`` is never imported. From the raw flat fp32 partitions and Adam moments it rebuilds every
full parameter, ``exp_avg`` and ``exp_avg_sq`` twice, once by the offset formulas and once from
``param_slice_mappings`` (ZeRO-1/2), and compares them bit for bit with ``ds_view_fp32.pt``
(``zero_to_fp32``) and ``ds_view_optim.pt`` (the live engine), and with the universal atoms when
``DIR/universal`` exists. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import collections
import glob
import math
import os
import pickle
import re
import sys
import types

import torch


class LossScaler:  # deepspeed.runtime.fp16.loss_scaler.LossScaler: NEWOBJ + BUILD of its __dict__
    pass


class fragment_address:  # deepspeed.utils.tensor_fragment.fragment_address, a @dataclass(numel, start)
    def __repr__(self) -> str:
        return f"fragment_address(numel={self.numel}, start={self.start})"


def ZeroStageEnum(value: int) -> int:  # deepspeed.runtime.zero.config.ZeroStageEnum(int, Enum): REDUCE (cls, (v,))
    return int(value)


STANDINS = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScaler,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStageEnum,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): fragment_address,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
SEEN: set[str] = set()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        SEEN.add(f"{module}.{name}")
        if (module, name) in STANDINS:
            return STANDINS[module, name]
        if module == "torch" or module.startswith("torch."):  # storages, _rebuild_tensor_v2, Size, Tensor, ...
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused {module}.{name}")


_pickle_module = types.SimpleNamespace(
    Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(), __name__="pickle"
)


def load(path: str):
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_pickle_module)


def _check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.detach(), want.detach()
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        raise SystemExit(f"MISMATCH {what}: {tuple(got.shape)} vs {tuple(want.shape)}")


def _rank(path: str) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))


def zero12(ck: str) -> tuple[dict, dict]:
    """ZeRO-1/2: full fp32/exp_avg/exp_avg_sq by name, and the per-group step and hyperparameters."""
    ms = load(os.path.join(ck, "mp_rank_00_model_states.pt"))
    files = sorted(glob.glob(os.path.join(ck, "zero_pp_rank_*_mp_rank_00_optim_states.pt")), key=_rank)
    osds = [load(f)["optimizer_state_dict"] for f in files]
    dp = len(osds)
    assert all(o["partition_count"] == [dp] * len(ms["param_shapes"]) for o in osds)
    out: dict = {}
    groups = []
    for g, shapes in enumerate(ms["param_shapes"]):
        pads = osds[0]["param_alignment_paddings"][g]
        assert len(pads) == len(shapes) and all(o["param_alignment_paddings"][g] == pads for o in osds)
        padded = sum(s.numel() + p for s, p in zip(shapes.values(), pads))
        align = 2 * dp  # nccl_start_alignment_factor (2) x dp
        length = math.ceil(padded / align) * align
        ps = length // dp
        flats = {}
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            parts = []
            for r, o in enumerate(osds):
                st = o["base_optimizer_state"]["state"][g]
                t = o["single_partition_of_fp32_groups"][g] if key == "fp32" else st[key]
                # saved fp32 partitions drop the group's tail padding (group_paddings), the moments keep it
                want_len = ps - o["group_paddings"][g] if key == "fp32" else ps
                assert t.numel() == want_len, (key, r, t.numel(), want_len)
                assert o["group_paddings"][g] == max(0, min(ps, (r + 1) * ps - padded)), o["group_paddings"]
                parts.append(t[:ps])
            flats[key] = torch.cat(parts)
        # formula: params in param_shapes order, each followed by its alignment padding
        off = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            n = shape.numel()
            out[name] = {k: flats[k][off : off + n].view(shape).clone() for k in flats}
            off += n + pad
        # the same from param_slice_mappings: fragments of a name, concatenated in rank order
        frags: dict = collections.defaultdict(lambda: collections.defaultdict(list))
        for o in osds:
            st = o["base_optimizer_state"]["state"][g]
            src = {
                "fp32": o["single_partition_of_fp32_groups"][g],
                "exp_avg": st["exp_avg"],
                "exp_avg_sq": st["exp_avg_sq"],
            }
            for name, fa in o["param_slice_mappings"][g].items():
                assert isinstance(fa, fragment_address)
                for k, t in src.items():
                    frags[name][k].append(t[fa.start : fa.start + fa.numel])
        assert set(frags) == set(shapes)
        rr = ms["ds_config"].get("zero_optimization", {}).get("round_robin_gradients", False)
        for name, shape in [] if rr else shapes.items():  # round robin: the mappings are wrong (see REPORT)
            for k in flats:
                _check(f"{name}.{k} (slice mappings)", torch.cat(frags[name][k]).view(shape), out[name][k])
        steps = {o["base_optimizer_state"]["state"][g]["step"].item() for o in osds}
        assert len(steps) == 1
        hp = {k: v for k, v in osds[0]["base_optimizer_state"]["param_groups"][g].items() if k != "params"}
        assert all(
            {k: v for k, v in o["base_optimizer_state"]["param_groups"][g].items() if k != "params"} == hp for o in osds
        )
        groups.append(dict(hp, names=list(shapes), step=steps.pop()))
    rr = bool(ms["ds_config"].get("zero_optimization", {}).get("round_robin_gradients", False))
    for name in out:  # fp32 training: the saved module weights are the master weights
        _check(f"{name} fp32 vs module", out[name]["fp32"], ms["module"][name])
    return out, {"groups": groups, "shared": ms["shared_params"], "module": ms["module"], "round_robin": rr}


def zero3(ck: str) -> tuple[dict, dict]:
    files = sorted(glob.glob(os.path.join(ck, "zero_pp_rank_*_mp_rank_00_optim_states.pt")), key=_rank)
    mfiles = sorted(glob.glob(os.path.join(ck, "zero_pp_rank_*_mp_rank_00_model_states.pt")), key=_rank)
    osds = [load(f)["optimizer_state_dict"] for f in files]
    mss = [load(f) for f in mfiles]
    dp = len(osds)
    assert all(o["partition_count"] == dp for o in osds)
    shapes_all = mss[0]["param_shapes"]
    assert all(m["param_shapes"] == shapes_all for m in mss)
    out: dict = {}
    groups = []
    for g, shapes in enumerate(shapes_all):  # one fp32 flat per (sub-)group; default sub_group_size: one per group
        srcs = []
        for o in osds:
            st = o["optimizer_state_dict"]["state"][g]
            srcs.append({"fp32": o["fp32_flat_groups"][g], "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]})
        per = [math.ceil(s.numel() / dp) for s in shapes.values()]
        assert all(t.numel() == sum(per) for s in srcs for t in s.values())
        off = 0
        for (name, shape), ps in zip(shapes.items(), per):
            n = shape.numel()
            out[name] = {k: torch.cat([s[k][off : off + ps] for s in srcs])[:n].view(shape).clone() for k in srcs[0]}
            off += ps
        steps = {o["optimizer_state_dict"]["state"][g]["step"].item() for o in osds}
        assert len(steps) == 1
        hp = {k: v for k, v in osds[0]["optimizer_state_dict"]["param_groups"][g].items() if k != "params"}
        groups.append(dict(hp, names=list(shapes), step=steps.pop()))
    return out, {"groups": groups, "shared": mss[0]["shared_params"], "module": None, "round_robin": False}


def verify(d: str) -> None:
    tag = open(os.path.join(d, "latest")).read().strip()
    ck = os.path.join(d, tag)
    stage3 = bool(glob.glob(os.path.join(ck, "zero_pp_rank_*_model_states.pt")))
    full, info = (zero3 if stage3 else zero12)(ck)
    fp32_view = load(os.path.join(d, "ds_view_fp32.pt"))
    optim_view = load(os.path.join(d, "ds_view_optim.pt"))
    rr = info["round_robin"]
    for name, v in full.items():
        _check(f"{name} fp32 vs zero_to_fp32", v["fp32"], fp32_view[name])
        if rr:  # DeepSpeed's fragment views (live API, param_slice_mappings, universal) are wrong then
            continue
        _check(f"{name} fp32 vs live", v["fp32"], optim_view[name]["fp32"])
        for k in ("exp_avg", "exp_avg_sq"):
            _check(f"{name} {k} vs live", v[k], optim_view[name][k])
    for alias, target in info["shared"].items():
        _check(f"shared {alias}", fp32_view[alias], fp32_view[target])
    assert set(fp32_view) == set(full) | set(info["shared"])
    for g, want in zip(info["groups"], optim_view["__groups__"]):
        same = g["names"] == want["names"] or (rr and set(g["names"]) == set(want["names"]))
        assert same, (g["names"], want["names"])
        assert all(g[k] == want[k] for k in want if k != "names"), (g, want)
        for name in g["names"]:
            assert optim_view[name]["step"].item() == g["step"]
    n_uni = 0
    uni = os.path.join(d, "universal", "zero")
    if os.path.isdir(uni) and not rr:
        for name, v in full.items():
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                a = load(os.path.join(uni, name, f"{k}.pt"))
                if stage3:  # ZeRO-3 atoms: bare flat 1-D tensors
                    assert torch.is_tensor(a) and a.dim() == 1, (name, k, type(a))
                    _check(f"universal {name}/{k}", a, v[k].flatten())
                else:  # ZeRO-1/2 atoms: {"param": full-shape tensor, "cat_dim": 0}
                    assert set(a) == {"param", "cat_dim"}, a.keys()
                    _check(f"universal {name}/{k}", a["param"], v[k])
                n_uni += 1
            step = os.path.join(uni, name, "step.pt")
            if os.path.exists(step):
                assert load(step).item() == next(g["step"] for g in info["groups"] if name in g["names"])
        for alias in info["shared"]:  # ZeRO-1/2: written from the module state dict, {"param": tensor}
            if stage3:
                assert not os.path.exists(os.path.join(uni, alias)), alias  # ZeRO-3: no atom for a shared name
                continue
            a = load(os.path.join(uni, alias, "fp32.pt"))
            _check(f"universal shared {alias}", a["param"] if isinstance(a, dict) else a, fp32_view[alias])
    print(
        f"OK {d}: stage {'3' if stage3 else '1/2'}, {len(full)} params x (fp32, exp_avg, exp_avg_sq) bitwise equal "
        f"to DeepSpeed's view; groups {[len(g['names']) for g in info['groups']]} steps "
        f"{[g['step'] for g in info['groups']]}; {n_uni} universal atoms checked"
        + ("; round_robin: only zero_to_fp32 and module compared" if rr else "")
    )


def main() -> None:
    for d in sys.argv[1:]:
        verify(d)
    assert "deepspeed" not in sys.modules
    print("classes unpickled:", sorted(SEEN))


if __name__ == "__main__":
    main()
