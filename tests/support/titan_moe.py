"""Shared steps of the MoE resume e2e tests (tests/e2e/test_titan_moe.py: qwen3 MoE,
tests/e2e/test_titan_deepseek.py: deepseek_v3): a save job that is also the uninterrupted reference,
resume jobs at other layouts from its step-``k`` checkpoint, and the checks that the state right
after the load, the batches and the losses match the reference; and ``ucp_dcp plan`` of the same
resumes against the real readers' ReadStats. :class:`Resumes` runs each resume job once, when a test
first asks for it, so the tests need no order among them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ucp_dev.testing import checks
from ucp_dev.testing.titan import jobs as tr
from ucp_dev.testing.titan.assets import make_assets


@dataclass(frozen=True)
class MoERun:
    """One save -> resume experiment."""

    config: str
    """Registry entry of ``ucp_dev.testing`` (e.g. ``qwen3_moe_small_ucp``)."""
    steps: int
    """Steps of every job: the save job runs them all, the resumes continue to the same last step."""
    k: int
    """The step whose checkpoint the resumes start from (and at which the save job writes its oracle)."""
    batch_rows: int = 8
    """Sequences in a global batch (the harness runs global batch 8)."""


def save(run: MoERun, root: Path, topo: dict[str, int]) -> tuple[Path, Path, Path]:
    """The save job at ``topo`` (checkpoint at step ``k``, oracle state dumped right after it):
    ``(root, assets, save folder)``."""
    assets = make_assets(root / "assets")
    out = root / "save"
    tr.run_job(
        topo,
        out,
        assets,
        run.steps,
        ["--checkpoint.interval", str(run.k)],
        tr.recording_env(out, UCP_TITAN_STATE=str(out / "oracle.pt"), UCP_TITAN_STATE_STEP=str(run.k)),
        config=run.config,
    )
    return root, assets, out


def resume(run: MoERun, saved: tuple[Path, Path, Path], name: str, topo: dict[str, int], **extra: str):
    """Resume job ``name`` at ``topo`` from the step-``k`` checkpoint: ``(oracle, loaded, folder)``.
    Each rank also writes its reader's ReadStats after the load (tests/e2e/test_plan_target.py's
    hook), for :func:`plan_matches`."""
    import torch
    from test_plan_target import _STATS_HOOK

    root, assets, saved_at = saved
    load = root / name
    hook = root / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_STATS_HOOK)
    paths = {
        "PYTHONPATH": os.pathsep.join([str(hook), tr.CODE_PATH]),
        "UCP_PLAN_STATS": str(load / "stats"),
    }
    tr.run_job(
        topo,
        load,
        assets,
        run.steps,
        tr.resume_flags(saved_at, run.k, run.steps),
        tr.recording_env(load, UCP_TITAN_STATE=str(load / "loaded.pt"), **paths, **extra),
        config=run.config,
    )
    # the hook writes a rank's stats only from UCPFileSystemReader: every rank loaded through ucp_dcp
    missing = [r for r in range(tr.world_size(topo)) if not (load / f"stats.{r}").is_file()]
    assert not missing, f"{name}: ranks {missing} did not load through UCPFileSystemReader"
    oracle = torch.load(saved_at / "oracle.pt", weights_only=False)
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    return oracle, loaded, load


class Resumes:
    """``resumes(name)``: :func:`resume` of ``topos[name]``, run when a test first asks for it and
    kept, so every test that needs a resume gets it whatever ran before (shuffled order, a ``-k``
    subset). A job that failed is not run again: each test that asks fails with its error."""

    def __init__(self, run: MoERun, saved: tuple[Path, Path, Path], topos: dict[str, dict[str, int]]) -> None:
        self.run, self.saved, self.topos = run, saved, topos
        self._done: dict[str, tuple | BaseException] = {}

    def __call__(self, name: str) -> tuple[dict, dict, Path]:
        if name not in self._done:
            try:
                self._done[name] = resume(self.run, self.saved, name, self.topos[name])
            except Exception as e:  # kept: every test that asks fails with it, none reruns the job
                self._done[name] = e
        got = self._done[name]
        if isinstance(got, BaseException):
            raise RuntimeError(f"resume job {name!r} failed") from got
        return got


def assert_resumed(
    run: MoERun, oracle: dict, loaded: dict, saved_at: Path, load: Path, reset: tuple[str, ...] = ()
) -> None:
    """Bitwise state right after the load (but the entries named in ``reset``), the same sequences
    per step, losses continuing within reduction-order noise (``checks.TOL_FIRST`` at the first resumed
    step, ``checks.TOL_LAST`` at the last)."""
    bad = [k for k in checks.state_diffs(oracle, loaded) if k not in reset]
    assert not bad, f"{len(bad)} of {len(oracle)} entries differ: {bad[:6]}"
    ref, res = tr.losses(saved_at / "loss.json"), tr.losses(load / "loss.json")
    rel = [abs(res[s] - ref[s]) / abs(ref[s]) for s in range(run.k + 1, run.steps + 1)]
    assert rel[0] <= checks.TOL_FIRST and rel[-1] <= checks.TOL_LAST, (ref, res)
    ref_b, res_b = tr.batches(saved_at / "batches.json"), tr.batches(load / "batches.json")
    steps = range(run.k + 1, run.steps + 1)
    assert all(res_b[s] == ref_b[s] and len(ref_b[s]) == run.batch_rows for s in steps), (ref_b, res_b)


def flipped_only(oracle: dict, loaded: dict, load: Path) -> list[str]:
    """The sabotage run's differing entries (activation-checkpoint segment stripped); the launcher
    must have logged the flip."""
    assert "flipped rows 0 and 1" in (load / "log.txt").read_text()
    return [k.replace("_checkpoint_wrapped_module.", "") for k in checks.state_diffs(oracle, loaded)]


def plan_matches(resumes: Resumes, names: list[str]) -> None:
    """``ucp_dcp plan --target titan`` of each named resume, in this process, against the real
    resume's per-rank ReadStats (bytes read, read calls, bytes received, fallbacks); runs the
    resumes it compares against if no test has yet."""
    from test_plan_target import _flags

    from ucp_dcp.tools.dryrun import plan_load
    from ucp_dcp.torchtitan.plan_target import TitanTarget

    run, (_, assets, saved_at) = resumes.run, resumes.saved
    for name in names:
        topo = resumes.topos[name]
        _, _, load = resumes(name)
        target = TitanTarget.from_args(_flags(assets, config=run.config, **topo))
        report = plan_load(saved_at / "checkpoint" / f"step-{run.k}", target, device="cpu", ranks_per_node=8)
        assert report.loads, (name, report.problems)
        real = [json.loads((load / f"stats.{r}").read_text()) for r in range(tr.world_size(topo))]
        planned = [
            {"bytes_read": r.bytes_read, "reads": r.reads, "bytes_received": r.bytes_received, "fallbacks": r.fallbacks}
            for r in report.ranks
        ]
        assert planned == real, name
