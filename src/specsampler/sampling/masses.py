"""Exact masses: weights held as int64 fixed point, so that every sum over a row, every top-p cut and every draw
by inversion is the same integer whatever the order of the additions: across batches, on any device, and over a
vocabulary split into shards (docs/design.md, "Randomness", "Vocab-parallel").

A weight ``w`` (float32, a probability or ``exp((x - max) / T)``: at most 1) has the mass ``floor(w * 2**40)``
(NaN and negatives 0, above 1 clamped to 1). A row's sum is the integer sum of its masses; a top-p cut keeps the
tokens whose mass before them (in the cut's order) is below ``ceil(top_p * Z)``; a draw inverts
``t = floor(u * Z)`` over the integer prefix sums. A token lighter than ``2**-40`` of the heaviest is never drawn.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASS_BITS = 40
_ONE = float(2**MASS_BITS)


def masses(w: Tensor) -> Tensor:
    """int64 masses of float weights in [0, 1] (any shape): ``floor(w * 2**40)``, NaN and negatives 0."""
    return torch.nan_to_num(w.float(), nan=0.0).clamp(0.0, 1.0).mul_(_ONE).to(torch.int64)


def as_weight(mass: Tensor) -> Tensor:
    """float32 weight of an int64 mass (a sum's: rounded once)."""
    return (mass.double() / _ONE).float()


def row_mass(w: Tensor, keepdim: bool = False) -> Tensor:
    """int64 ``[...]``: the mass of each row of weights ``[..., C]``."""
    return masses(w).sum(-1, keepdim=keepdim)


def row_total(w: Tensor, keepdim: bool = False) -> Tensor:
    """float32 ``[...]``: each row's sum, exact in any order (the weight of its mass)."""
    return as_weight(row_mass(w, keepdim))


def divide_by(w: Tensor, mass: Tensor) -> Tensor:
    """``w / weight(mass)`` per row (``mass`` int64 broadcastable to ``w``), 0 where the mass is 0."""
    z = as_weight(mass)
    return torch.where(mass > 0, w / torch.where(mass > 0, z, 1.0), 0.0)


def normalise(w: Tensor) -> Tensor:
    """Rows ``[..., C]`` divided by their exact sums (a new tensor; rows without mass all 0)."""
    return divide_by(w, row_mass(w, keepdim=True))


def top_p_target(top_p: Tensor, mass: Tensor) -> Tensor:
    """int64: the mass a top-p prefix must reach, ``ceil(top_p * Z)`` (in float64), at most ``Z``."""
    return torch.minimum(torch.ceil(top_p.double() * mass.double()).long(), mass)


def draw_target(u: Tensor, mass: Tensor) -> Tensor:
    """int64: the cumulative mass a draw of ``u`` in [0, 1) passes, ``floor(u * Z)`` (in float64), in
    ``[0, Z - 1]`` (0 when Z is 0)."""
    t = torch.floor(u.double().clamp(0.0, 1.0) * mass.double()).long()
    return torch.minimum(t, mass - 1).clamp_(min=0)


def invert(cum: Tensor, t: Tensor) -> Tensor:
    """int64 ``[R]``: in each row of inclusive prefix sums ``cum`` int64 ``[R, C]``, the first column whose sum
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
    """
    if weights.shape[1] == 0:
        return torch.zeros(weights.shape[0], dtype=torch.int64, device=weights.device)
    cum = masses(weights).cumsum(-1)
    return invert(cum, draw_target(u, cum[:, -1]))
