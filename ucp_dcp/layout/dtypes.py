"""Dtype conversions at load: which are safe, which need a value check, which lose values.

A conversion is "lossy" when the kind drops (complex > float > int > bool: the fraction, imaginary
part or magnitude is lost for ordinary values), "range" when the kind is kept or widened but some
saved values may not fit the target (int64 -> int32, fp32 -> fp16/bf16: checked value by value
at read), and "safe" when every saved value fits (precision may still drop: fp32 -> bf16 rounds).
"""

from __future__ import annotations

import functools

import torch

from ..errors import DtypeConversionError

__all__ = ["LOSS", "kind", "limits", "conversion", "check_range"]

LOSS = {  # what a lossy conversion does to ordinary values, by (saved kind, wanted kind)
    (3, 2): "drop the imaginary parts",
    (3, 1): "drop the imaginary parts and truncate the fractions",
    (2, 1): "truncate the fractions (1.7 -> 1)",
}


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


@functools.cache
def conversion(saved: torch.dtype, wanted: torch.dtype) -> str:
    """``"safe"``, ``"range"`` (values must be checked) or ``"lossy"`` for saved -> wanted."""
    ks, kw = kind(saved), kind(wanted)
    if saved == wanted or ks is None or kw is None or ks == 0:
        return "safe"
    if kw < ks:
        return "lossy"
    (slo, shi), (wlo, whi) = limits(saved), limits(wanted)
    return "safe" if wlo <= slo and shi <= whi else "range"


def check_range(atom: str, src: torch.Tensor, wanted: torch.dtype) -> None:
    """Refuse saved values ``src`` that do not fit ``wanted`` (inf/NaN stay inf/NaN and pass)."""
    if not src.numel():
        return
    values = torch.view_as_real(src) if src.is_complex() else src
    lo, hi = limits(wanted)
    if kind(wanted) == 1:
        bad = (values < lo) | (values > hi)
    else:
        bad = ((values < -hi) | (values > hi)) & values.isfinite()
    if not bool(bad.any()):
        return
    example = values[bad].reshape(-1)[0].item()
    how = "wrap around" if kind(wanted) == 1 else "become inf"

    def fmt(v: float) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    raise DtypeConversionError(
        f"atom '{atom}': saved dtype {src.dtype}, wanted dtype {wanted}: {int(bad.sum())} saved value(s) "
        f"are outside {wanted}'s range [{fmt(lo)}, {fmt(hi)}] (e.g. {fmt(example)}) and would {how}",
        atom=atom,
        saved=src.dtype,
        wanted=wanted,
        hint=f"load into a tensor of dtype {src.dtype} (or a wider one) and convert it yourself, or pass "
        "UCPLoadPlanner(allow_lossy_dtype=True) to convert the way Tensor.copy_ does",
    )
