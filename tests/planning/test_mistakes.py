"""The mistake-injection tier (``ucp_dev.testing.mistakes``, run by ``ucp_dev.testing.mistake_runs``): every ordinary mistake on every transition of the
reconfiguration set loads bitwise right or is refused with a UCPError naming the atom and the fix.

The harness's own logic is checked here without processes; a sample of runs (4 ranks) is in ``make test``;
the whole set, one item per transition, is in the e2e tier (``make mistakes`` prints the same set's summary).
"""

import dataclasses

import dist as D
import pytest
import torch
from test_reconfig import TRANSITIONS, _id

from ucp_dcp.errors import DtypeConversionError
from ucp_dcp.layout.dtypes import check_range, conversion
from ucp_dev.testing.mistake_dtypes import DTYPE_SCENARIOS, dtype_worker
from ucp_dev.testing.mistake_forms import SCENARIOS, WORLD, form_worker
from ucp_dev.testing.mistake_hooks import HOOK_SCENARIOS, hooks_worker
from ucp_dev.testing.mistake_runs import options, rule_key, transition_worker
from ucp_dev.testing.mistakes import (
    RULES,
    SAME_LAYOUT,
    USER_OWNED,
    WRITER_SWAP_TRANSITIONS,
    Mistake,
    all_mistakes,
    is_noop,
    plan,
    summary,
)
from ucp_dev.toy import ModelConfig, Topology

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BAD = ("silent", "crash", "unclear")


def test_every_rule_and_map_of_the_toy_has_a_key():
    opts = _options(Topology(tp=2, ep=2), ("correct",))
    keys = [rule_key(r) for r in opts["patterns"]] + [k for k in ("stage_map", "expert_map") if k in opts]
    assert sorted(keys) == sorted(RULES)


def _options(topo: Topology, variant: tuple[str, ...]) -> dict:
    return options(ModelConfig(), _FakeJob(topo), variant)


@dataclasses.dataclass
class _FakeJob:
    """What :func:`mistake_runs.options` reads of a job: its topology and this rank's coordinate."""

    topo: Topology
    coord: dict = dataclasses.field(default_factory=lambda: dict(pp=0, dpr=0, dp=0, ep=0, tp=0))


@pytest.mark.parametrize("key", RULES)
def test_a_drop_removes_exactly_that_rule(key):
    topo = Topology(tp=2, ep=2)
    full, dropped = _options(topo, ("correct",)), _options(topo, ("drop", key))
    have = lambda o: sorted([rule_key(r) for r in o["patterns"]] + [k for k in ("stage_map", "expert_map") if k in o])
    assert have(dropped) == sorted(set(have(full)) - {key})


@pytest.mark.parametrize("key", ["fused_wqkv", "fused_w13", "tied", "padded", "reduce", "stage_map", "expert_map"])
def test_an_alter_changes_exactly_that_rule(key):
    topo = Topology(tp=2, ep=2)
    full, altered = _options(topo, ("correct",)), _options(topo, ("alter", key))
    assert (
        altered["stage_map"] != full["stage_map"] if key == "stage_map" else altered["stage_map"] == full["stage_map"]
    )
    assert (
        altered["expert_map"] != full["expert_map"]
        if key == "expert_map"
        else altered["expert_map"] == full["expert_map"]
    )
    changed = [rule_key(a) for a, b in zip(altered["patterns"], full["patterns"]) if a != b]
    assert changed == ([] if key.endswith("_map") else [key])


def test_noops_are_skipped_not_run():
    dp4, tp2, ep2 = Topology(dp=4), Topology(dp=2, tp=2), Topology(ep=2, dp=2)
    assert is_noop(Mistake("drop", "expert_map", "both"), dp4, tp2)  # no EP at either side
    assert not is_noop(Mistake("drop", "expert_map", "load"), dp4, ep2)
    assert is_noop(Mistake("alter", "fused_w13", "save"), dp4, tp2)  # blocks="tp" is 1 block at tp=1
    assert not is_noop(Mistake("alter", "fused_w13", "load"), dp4, tp2)
    assert is_noop(Mistake("perturb", "hsdp"), dp4, tp2) and is_noop(Mistake("perturb", "tp_norm"), dp4, tp2)
    assert not is_noop(Mistake("perturb", "plain"), dp4, tp2)


def test_stock_over_ours_and_plain_tensors_pick_their_checkpoint_and_load():
    over = Mistake("writer", "over")
    assert over.save_variant == ("writer", "over") and over.load_variant == ("correct",)  # the toy's rules at load
    assert Mistake("writer").save_variant == ("writer", "stock")
    forgot = Mistake("plain", "expert_map", "load")
    assert forgot.save_variant == ("plain",) and forgot.load_variant == ("plain", "expert_map")
    assert Mistake("plain").load_variant == ("plain",)
    assert _options(Topology(ep=2), ("drop", "expert_map")).keys() == {"patterns", "stage_map"}


