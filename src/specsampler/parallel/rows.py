"""Processed rows on vocabulary shards: :class:`Rows`, what :func:`.process.process` gives the steps after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..sampling.distributions import Part
from .argmax import decode
from .rounds import Layout


@dataclass
class Rows:
    """Processed distributions of ``R`` rows on the shards.

    probs: float32 ``[R, shard.size]``, this rank's columns. lo, hi: float64 ``[world, R]``, bounds on each rank's
    exact mass of its columns (equal where known exactly). read: float32 ``[n]``, the probabilities at the ids asked
    for, on every rank. part, part_rows: the greedy and top-k rows (int64 ``[r]``) as the one-device op holds them
    (candidates, global ids), replicated on every rank. layout: the shards. count: int64 ``[world, R]``, at least
    each rank's number of nonzero probabilities in each row (what a round of every rank's nonzero entries sends).
    """

    probs: Tensor
    lo: Tensor
    hi: Tensor
    read: Tensor
    part: Part | None
    part_rows: Tensor
    layout: Layout
    count: Tensor


def global_top(got_keys: Tensor, got_nan: Tensor) -> tuple[Tensor, Tensor]:
    """From every rank's :func:`argmax_keys` and NaN flags (``[world, r]``): the greedy choice int64 ``[r]`` and the
    maximum a sampled row's weights are taken from, float32 ``[r]`` (-inf where the row holds a NaN: it has no
    mass, as on one device)."""
    best, top = decode(got_keys.amax(0))
    return best, torch.where(got_nan.any(0), float("-inf"), top)
