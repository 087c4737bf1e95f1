"""Mistakes at the *dtype edge* (issue 46): saved values at and past the largest finite value of a narrower target
(fp16, bf16, the float8 formats), loaded into targets of that dtype, on 2 gloo ranks beside the other classes of
the harness (:mod:`ucp_dev.testing.mistakes`). Each run saves one DTensor (``Shard(0)``, every rank's shard
holding every value) and one plain tensor (the same on every rank), with ucp_dcp's writer or stock DCP's, and
loads them with ucp_dcp (read-once on or off) into DTensor and plain targets of the wanted dtype.

A value torch's cast only rounds (fp32 65519 -> fp16 65504, 460 -> float8_e4m3fn 448, inf and NaN where the
target holds them) must load bitwise as ``Tensor.to`` gives it: ``ok``; refused, the load is ``overrefused`` (the
bug of issue 46, counted as a failure). A value the cast changes beyond rounding (past the rounding edge, an inf
the target cannot hold, a NaN into an integer type) must be refused with a ``DtypeConversionError`` naming the
atom: ``refused``; returning at all is ``silent``. With ``allow_lossy_dtype=True`` every value loads as
``Tensor.to`` gives it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ucp_dcp.api import load as ucp_load
from ucp_dcp.api import save as ucp_save
from ucp_dev.testing.checks import state_diffs
from ucp_dev.testing.mistake_runs import agree, attempt

__all__ = ["DTYPE_SCENARIOS", "dtype_worker"]

INF, NAN = float("inf"), float("nan")
F16, BF16, E4M3, E5M2 = torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DtypeScenario:
    """Values saved in one dtype and loaded into another."""

    values: tuple[float, ...]
    """Each rank's shard of the DTensor, and the plain tensor."""
    wanted: torch.dtype
    """The target's dtype."""
    must_refuse: bool = False
    """A value the cast changes beyond rounding: only a refusal is right."""
    saved: torch.dtype = torch.float32
    writer: str = "ucp"
    """``"ucp"`` (``ucp_dcp.save``) or ``"stock"`` (``dcp.save`` with DCP's default planner and writer)."""
    load: dict[str, Any] = field(default_factory=dict)
    """Options of ``ucp_dcp.load`` (``read_once``, ``allow_lossy_dtype``)."""

    def describe(self) -> tuple[str, str]:
        """The save and load sides, as the summary prints them."""
        values = ", ".join(f"{v:g}" for v in self.values)
        save = f"{_name(self.saved)} [{values}]" + (", stock dcp.save" if self.writer == "stock" else "")
        opts = "".join(f", {k}={v}" for k, v in self.load.items())
        return save, f"{_name(self.wanted)} DTensor Shard(0) + plain{opts}"

    def run(self, folder: str) -> tuple[dict, dict]:
        """On every rank: save and load in ``folder``; (``Tensor.to``'s values, the loaded ones), this rank's."""
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        local = torch.tensor(self.values, dtype=torch.float64).to(self.saved)
        # from_local: no collective on the float8 bytes (gloo has no float8 type)
        state = {"w": DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False), "plain": local.clone()}
        if self.writer == "stock":
            dcp.save(state, checkpoint_id=folder)
        else:
            ucp_save(state, folder)
        zeros = torch.zeros(len(self.values), dtype=self.wanted)
        target = {"w": DTensor.from_local(zeros.clone(), mesh, [Shard(0)], run_check=False), "plain": zeros.clone()}
        ucp_load(target, folder, **self.load)
        expected = local.to(self.wanted)
        return {"w": expected, "plain": expected}, {"w": target["w"].to_local(), "plain": target["plain"]}


