"""Row processing: :func:`process` applies temperature, top-k, top-p and min-p to rows of logits or
probabilities, each row by its kind (greedy or top-k, top-p alone, neither), into a :class:`Processed`.

The rules: docs/design.md, "Sampling"; the method: "Processing without sorting the vocabulary". The parts:
:mod:`.filters`, :mod:`.topk`, :mod:`.nucleus`, :mod:`.distributions` (parts, draws), :mod:`.rounding`
(batch-invariant sums), :mod:`.scratch`. This module's path is kept (also as ``specsampler.processing``):
it re-exports their public names.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..params import RowParams
from .distributions import Part, Processed, _take, sample_by_inversion
from .filters import _bounded_part, _plain_part, _rows_where, _take_params, _within
from .nucleus import _nucleus_parts, cut_to_mass
from .rounding import in_vector_body, padded_row_sum, row_sum
from .scratch import SCRATCH
from .topk import ordered_prefix

__all__ = ["SCRATCH", "Part", "Processed", "cut_to_mass", "in_vector_body", "ordered_prefix", "padded_row_sum",
           "process", "row_sum", "sample_by_inversion"]


def process(x: Tensor, rp: RowParams, *, logits: bool, min_candidates: int = 0,
            among: Tensor | None = None) -> Processed:
    """Apply temperature (if ``logits``), top-k, top-p and min-p to each row, renormalised.

    x: float32 ``[R, V]``: masked logits (``-inf`` = masked) or, with ``logits=False``,
        probabilities (temperature is then ignored). Not modified.
    rp: per-row parameters ``[R]``.
    min_candidates: keep at least this many candidates in rows of at most that many
        tokens' support found by top-k (for top-N log-probabilities).
    among: int64 ``[r]``: process only these rows of ``x`` (``rp``: theirs), as if they were ``x``; each kind's rows
        are then read from ``x`` once.
    """
    R, V = x.shape if among is None else (among.numel(), x.shape[1])
    on_host = rp.shared if rp.shared is not None else rp  # every row's parameters as numbers, when shared
    greedy, bounded, nucleus, plain = _kinds(on_host.temperature, on_host.top_k, on_host.top_p, V, logits)
    if isinstance(nucleus, Tensor) and R and bool(nucleus.all()):  # the common case: rows of one kind
        greedy, bounded, nucleus, plain = False, False, True, False
    parts = []
    some, rows = _rows_of(plain, R)
    if some or R == 0:
        parts.append(_plain_part(rows, _take(x, _within(among, rows)), _take_params(rp, rows), logits))
    some, rows = _rows_of(bounded, R)
    if some:
        if not isinstance(greedy, Tensor):
            greedy = torch.full((R,), greedy, dtype=torch.bool, device=x.device)
        parts.append(_bounded_part(rows, _take(x, _within(among, rows)), _take_params(rp, rows), _take(greedy, rows),
                                   logits, min_candidates))
    some, rows = _rows_of(nucleus, R)
    if some:
        parts += _nucleus_parts(rows, _take(x, _within(among, rows)), _take_params(rp, rows), logits)
    return Processed(tuple(parts), R, V)


def _kinds(temperature, top_k, top_p, V: int, logits: bool) -> tuple:
    """How each row is processed: ``(greedy, bounded, nucleus, plain)``. greedy: temperature 0 (from
    logits); bounded: greedy or top-k on (at most k candidates); nucleus: top-p alone (its size found
    per row); plain: temperature and min-p only (dense). On parameter tensors ``[R]`` (bool tensors)
    or on the host numbers that every row shares (bools) alike."""
    greedy = (temperature == 0) & logits
    bounded = greedy | ((top_k > 0) & (top_k < V))
    if not isinstance(bounded, Tensor):  # host numbers: a bool (a SymBool where torch.compile made V symbolic)
        bounded = bool(bounded)
    nucleus = (top_p < 1) & _negated(bounded)
    return greedy, bounded, nucleus, _negated(bounded | nucleus)


def _negated(kind):
    """"Not" of a bool tensor or a bool."""
    return ~kind if isinstance(kind, Tensor) else not kind


def _rows_of(kind, R: int) -> tuple[bool, Tensor | None]:
    """Whether any of the ``R`` rows is of a kind (bool ``[R]``, or one bool for every row), and
    which (None: all of them)."""
    if isinstance(kind, bool):
        return kind and R > 0, None
    return (True, _rows_where(kind)) if bool(kind.any()) else (False, None)
