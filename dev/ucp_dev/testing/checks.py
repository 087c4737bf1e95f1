"""The verdict of a resume check, shared by every resume recipe and test: the loaded state against the
oracle (bitwise), and the resumed losses against the uninterrupted reference (fp32 tolerances).

A resume at the *same* layout must match bitwise; at another layout the order of reductions differs, so
the losses may drift by fp32 rounding: :data:`TOL_FIRST` at the first resumed step, :data:`TOL_LAST` at
the last. Those two numbers are defined here only (the toy's elastic resume, FSDP1 -> FSDP2, torchtitan
dense and MoE resumes all use them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TOL_FIRST = 1e-5
"""Relative loss difference allowed at the first resumed step of a resume at another layout."""
TOL_LAST = 1e-4
"""Relative loss difference allowed at the last step (the drift grows with the steps)."""

COPIES_DIFFER = "<copies differ>"
"""What an oracle records for a value whose replicas disagree: never equal to anything."""


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: unlike ``torch.equal``, ``-0.0`` differs from ``0.0`` and a NaN equals
    the same NaN (a load copies bytes, so a right one leaves no room for either)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def state_diffs(oracle: dict, loaded: dict) -> list[str]:
    """Names of entries that are not bitwise equal (:func:`bitwise_equal`; other values by ``==``), or
    missing on one side."""
    diffs = sorted(set(oracle) ^ set(loaded))
    for k in sorted(set(oracle) & set(loaded)):
        a, b = oracle[k], loaded[k]
        if any(isinstance(x, str) and x == COPIES_DIFFER for x in (a, b)):
            same = False
        elif isinstance(a, torch.Tensor):
            same = isinstance(b, torch.Tensor) and bitwise_equal(a, b)
        else:
            same = a == b
        if not same:
            diffs.append(k)
    return diffs


def state_problem(diffs: Sequence[str], entries: int) -> list[str]:
    """The state half of a verdict: empty, or one line naming the first differing entries."""
    if not diffs:
        return []
    return [f"{len(diffs)} of {entries} loaded entries differ from the oracle ({', '.join(diffs[:5])})"]


def rel_diffs(reference: Sequence[float], resumed: Sequence[float]) -> list[float]:
    """Per resumed step, ``|resumed - reference| / |reference|`` (NaN stays NaN: a missing step fails)."""
    return [abs(x - r) / max(abs(r), 1e-12) for x, r in zip(resumed, reference)]


def loss_problems(rels: Sequence[float], first_step: int, last_step: int) -> list[str]:
    """The loss half of a verdict at another layout: the first resumed step within :data:`TOL_FIRST`, the
    last within :data:`TOL_LAST` (written ``not <=`` so that a NaN fails)."""
    if not rels:
        return [f"no resumed loss between steps {first_step} and {last_step}"]
    problems = []
    if not rels[0] <= TOL_FIRST:
        problems.append(f"first resumed step rel diff {rels[0]:.2e} > {TOL_FIRST:g}")
    if not rels[-1] <= TOL_LAST:
        problems.append(f"step {last_step} rel diff {rels[-1]:.2e} > {TOL_LAST:g}")
    return problems


def loss_note(rels: Sequence[float], first_step: int, last_step: int) -> str:
    """The figures of a good verdict, for its ``RESUME OK`` line."""
    return (
        f"loss rel diff {rels[0]:.1e} at step {first_step} (tol {TOL_FIRST:g}), "
        f"{rels[-1]:.1e} at step {last_step} (tol {TOL_LAST:g})"
    )