DTYPE_SCENARIOS: dict[str, DtypeScenario] = {
    # values torch's cast rounds to the target's largest finite value (or keeps: inf, NaN where it holds them)
    "dtype-fp16-edge": DtypeScenario((65519.0, -65519.0, 65504.0, 1.0), F16),
    "dtype-bf16-edge": DtypeScenario((3.39e38, -3.39e38, 1.0, 0.5), BF16),
    "dtype-e4m3fn-edge": DtypeScenario((460.0, 464.0, -460.0, 1.0), E4M3),
    "dtype-e5m2-edge": DtypeScenario((60000.0, -61439.0, 57344.0, 0.5), E5M2),
    "dtype-e4m3fnuz-edge": DtypeScenario((247.0, -247.0, 240.0, 1.0), torch.float8_e4m3fnuz),
    "dtype-fp16-nonfinite": DtypeScenario((INF, -INF, NAN, 1.0), F16),
    "dtype-fp16-stockwriter": DtypeScenario((65519.0, -65519.0, 1.0, 0.5), F16, writer="stock"),
    "dtype-e4m3fn-readonce": DtypeScenario((460.0, -464.0, 1.0, 0.5), E4M3, load={"read_once": "ranks"}),
    # values it changes beyond rounding
    "dtype-fp16-past": DtypeScenario((1.0, 2.0, 3.0, 65520.0), F16, must_refuse=True),
    "dtype-bf16-past": DtypeScenario((1.0, 2.0, 3.0, 3.3962e38), BF16, must_refuse=True),
    "dtype-e4m3fn-past": DtypeScenario((1.0, 2.0, 3.0, 470.0), E4M3, must_refuse=True),  # torch saturates: 448
    "dtype-e4m3fn-inf": DtypeScenario((1.0, 2.0, 3.0, INF), E4M3, must_refuse=True),  # torch: 448
    "dtype-e5m2fnuz-inf": DtypeScenario(
        (1.0, 2.0, 57344.0, INF), torch.float8_e5m2fnuz, must_refuse=True, saved=E5M2
    ),  # the same finite range, and NaN for inf
    "dtype-int32-nan": DtypeScenario((1.0, 2.0, 3.0, NAN), torch.int32, must_refuse=True),
    "dtype-fp16-past-readonce": DtypeScenario((1.0, 2.0, 3.0, 7e4), F16, must_refuse=True, load={"read_once": "ranks"}),
    "dtype-e4m3fn-past-stockwriter": DtypeScenario((1.0, 2.0, INF, 470.0), E4M3, must_refuse=True, writer="stock"),
    # the user's choice: every value as Tensor.to converts it
    "dtype-e4m3fn-lossy": DtypeScenario((1.0, 470.0, INF, -INF), E4M3, load={"allow_lossy_dtype": True}),
}
"""Every dtype-edge run, by the name the summary prints."""


def _verdict(sc: DtypeScenario, failure: dict | None, diffs: list[str]) -> dict:
    if failure is not None:
        res = dict(failure)
        if not sc.must_refuse and res["outcome"] == "refused":
            res["outcome"] = "overrefused"  # a load that Tensor.to converts by rounding only, refused
        return res
    if sc.must_refuse:
        return {"outcome": "silent", "diffs": 0, "first": ["a value the cast changes beyond rounding loaded; no error"]}
    return {"outcome": "silent", "diffs": len(diffs), "first": diffs[:4]} if diffs else {"outcome": "ok"}


def dtype_worker(rank: int, world: int, root: str, names: list[str]) -> list[dict] | None:
    """Every rank: run the scenarios ``names`` (one folder each); rank 0 returns the harness's result dicts."""
    results = []
    for name in names:
        sc = DTYPE_SCENARIOS[name]
        failure, expected, loaded = attempt(sc.run, os.path.join(root, name))
        failure = agree(failure)
        diffs = [] if failure is not None or sc.must_refuse else state_diffs(expected, loaded)
        diffs = agree(diffs or None) or []  # every rank compares its own shard
        dist.barrier()
        save, load = sc.describe()
        results.append({"save": save, "load": load, "mistake": name, **_verdict(sc, failure, diffs)})
    return results if rank == 0 else None
