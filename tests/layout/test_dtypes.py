"""The dtype range guard against torch's own cast (single process): a saved value is refused exactly when
converting it changes it beyond rounding (a finite value past the target's rounding edge, max + half an ulp,
becomes inf or NaN or is saturated; an inf the target cannot hold), and every value it lets through converts
as ``Tensor.to`` converts it. The oracle below rounds by hand from each format's mantissa width and exponent
range, not from ``ucp_dcp.layout.dtypes``; over every bit pattern of the 8- and 16-bit formats, and over
fp32/fp64 values at and around every target's edges (hypothesis)."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_dcp.errors import DtypeConversionError
from ucp_dcp.layout.dtypes import check_range, conversion

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
E4M3, E4M3UZ, E5M2, E5M2UZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz
FLOATS = [F64, F32, BF16, F16, E4M3, E4M3UZ, E5M2, E5M2UZ]
MANTISSA = {F64: 52, F32: 23, BF16: 7, F16: 10, E4M3: 3, E4M3UZ: 3, E5M2: 2, E5M2UZ: 2}
"""Stored mantissa bits (finfo's eps says 0.125 for e5m2fnuz, whose spacing above 1 is 0.25)."""
HAS_INF = {F64, F32, BF16, F16, E5M2}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
INF, NAN = math.inf, math.nan
ATOM = "blk.0.w"


def _name(d):
    return str(d).removeprefix("torch.")


def rounded(a, wanted):
    """``a`` (>= 0, finite) rounded to nearest, ties to even, in ``wanted``'s format with no top to its
    exponent range (so a result above its max is an overflow)."""
    if a == 0:
        return 0.0
    emin = math.frexp(torch.finfo(wanted).smallest_normal)[1] - 1
    e = max(math.frexp(a)[1] - 1, emin)
    ulp = math.ldexp(1.0, e - MANTISSA[wanted])
    return round(a / ulp) * ulp  # Python's round: exact, half to even


def refused(v, cast, wanted):
    """The guard's verdict for one saved value ``v`` that torch's own cast makes ``cast``: the cast changes it
    beyond rounding."""
    if math.isnan(v):
        return False  # every floating format holds a NaN
    if math.isinf(v):
        return wanted not in HAS_INF
    if rounded(abs(v), wanted) > torch.finfo(wanted).max:
        return True  # past the rounding edge: inf, NaN or a saturated max, whatever the cast does
    # torch rounds a wider value twice (fp64 -> fp32 -> fp16): a finite value it makes inf is refused as well
    return not math.isfinite(cast)


def expected_load(v, saved, wanted):
    """What a value the guard lets through must load as: its rounding (through fp32 first for an fp64 value
    into a narrower format, as torch converts)."""
    if not math.isfinite(v):
        return v
    if saved == F64 and wanted.itemsize < 4:
        v = torch.tensor(v, dtype=F64).to(F32).item()
    r = math.copysign(rounded(abs(v), wanted), v)
    return 0.0 if r == 0 and wanted in (E4M3UZ, E5M2UZ) else r  # fnuz formats hold no -0


def check_against_oracle(saved_values: torch.Tensor, wanted):
    """check_range on ``saved_values`` refuses iff the oracle refuses a value, naming the atom, the count and
    the first refused value; without the refused values it passes, and the rest convert as the oracle says.
    Returns the verdicts."""
    saved = saved_values.dtype
    flat = saved_values.reshape(-1).to(F64).tolist()
    casts = saved_values.reshape(-1).to(wanted).to(F64).tolist()
    verdicts = [refused(v, c, wanted) for v, c in zip(flat, casts)]
    bad = [v for v, r in zip(flat, verdicts) if r]
    ctx = f"{_name(saved)} -> {_name(wanted)}"
    if bad:
        with pytest.raises(DtypeConversionError) as info:
            check_range(ATOM, saved_values, wanted)
        err = info.value
        text = str(err)
        assert err.atom == ATOM and f"'{ATOM}'" in text, ctx
        assert err.saved == saved and err.wanted == wanted, ctx
        assert f": {len(bad)} saved value(s) " in text, (ctx, len(bad), text)
        example = re.search(r"\(e\.g\. (\S+?)[,)]", text)
        assert example, text
        assert torch.tensor(float(example.group(1)), dtype=F64).to(saved).item() == bad[0], (ctx, bad[0], text)
        assert "allow_lossy_dtype=True" in err.hint
    else:
        check_range(ATOM, saved_values, wanted)
    keep = torch.tensor([not r for r in verdicts]).reshape(saved_values.shape)
    check_range(ATOM, saved_values[keep], wanted)  # the values it lets through
    for v, got, r in zip(flat, casts, verdicts):
        if r:
            continue
        want = expected_load(v, saved, wanted)
        nan = math.isnan(got) and math.isnan(want)
        assert nan or (got == want and math.copysign(1, got) == math.copysign(1, want)), (ctx, v, got, want)
    return verdicts


def every_value(dtype) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit format."""
    n = 1 << (8 * dtype.itemsize)
    return torch.arange(n, dtype=torch.int64).to(BITS[dtype.itemsize]).view(dtype)


# -- the four legitimate loads of issue 46, and the silent one ---------------------------------------------------


@pytest.mark.parametrize(
    "value,wanted,loads_as",
    [
        (65519.0, F16, 65504.0),
        (-65519.0, F16, -65504.0),
        (3.39e38, BF16, torch.finfo(BF16).max),
        (460.0, E4M3, 448.0),
        (464.0, E4M3, 448.0),  # the edge itself: a tie, to the even 448 (mantissa 110)
        (60000.0, E5M2, 57344.0),
        (61439.0, E5M2, 57344.0),
        (247.0, E4M3UZ, 240.0),
    ],
    ids=lambda x: _name(x) if isinstance(x, torch.dtype) else None,
)
def test_values_that_round_to_the_largest_finite_value_load(value, wanted, loads_as):
    src = torch.tensor([1.0, value], dtype=F32)
    check_range(ATOM, src, wanted)
    assert src.to(wanted).to(F64).tolist() == [1.0, loads_as]


@pytest.mark.parametrize(
    "value,wanted,becomes",
    [
        (65520.0, F16, "inf"),  # the edge: a tie, away from the odd 65504 to inf
        (-1e6, F16, "-inf"),
        (3.3962e38, BF16, "inf"),
        (464.0001, E4M3, "448"),  # torch saturates: past the edge, a silent 448
        (1000.0, E4M3, "448"),
        (INF, E4M3, "448"),  # no inf in float8_e4m3fn: torch makes it 448
        (-INF, E4M3, "-448"),
        (INF, E4M3UZ, "nan"),
        (248.0, E4M3UZ, "nan"),
        (61440.0, E5M2, "inf"),
        (INF, E5M2UZ, "nan"),
        (61440.0, E5M2UZ, "nan"),
    ],
    ids=lambda x: _name(x) if isinstance(x, torch.dtype) else None,
)
def test_values_past_the_rounding_edge_and_infs_the_target_cannot_hold_are_refused(value, wanted, becomes):
    src = torch.tensor([1.0, value, 2.0, value], dtype=F32)
    with pytest.raises(DtypeConversionError) as info:
        check_range(ATOM, src, wanted)
    text = str(info.value)
    assert f"'{ATOM}'" in text and ": 2 saved value(s) " in text, text
    assert f"which would become {becomes})" in text, text
    first = float(re.search(r"\(e\.g\. (\S+?),", text).group(1))
    assert torch.tensor(first, dtype=F32).item() == torch.tensor(value, dtype=F32).item(), text


def test_nan_into_an_integer_type_is_refused():
    with pytest.raises(DtypeConversionError) as info:
        check_range(ATOM, torch.tensor([1.0, NAN, 2.0]), torch.int32)
    assert ": 1 saved value(s) " in str(info.value) and "e.g. nan" in str(info.value)


def test_integers_follow_the_same_edge():
    check_range(ATOM, torch.tensor([65519, -65519], dtype=torch.int32), F16)
    check_range(ATOM, torch.tensor([464, -460], dtype=torch.int16), E4M3)
    for values, wanted in (([65520], F16), ([465], E4M3), ([-(2**40)], E5M2)):
        with pytest.raises(DtypeConversionError):
            check_range(ATOM, torch.tensor(values, dtype=torch.int64), wanted)


def test_integer_ranges_are_checked_exactly():
    """Bounds a tensor compares with exactly: torch converts a scalar bound to the tensor's dtype first (2^31 - 1
    is 2^31 in fp32, uint64's max is -1 in int64), and has no comparisons for uint16/32/64."""
    u64 = torch.uint64
    fits = [
        ([0, 1, 2**62], torch.int64, u64),
        ([1, 2**63 - 1], u64, torch.int64),
        ([0, 255], torch.uint16, torch.uint8),
        ([127], torch.uint32, torch.int8),
        ([65519], torch.uint32, F16),
        ([-(2.0**31), 2.0**31 - 128], F32, torch.int32),
        ([2**63 + 5], u64, torch.float8_e8m0fnu),
    ]
    for values, saved, wanted in fits:
        check_range(ATOM, torch.tensor(values, dtype=saved), wanted)
    past = [
        ([1, -1], torch.int64, u64),
        ([1, 2**63], u64, torch.int64),
        ([255, 300], torch.uint16, torch.uint8),
        ([65520], torch.uint32, F16),
        ([2.0**31], F32, torch.int32),
    ]
    for values, saved, wanted in past:
        with pytest.raises(DtypeConversionError, match=r": 1 saved value\(s\) "):
            check_range(ATOM, torch.tensor(values, dtype=saved), wanted)


def test_complex_parts_follow_the_edge_of_the_real_format():
    below = torch.nextafter(torch.tensor(3.4028235677973366e38, dtype=F64), torch.tensor(0.0, dtype=F64)).item()
    src = torch.tensor([complex(below, -below), complex(1, INF)], dtype=torch.complex128)
    check_range(ATOM, src, torch.complex64)
    assert torch.view_as_real(src.to(torch.complex64))[0].tolist() == [torch.finfo(F32).max, -torch.finfo(F32).max]
    with pytest.raises(DtypeConversionError, match=r": 1 saved value\(s\) "):
        check_range(ATOM, torch.tensor([complex(1, 3.4028235677973366e38)], dtype=torch.complex128), torch.complex64)


def test_e8m0_holds_no_sign_and_no_inf():
    e8m0 = torch.float8_e8m0fnu
    check_range(ATOM, torch.tensor([0.0, 1.4, 3.0, 2.0**127, 1.4 * 2.0**127, NAN]), e8m0)
    for value in (-1.0, -(2.0**-130), 1.5 * 2.0**127, INF):
        with pytest.raises(DtypeConversionError):
            check_range(ATOM, torch.tensor([2.0, value]), e8m0)


def test_an_inf_the_target_cannot_hold_makes_the_conversion_range_checked():
    assert conversion(E5M2, E5M2UZ) == "range"  # the same finite range; inf becomes NaN
    assert conversion(F16, E4M3) == "range" and conversion(E4M3UZ, E4M3) == "safe"
    assert conversion(E5M2UZ, E5M2) == "safe" and conversion(BF16, F32) == "safe"


# -- every pair the guard knows, against the oracle ---------------------------------------------------------------


@pytest.mark.parametrize("saved", [BF16, F16, E4M3, E4M3UZ, E5M2, E5M2UZ], ids=_name)
def test_every_value_of_a_narrow_format_against_torchs_cast(saved):
    """Every bit pattern of ``saved`` into every floating format: the guard's refusals are the oracle's, and
    a conversion called safe refuses nothing."""
    values = every_value(saved)
    for wanted in FLOATS:
        if wanted == saved:
            continue
        verdicts = check_against_oracle(values, wanted)
        assert conversion(saved, wanted) == "range" or not any(verdicts), (saved, wanted)


def _edges(saved, wanted):
    """Values at and around ``wanted``'s edges, as ``saved`` holds them: its max, the rounding edge (max + half
    an ulp), the neighbours of both in ``saved``, its subnormals and half its smallest one, ``saved``'s own max."""
    fi = torch.finfo(wanted)
    ulp = math.ldexp(1.0, math.frexp(fi.max)[1] - 1 - MANTISSA[wanted])
    sub = math.ldexp(fi.smallest_normal, -MANTISSA[wanted])
    points = [fi.max, fi.max + ulp / 2, fi.max + ulp, fi.smallest_normal, sub, sub / 2, sub * 1.5]
    points += [torch.finfo(saved).max, torch.finfo(saved).smallest_normal, 1.0, 0.0]
    t = torch.tensor(points, dtype=F64).to(saved)
    t = t[t.to(F64).isfinite()]
    bits = t.view(BITS[saved.itemsize]).to(torch.int64)
    near = torch.cat([bits - 1, bits + 1]).clamp(0, (1 << (8 * saved.itemsize - 1)) - 1).to(BITS[saved.itemsize])
    return t.to(F64).tolist() + near.view(saved).to(F64).tolist() + [INF, NAN]


@st.composite
def saved_values(draw):
    saved = draw(st.sampled_from(FLOATS))
    wanted = draw(st.sampled_from([w for w in FLOATS if w != saved]))
    pick = st.one_of(
        st.sampled_from(_edges(saved, wanted)),
        st.floats(allow_nan=True, allow_infinity=True, width=64 if saved == F64 else 32),
    )
    raw = draw(st.lists(st.tuples(pick, st.booleans()), min_size=1, max_size=12))
    values = torch.tensor([-v if neg else v for v, neg in raw], dtype=F64).to(saved)
    if len(raw) % 2 == 0 and draw(st.booleans()):
        values = values.reshape(2, -1).t()  # a strided view: the first refused value in its own order
    return values, wanted


@settings(max_examples=120)
@given(saved_values())
def test_the_guard_follows_torchs_cast_at_every_edge(case):
    values, wanted = case
    check_against_oracle(values, wanted)