def test_plain_tensor_mistakes_run_where_the_load_has_stages_or_expert_lists():
    dp4, ep4, pp2 = Topology(dp=4), Topology(ep=4), Topology(pp=2)
    assert is_noop(Mistake("plain", "expert_map", "load"), ep4, dp4) and is_noop(Mistake("plain"), ep4, dp4)
    assert not is_noop(Mistake("plain", "expert_map", "load"), dp4, ep4)
    assert is_noop(Mistake("plain", "stage_map", "load"), dp4, ep4)
    assert not is_noop(Mistake("plain", "stage_map", "load"), dp4, pp2) and not is_noop(Mistake("plain"), dp4, pp2)


def test_the_plan_covers_every_class_on_every_transition_and_swaps_on_four():
    jobs, skipped = plan(TRANSITIONS)
    assert len(jobs) == len(TRANSITIONS) == 15 and skipped > 0
    names = {m.name for m in all_mistakes()}
    assert set(USER_OWNED) <= names  # the user-owned list names real mistakes
    for save, load, ms in jobs:
        assert ms[0] == "none" and len(ms) == len(set(ms))
        assert ("writer" in ms) == ((save, load) in WRITER_SWAP_TRANSITIONS)
    assert WRITER_SWAP_TRANSITIONS <= set(TRANSITIONS)


def test_the_summary_counts_silent_runs_and_leaves_user_owned_and_stock_ones_apart():
    r = lambda m, o, **kw: {"save": "dp=4", "load": "tp=4", "mistake": m, "outcome": o, **kw}
    ok, good = summary([r("none", "ok"), r("drop-padded-save", "refused", error="E")], skipped=3)
    assert good and ok[-1].startswith("MISTAKES OK: 2 runs, 0 silent")
    lines, good = summary(
        [
            r("none", "ok"),
            r("drop-stage_map-save", "silent", diffs=2, first=["a", "b"]),
            r("drop-fused_w13-both", "silent", diffs=1, first=["c"]),
            r("reader", "stock-silent"),
        ],
        0,
    )
    assert not good and lines[-1].startswith("MISTAKES FAILED: 4 runs, 1 silent, 0 crashed, 0 unclear")
    assert lines[0].startswith("SILENT") and "drop-stage_map-save" in lines[0]
    assert any(x.startswith("USER-OWNED") for x in lines) and any(x.startswith("STOCK-SILENT") for x in lines)


def test_a_refused_load_that_must_succeed_fails_the_summary_and_dtype_refusals_name_their_cause():
    r = lambda m, o, **kw: {"save": "fp32", "load": "fp16", "mistake": m, "outcome": o, **kw}
    lines, good = summary(
        [
            r("dtype-fp16-past", "refused", error="E", mentions=["dtype"]),
            r("dtype-fp16-edge", "overrefused", error="E"),
        ],
        0,
    )
    assert not good and lines[-1].startswith("MISTAKES FAILED: 2 runs, 0 silent, 0 crashed, 0 unclear, 1 refused")
    assert lines[0].startswith("OVERREFUSED") and "dtype-fp16-edge" in lines[0]
    assert not any(x.startswith("REFUSED?") for x in lines)  # the refusal names the dtype


@pytest.mark.parametrize("name", list(DTYPE_SCENARIOS))
def test_each_dtype_edge_run_expects_what_the_guard_does(name):
    """Without processes: a run that must be refused holds a value the guard refuses (at planning, for a lossy
    kind of conversion), one that must load holds none, or is loaded with allow_lossy_dtype=True."""
    sc = DTYPE_SCENARIOS[name]
    values = torch.tensor(sc.values, dtype=torch.float64).to(sc.saved)
    if conversion(sc.saved, sc.wanted) == "lossy":
        assert sc.must_refuse, name
        return
    try:
        check_range(name, values, sc.wanted)
        refused = False
    except DtypeConversionError:
        refused = True
    assert refused == (sc.must_refuse or sc.load.get("allow_lossy_dtype", False)), name


def _run(save: str, load: str, names: list[str]) -> list[dict]:
    world = 4 if max(Topology.parse(save).world, Topology.parse(load).world) <= 4 else 8
    return D.run(transition_worker, world, D.tmpdir(), save, load, names, timeout=1500)[0]


SAMPLE = [
    pytest.param("dp=2,pp=2", "pp=4", "none", marks=pytest.mark.full, id="none"),  # the same load, no mistake:
    # make test has it in test_peers' dp=2,pp=2 -> pp=4 and test_reconfig.py's transition
    pytest.param("dp=2,pp=2", "pp=4", "drop-padded-save", id="drop-padded-save"),
    pytest.param("dp=2,pp=2", "pp=4", "perturb-plain", id="perturb-plain"),
]


