"""Exact masses: weights held as fixed point, so that every sum over a row, every top-p cut and every draw by
inversion is the same integer whatever the order of the additions: across batches, on any device, and over a
vocabulary split into shards (docs/design.md, "Exact masses", "Vocab-parallel").

A weight ``w`` (float32, a probability or ``exp((x - max) / T)``: at most 1) has the mass ``floor(w * 2**32)``
(NaN and negatives 0, above 1 clamped to 1), an integer held in float64: the sums of a row of up to 2**21 tokens
stay below 2**53, so every partial sum is exact (and float64 runs vectorised where int64 does not). A row's sum
is the sum of its masses; a top-p cut keeps the tokens whose mass before them (in the cut's order) is below
``ceil(top_p * Z)``; a draw inverts ``t = floor(u * Z)`` over the prefix sums. A token lighter than ``2**-32`` of
the row's scale is never drawn (a 24-bit uniform resolves ``2**-24`` of a row in any case).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scratch import SCRATCH

MASS_BITS = 32
_CHUNK = 256  # columns per chunk in the two-step inversion of wide rows
_SCRATCH_FROM = 1 << 16  # masses of fewer values are allocated (a scratch lookup costs more than the pages)
_ONE = float(2**MASS_BITS)


def masses(w: Tensor, scratch: str | None = None) -> Tensor:
    """Masses of float weights in [0, 1] (any shape): ``floor(w * 2**32)``, NaN and negatives 0; integers in
    float64. ``scratch``: build them in the named scratch buffers (a temporary the caller does not keep)."""
    w = w.float()
    scratch = scratch if w.numel() >= _SCRATCH_FROM else None
    f32 = None if scratch is None else SCRATCH.get(scratch + " (float32)", w.shape, torch.float32, w.device)
    # w * 2**32 and its floor are exact in float32 (a power-of-two scale; from 2**24 on a float32 is an integer)
    m = torch.nan_to_num(w, nan=0.0, out=f32).clamp_(0.0, 1.0).mul_(_ONE).floor_()
    return m.double() if scratch is None else SCRATCH.get(scratch, w.shape, torch.float64, w.device).copy_(m)


def as_weight(mass: Tensor) -> Tensor:
    """float32 weight of a mass (a sum's: rounded once)."""
    return (mass / _ONE).float()


def row_mass(w: Tensor, keepdim: bool = False) -> Tensor:
    """float64 ``[...]``: the mass of each row of weights ``[..., C]`` (an exact integer)."""
    return masses(w, "row masses").sum(-1, keepdim=keepdim)


def divide_by(w: Tensor, mass: Tensor) -> Tensor:
    """``w / weight(mass)`` per row (``mass`` broadcastable to ``w``), 0 where the mass is 0."""
    z = as_weight(mass)
    return torch.where(mass > 0, w / torch.where(mass > 0, z, 1.0), 0.0)


def divide_by_(w: Tensor, mass: Tensor) -> Tensor:
    """:func:`divide_by` in place (a row without mass becomes 0 where its weights are finite)."""
    return w.div_(torch.where(mass > 0, as_weight(mass), float("inf")))


def normalise(w: Tensor) -> Tensor:
    """Rows ``[..., C]`` divided by their exact sums (a new tensor; rows without mass all 0)."""
    return divide_by(w, row_mass(w, keepdim=True))


def top_p_target(top_p: Tensor, mass: Tensor) -> Tensor:
    """The mass a top-p prefix must reach, ``ceil(top_p * Z)`` (float64), at most ``Z``."""
    return torch.minimum(torch.ceil(top_p.double() * mass), mass)


def draw_target(u: Tensor, mass: Tensor) -> Tensor:
    """The cumulative mass a draw of ``u`` in [0, 1) passes, ``floor(u * Z)`` (float64), in ``[0, Z - 1]`` (0
    when Z is 0)."""
    t = torch.floor(u.double().clamp(0.0, 1.0) * mass)
    return torch.minimum(t, mass - 1).clamp_(min=0)


def invert(cum: Tensor, t: Tensor) -> Tensor:
    """int64 ``[R]``: in each row of inclusive prefix sums ``cum`` ``[R, C]`` (masses), the first column whose sum
    exceeds ``t`` ``[R]`` (a column of positive mass when ``t`` is below the row's mass; else the last column
    of positive mass; 0 for a row without mass)."""
    C = cum.shape[1]
    idx = torch.searchsorted(cum, t[:, None].contiguous(), right=True)
    last = torch.searchsorted(cum, cum[:, -1:].contiguous(), right=False)
    return torch.minimum(idx, last).clamp_(0, max(C - 1, 0))[:, 0]


def sample_by_inversion(weights: Tensor, u: Tensor) -> Tensor:
    """Index of the first column whose cumulative mass exceeds ``floor(u * Z)``, per row.

    weights: float32 ``[R, C]`` in [0, 1] (need not be normalised); u: float32 ``[R]`` in [0, 1).
    Returns int64 ``[R]`` in ``[0, C)``: never a column without mass when the row has mass; 0 otherwise.
    Wide rows are inverted in two steps, over the masses of chunks of 256 columns, then inside the chunk
    found: the same column (the sums are exact), without the prefix sums of the whole row.
    """
    R, C = weights.shape
    if C == 0:
        return torch.zeros(R, dtype=torch.int64, device=weights.device)
    m = masses(weights, "draw masses")
    if C < 4 * _CHUNK:
        cum = m.cumsum(-1)
        return invert(cum, draw_target(u, cum[:, -1]))
    chunks = (torch.nn.functional.pad(m, (0, -C % _CHUNK)) if C % _CHUNK else m).view(R, -(-C // _CHUNK), _CHUNK)
    csum = chunks.sum(-1).cumsum(-1)
    t = draw_target(u, csum[:, -1])
    c = invert(csum, t)
    before = torch.where(c > 0, csum.gather(1, (c - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = chunks[torch.arange(R, device=weights.device), c]
    return (c * _CHUNK + invert(inner.cumsum(-1), t - before)).clamp_(max=C - 1)
