"""Dtype conversions at load: which are safe, which need a value check, which lose values.

A conversion is "lossy" when the kind drops (complex > float > int > bool: the fraction, imaginary
part or magnitude is lost for ordinary values), "range" when the kind is kept or widened but some
saved values may not survive torch's cast (int64 -> int32, fp32 -> fp16/bf16/fp8, an inf into a
float8 format without one: checked value by value at read), and "safe" when every saved value
survives it (precision may still drop: fp32 -> bf16 rounds).

A value survives the cast when the cast changes it by rounding only. Past a floating format's largest
finite value ``max`` the next value would be ``max + ulp``; a value below the midpoint of the two (the
*rounding edge*, ``max + ulp/2``; at it, round-to-nearest-even picks ``max`` when its last mantissa bit
is 0, as in float8_e4m3fn's 448) rounds to ``max`` and loads as ``Tensor.to`` gives it (fp32 65519 ->
fp16 65504, 460 -> float8_e4m3fn 448); a finite value past the edge does not fit, whatever the cast
makes of it (inf, NaN, or a saturated ``max``: torch's CPU cast to float8_e4m3fn saturates), and
neither does a value the cast makes non-finite (an fp64 value rounded through fp32 to a tie), an inf
the format cannot hold (float8_e4m3fn, the fnuz formats), a negative value in a format without a sign
(float8_e8m0fnu) or a NaN into an integer type. NaN into a floating format stays NaN.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..errors import DtypeConversionError

__all__ = ["LOSS", "kind", "limits", "conversion", "check_range"]

LOSS = {  # what a lossy conversion does to ordinary values, by (saved kind, wanted kind)
    (3, 2): "drop the imaginary parts",
    (3, 1): "drop the imaginary parts and truncate the fractions",
    (2, 1): "truncate the fractions (1.7 -> 1)",
}

_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def kind(dtype: torch.dtype) -> int | None:
    if dtype == torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    try:
        torch.iinfo(dtype)
    except (TypeError, RuntimeError):
        return None  # quantized, sub-byte and other exotic dtypes: converted as torch does
    return 1


def limits(dtype: torch.dtype) -> tuple[float, float]:
    """Smallest and largest finite value (the real part's, for complex dtypes)."""
    info = torch.iinfo(dtype) if kind(dtype) == 1 else torch.finfo(dtype)
    return info.min, info.max


class Edges(NamedTuple):
    """A floating format's top, as its cast rounds into it."""

    max: float
    """The largest finite value."""
    edge: float
    """``max + ulp/2``: a larger magnitude does not round to ``max`` (inf for float64)."""
    edge_rounds_down: bool
    """A magnitude of exactly ``edge`` rounds to ``max`` (round to nearest even: ``max``'s last mantissa bit is 0)."""
    has_inf: bool
    """The format holds inf (float8_e4m3fn and the fnuz formats do not)."""
    signed: bool
    """The format holds negative values (float8_e8m0fnu does not)."""


@functools.cache
def edges(dtype: torch.dtype) -> Edges:
    """The :class:`Edges` of a floating (or complex: its parts') dtype, from ``finfo`` and torch's own cast."""
    dtype = _REAL.get(dtype, dtype)
    info = torch.finfo(dtype)
    # stored mantissa bits: the largest k with 1 + 2^-k exact (finfo's eps is off for float8_e5m2fnuz)
    k = 0
    while k < 52 and torch.tensor(1 + 2.0 ** -(k + 1), dtype=torch.float64).to(dtype).item() == 1 + 2.0 ** -(k + 1):
        k += 1
    ulp = math.ldexp(1.0, math.frexp(info.max)[1] - 1 - k)  # the spacing of max's binade
    inf = torch.tensor([math.inf]).to(dtype).to(torch.float32)
    return Edges(
        max=info.max,
        edge=info.max + ulp / 2,  # exact in float64; inf for float64 itself
        edge_rounds_down=(info.max / ulp) % 2 == 0,
        has_inf=bool(inf.isinf().item()),
        signed=info.min < 0,
    )


def _holds_inf(dtype: torch.dtype) -> bool:
    return kind(dtype) in (2, 3) and edges(dtype).has_inf


@functools.cache
def conversion(saved: torch.dtype, wanted: torch.dtype) -> str:
    """``"safe"``, ``"range"`` (values must be checked) or ``"lossy"`` for saved -> wanted."""
    ks, kw = kind(saved), kind(wanted)
    if saved == wanted or ks is None or kw is None or ks == 0:
        return "safe"
    if kw < ks:
        return "lossy"
    (slo, shi), (wlo, whi) = limits(saved), limits(wanted)
    fits = wlo <= slo and shi <= whi and (_holds_inf(wanted) or not _holds_inf(saved))
    return "safe" if fits else "range"


def _comparable(values: torch.Tensor) -> torch.Tensor:
    """``values`` in a dtype torch compares (float8 and uint16/32/64 have no comparisons), each value exact (a
    uint64 is viewed as int64: from 2^63 on it is negative, below every bound :func:`_bounds` gives it)."""
    if values.is_floating_point():
        return values.to(torch.float32) if values.dtype.itemsize == 1 else values
    if values.dtype in (torch.uint16, torch.uint32):
        return values.to(torch.int64)
    return values.view(torch.int64) if values.dtype == torch.uint64 else values


@functools.cache
def _toward(dtype: torch.dtype, x: float, up: bool) -> float:
    """The value of the floating ``dtype`` nearest ``x`` on the side of ``x`` inside a range ending there
    (torch converts a scalar to the tensor's dtype before comparing: bf16 rounds fp16's 65504 up to 65536)."""
    t = torch.tensor(x, dtype=torch.float64).to(dtype)
    if (t.item() < x) if up else (t.item() > x):
        t = torch.nextafter(t, torch.tensor(math.inf if up else -math.inf, dtype=dtype))
    return float(t.item())


@functools.cache
def _bounds(saved: torch.dtype, compared: torch.dtype, wanted: torch.dtype) -> tuple[float, float]:
    """``wanted``'s finite range ([-max, max], [0, max] without a sign, an integer type's) as bounds that a
    tensor of ``saved`` values held in ``compared`` (:func:`_comparable`) compares with exactly: its values
    inside the bounds are those inside the range."""
    if kind(wanted) == 1:
        lo, hi = limits(wanted)
    else:
        e = edges(wanted)
        lo, hi = (-e.max if e.signed else 0.0), e.max
    if compared.is_floating_point:
        return _toward(compared, lo, up=True), _toward(compared, hi, up=False)
    info = torch.iinfo(saved)
    return max(math.ceil(lo), info.min), min(math.floor(hi), info.max, torch.iinfo(compared).max)


def _float_misfits(values: torch.Tensor, wanted: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The saved ``values`` (real) that do not survive torch's cast into the floating ``wanted`` (see the module
    docstring): their count, the first of them (flattened order) and what the cast makes of it."""
    e, cmp = edges(wanted), _comparable(values)
    lo, hi = _bounds(values.dtype, cmp.dtype, wanted)
    # one pass over every value: those in [-max, max] ([0, max] unsigned) always survive; the rest (NaN, inf,
    # past max, negative) are few, and are cast and checked on their own
    inside = (cmp >= lo) & (cmp <= hi)
    if bool(inside.all()):
        return 0, values[:0], values[:0]
    some = values[~inside]
    v = some.to(torch.float64)
    got = some.to(_REAL.get(wanted, wanted)).to(torch.float64)  # torch's cast (float8 has few ops of its own)
    past = v.abs() > e.edge if e.edge_rounds_down else v.abs() >= e.edge
    bad = v.isfinite() & (past | ~got.isfinite())
    bad |= v.isinf() & (got != v)  # an inf the format cannot hold: NaN, or a saturated max
    bad |= v.isnan() & ~got.isnan()
    if not e.signed:
        bad |= v < 0
    return int(bad.sum()), some[bad][:1], got[bad][:1]


def _fmt(v: float | int, dtype: torch.dtype) -> str:
    """``v`` in as few digits as name it in ``dtype`` (``:g``'s six when they do)."""
    if not isinstance(v, float) or not math.isfinite(v):
        return str(v)
    for digits in range(6, 18):
        text = f"{v:.{digits}g}"
        if torch.tensor(float(text), dtype=torch.float64).to(dtype).item() == v:
            return text
    return repr(v)


def check_range(atom: str, src: torch.Tensor, wanted: torch.dtype) -> None:
    """Refuse saved values ``src`` that torch's cast into ``wanted`` changes beyond rounding: outside an
    integer target's range (NaN too), past a floating target's rounding edge, an inf it cannot hold (see
    the module docstring). Values that round to the target's largest finite value pass."""
    if not src.numel():
        return
    values = torch.view_as_real(src.resolve_conj()) if src.is_complex() else src
    lo, hi = limits(wanted)
    if kind(wanted) == 1:
        cmp = _comparable(values)
        low, high = _bounds(values.dtype, cmp.dtype, wanted)
        mask = (cmp < low) | (cmp > high)
        if cmp.is_floating_point():
            mask |= cmp.isnan()
        if not bool(mask.any()):
            return
        count, first = int(mask.sum()), values[mask][:1]
        became = first.to(wanted)
        how = "become" if first.is_floating_point() else "wrap around to"
        what = f"are outside {wanted}'s range [{lo}, {hi}]"
    else:
        count, first, became = _float_misfits(values, wanted)
        if not count:
            return
        e, how = edges(wanted), "become"
        pm = "±" if e.signed else ""
        top = _fmt(hi, wanted)
        what = f"do not fit {wanted}, whose finite values lie in [{_fmt(lo, wanted)}, {top}]"
        if e.edge < math.inf:
            what += f" (values {'up to' if e.edge_rounds_down else 'below'} {pm}{e.edge:.7g} round to {pm}{top})"
        what += "" if e.has_inf else "; it holds no inf"
        what += "" if e.signed else "; it holds no negative values"
    raise DtypeConversionError(
        f"atom '{atom}': saved dtype {src.dtype}, wanted dtype {wanted}: {count} saved value(s) {what} "
        f"(e.g. {_fmt(first.item(), values.dtype)}, which would {how} {_fmt(became.item(), wanted)})",
        atom=atom,
        saved=src.dtype,
        wanted=wanted,
        hint=f"load into a tensor of dtype {src.dtype} (or a wider one) and convert it yourself, or pass "
        "UCPLoadPlanner(allow_lossy_dtype=True) to convert the way Tensor.copy_ does",
    )