@pytest.mark.slow
@pytest.mark.parametrize("save,load,mistake", SAMPLE)
def test_a_sample_mistake_loads_right_or_is_refused(save, load, mistake):
    (r,) = _run(save, load, [mistake])
    print(r)
    assert r["outcome"] in (("ok",) if mistake == "none" else ("ok", "refused")), r


@pytest.mark.e2e
@pytest.mark.parametrize("save,load", TRANSITIONS + SAME_LAYOUT, ids=[_id(t) for t in TRANSITIONS + SAME_LAYOUT])
def test_no_mistake_is_silent(save, load):
    same = (save, load) in SAME_LAYOUT
    jobs, skipped = plan([] if same else [(save, load)], same_layout=[(save, load)] if same else [])
    ((_, _, names),) = jobs
    results = _run(save, load, names)
    lines, ok = summary(results, skipped)
    print("\n".join(lines))
    assert len(results) == len(names)
    assert ok, "\n".join(lines)


@pytest.mark.slow
def test_no_state_form_mistake_is_silent():
    """Ties without rules and the raw optimizer form (``ucp_dev.testing.mistake_forms``), every run on 2 ranks:
    each loads bitwise right or is refused naming the cause; copies that differ are always refused."""
    results = D.run(form_worker, WORLD, D.tmpdir(), list(SCENARIOS), timeout=900)[0]
    lines, ok = summary(results, skipped=0)
    for r in results:
        print(f"{r['mistake']:<22} {r['outcome']:<10} {r.get('error', '')[:150]}")
    print("\n".join(lines))
    by = {r["mistake"]: r for r in results}
    assert len(results) == len(SCENARIOS) and ok, "\n".join(lines)
    assert not any(x.startswith("REFUSED?") for x in lines), "\n".join(lines)  # every refusal names its cause
    for name in ("form-tied-same", "form-tied-plain", "form-tied-untied", "form-tied-rule", "form-tied-copies"):
        assert by[name]["outcome"] == "ok", by[name]  # correct use without a declaration: loads
    assert by["form-tied-stockwriter"]["outcome"] == "ok", by["form-tied-stockwriter"]  # copies compared when read
    for name in ("form-raw-same", "form-raw-plain", "form-raw-stockwriter"):
        assert by[name]["outcome"] == "ok", by[name]
    differ = ("form-tied-differ", "form-tied-differrule", "form-tied-stockdiffer")  # two values for one tensor
    for name in (*differ, "form-raw-regrouped", "form-raw-named", "form-raw-stages"):
        assert by[name]["outcome"] == "refused", by[name]
    assert by["form-tied-reader"]["outcome"] == by["form-raw-reader"]["outcome"] == "stock-ok"


@pytest.mark.slow
def test_no_subclass_hook_mistake_is_silent():
    """DCP's planner extension points overridden (``ucp_dev.testing.mistake_hooks``), every run on 2 ranks: each
    pattern does what DCP's planner would do with it, and the documented refusals are refused naming the hook."""
    results = D.run(hooks_worker, WORLD, D.tmpdir(), list(HOOK_SCENARIOS), timeout=900)[0]
    lines, ok = summary(results, skipped=0)
    for r in results:
        print(f"{r['mistake']:<22} {r['outcome']:<10} {r.get('error', '')[:150]}")
    print("\n".join(lines))
    assert len(results) == len(HOOK_SCENARIOS) and ok, "\n".join(lines)
    assert not any(x.startswith("REFUSED?") for x in lines), "\n".join(lines)
    for r in results:  # honoured where documented so, refused where documented so
        assert r["outcome"] == ("refused" if HOOK_SCENARIOS[r["mistake"]].must_refuse else "ok"), r


@pytest.mark.slow
def test_no_dtype_edge_mistake_is_silent():
    """Values at and past a narrower target's largest finite value (``ucp_dev.testing.mistake_dtypes``), every run
    on 2 ranks (DTensor and plain targets): what torch's cast only rounds loads as ``Tensor.to`` gives it, the
    rest is refused naming the atom."""
    results = D.run(dtype_worker, WORLD, D.tmpdir(), list(DTYPE_SCENARIOS), timeout=900)[0]
    lines, ok = summary(results, skipped=0)
    for r in results:
        print(f"{r['mistake']:<30} {r['outcome']:<10} {r.get('error', '')[:150]}")
    print("\n".join(lines))
    assert len(results) == len(DTYPE_SCENARIOS) and ok, "\n".join(lines)
    assert not any(x.startswith("REFUSED?") for x in lines), "\n".join(lines)
    for r in results:
        sc = DTYPE_SCENARIOS[r["mistake"]]
        assert r["outcome"] == ("refused" if sc.must_refuse else "ok"), r
        assert not sc.must_refuse or "DtypeConversionError" in r["error"], r
