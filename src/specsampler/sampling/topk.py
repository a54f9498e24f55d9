"""Ordered prefixes: each row's first ``n`` tokens in (score desc, id asc) order, ties included, found
among the chunks of the row with the largest maxima rather than by sorting the vocabulary (top-k, greedy,
small nuclei, the most likely tokens); and the sparse-index helpers the nucleus search shares.

The method: docs/design.md, "Processing without sorting the vocabulary".
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from .scratch import SCRATCH


def _chunk_len(V: int) -> int:
    """A chunk length dividing V (64, else 128, 32 or 256), or 0."""
    return next((L for L in (64, 128, 32, 256) if V % L == 0), 0)


def ordered_prefix(scores: Tensor, n: int, chunk_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The first ``n`` entries of each row in (score desc, id asc) order, exactly (ties included).

    scores: float32 ``[R, V]``. Returns values float32 ``[R, min(n, V)]`` and ids int64.
    When n is small against V, the candidates come from the chunks (of length
    :func:`_chunk_len`) with the largest maxima (``chunk_max`` ``[R, V / L]`` if already
    computed); otherwise a ``torch.topk`` of the row. NaN counts as larger than any number
    (as in ``torch.topk``).
    """
    R, V = scores.shape
    n = min(n, V)
    if n == V:
        return torch.sort(scores, dim=-1, descending=True, stable=True)
    if n == 0:
        return scores[:, :0].clone(), torch.zeros(R, 0, dtype=torch.int64, device=scores.device)
    L = _chunk_len(V)
    if L and 4 * (n + 2) <= V // L and scores.is_contiguous():
        return _ordered_prefix_by_chunks(scores, n, L, chunk_max)
    return _ordered_prefix_of_rows(scores, n)


def _ordered_prefix_of_rows(scores: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """:func:`ordered_prefix` by a top-k of whole rows; rows tied across the cut resolved by id."""
    vals, ids = torch.topk(scores, n + 1, dim=-1)
    tie = vals[:, n - 1] == vals[:, n]
    vals, ids = vals[:, :n], ids[:, :n]
    if bool(tie.any()):
        # a tied row: the entries above its n-th value (NaN included) lead the top-k already; the rest are the
        # lowest ids holding that value
        rows = tie.nonzero()[:, 0]
        head, head_ids = vals[rows], ids[rows]
        cut = head[:, n - 1 : n]
        n_above = (head.isnan() | (head > cut)).sum(-1, keepdim=True)
        at = torch.arange(n, device=scores.device)
        equal = _first_equal(scores, rows, cut, n - n_above[:, 0]).gather(1, (at - n_above).clamp_(min=0))
        sel = torch.where(at < n_above, head_ids, equal)
        ids[rows], vals[rows] = sel, scores[rows[:, None], sel]
    ids, perm = ids.sort(dim=-1)
    vals, perm2 = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, perm2)


def _first_equal(scores: Tensor, rows: Tensor, value: Tensor, need: Tensor) -> Tensor:
    """int64 ``[r, max(need)]``: the ids of the first ``need`` (int64 ``[r]``, at least 1) entries of rows ``rows``
    (int64 ``[r]``) of ``scores`` float32 ``[R, V]`` equal to their ``value`` ``[r, 1]``, in id order (past a row's
    ``need``: not meaningful). Read from the rows' starts, a prefix 8 times longer each time some row has too few
    there: ties at a row's cut (a mask's -inf, a flat row) usually start early, and a whole-row pass costs more
    than a few short ones."""
    r, V = rows.numel(), scores.shape[1]
    width = min(V, 1024)
    while True:
        equal = scores[rows, :width] == value
        found = equal.sum(-1)
        if width == V or bool((found >= need).all()):
            break
        width = min(V, 8 * width)
    k = int(need.max())
    # the j-th equal entry: the first place where the running count reaches j
    return torch.searchsorted(equal.cumsum(-1), torch.arange(1, k + 1, device=scores.device).expand(r, k).contiguous())


def _ordered_prefix_of_entries(b: Tensor, r: int, vals: Tensor, ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """:func:`ordered_prefix` of rows given by their entries (``b`` int64 ``[m]``, the row of
    each, non-decreasing; ``vals`` float32 and ``ids`` int64 ``[m]``, ids increasing within a
    row), every row holding at least ``n`` of them: laid out by row, stably sorted."""
    at, ids = _by_row(b, r, ids)
    laid = torch.full((ids.numel(),), float("-inf"), device=vals.device)  # padding sorts last
    laid = laid.scatter_(0, at, vals).view(ids.shape)
    laid, order = laid.sort(dim=-1, descending=True, stable=True)
    return laid[:, :n], ids.gather(1, order[:, :n])


@functools.cache
def _group_size(S: int, n: int) -> int:
    """Chunks per group in :func:`_ordered_prefix_by_chunks`: the largest divisor of S leaving at
    least 2n groups (1 if none)."""
    return max(d for d in range(1, max(1, S // (2 * n)) + 1) if S % d == 0)


def _ordered_prefix_by_chunks(scores: Tensor, n: int, L: int, chunk_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`ordered_prefix` among the chunks of length L whose maxima reach a bound.

    The chunks form m >= 2n groups (chunk j in group j mod m, m dividing their number); the
    bound is the n-th largest group maximum. The n groups with the largest maxima hold n
    tokens at or above it, so the first n tokens, and any tied with the n-th, are at or above
    it, in the chunks whose maxima reach it: exact, without a top-k over the chunk maxima.
    Rows with NaN, or with fewer than n finite scores, fall back to a whole-row top-k.
    """
    R, V = scores.shape
    chunks = scores.view(R, V // L, L)
    chunk_max = chunks.amax(-1) if chunk_max is None else chunk_max
    search = _prefix_among_chunks_on_cpu if scores.device.type == "cpu" else _prefix_among_chunks
    vals, ids, bad = search(chunks, chunk_max, n)
    n_bad = int(bad.sum())
    if n_bad == R:
        return _ordered_prefix_of_rows(scores, n)
    if n_bad:
        rows = bad.nonzero()[:, 0]
        vals[rows], ids[rows] = _ordered_prefix_of_rows(scores[rows], n)
    return vals, ids


def _prefix_among_chunks(chunks: Tensor, chunk_max: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The search of :func:`_ordered_prefix_by_chunks` in chunks ``[R, S, L]`` with maxima ``[R, S]``:
    values float32 ``[R, n]``, ids int64 and the rows holding fewer than n tokens at or above the bound
    (bool ``[R]``; their values and ids are not meaningful)."""
    R, S, L = chunks.shape
    g = _group_size(S, n)
    top = torch.topk(chunk_max.view(R, g, S // g).amax(1), n, dim=-1, sorted=False).values
    bound = top.amin(-1, keepdim=True)  # NaN in a row with NaN: nothing reaches it, the row falls back
    bound = bound.clamp(min=torch.finfo(torch.float32).min)  # finite: the -inf tokens stay out
    flat, b, col = _positions("ge", chunk_max, bound)
    cand = chunks.reshape(-1, L).index_select(0, flat)  # whole chunks: faster than a gather
    tok, at, off = _positions("ge", cand, bound.index_select(0, b))
    b = b.index_select(0, at)
    bad = torch.bincount(b, minlength=R) < n
    vals, ids = _ordered_prefix_of_entries(b, R, cand.view(-1).index_select(0, tok),
                                           col.index_select(0, at) * L + off, n)
    return vals, ids, bad


def _prefix_among_chunks_on_cpu(chunks: Tensor, chunk_max: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_prefix_among_chunks` on CPU, the same steps in NumPy: on the few candidates its ops cost a
    fraction of ATen's (the search takes a few dozen of them). The comparisons, indexing and stable sort are
    exact, so are the results."""
    R, S, L = chunks.shape
    g = _group_size(S, n)
    m = S // g
    cm = chunk_max.detach().numpy()
    group_max = chunk_max.view(R, g, m).amax(1).numpy()
    bound = np.maximum(np.partition(group_max, m - n, axis=-1)[:, m - n], np.finfo(np.float32).min)[:, None]
    bound[np.isnan(group_max).any(-1)] = np.nan  # a row with NaN: nothing reaches it, the row falls back
    flat = np.flatnonzero(cm >= bound)  # the candidate chunks, by row
    row, col = np.divmod(flat, S)
    cand = chunks.reshape(-1, L).index_select(0, torch.from_numpy(flat))
    # their tokens at or above the bound, by row and id (ATen compares a row to its own bound faster)
    tok = np.flatnonzero(torch.ge(cand, torch.from_numpy(bound[row])).numpy())
    cand = cand.numpy()
    at, off = np.divmod(tok, L)
    b, ids, vals = row[at], col[at] * L + off, cand.reshape(-1)[tok]
    counts = np.bincount(b, minlength=R)
    bad = torch.from_numpy(counts < n)
    if not b.size:
        return torch.from_numpy(vals), torch.from_numpy(ids), bad
    # laid out by row, padded with -inf (every candidate is at least the finite bound), stably sorted: (desc, id asc)
    start = np.cumsum(counts) - counts
    laid = np.full((R, counts.max()), -np.inf, dtype=np.float32)
    laid[b, np.arange(b.size) - start[b]] = vals
    pick = np.minimum(start[:, None] + np.argsort(-laid, axis=-1, kind="stable")[:, :n], b.size - 1)
    return torch.from_numpy(vals[pick]), torch.from_numpy(ids[pick]), bad


def _by_row(b: Tensor, r: int, *values: Tensor) -> tuple[Tensor, ...]:
    """Entries listed by row (``b`` int64 ``[n]``, non-decreasing) laid out as ``[r, C]`` rows
    padded with zeros, C the longest row. Returns each entry's flat index in that layout, then
    each of ``values`` laid out."""
    counts = torch.bincount(b, minlength=r)
    C = int(counts.max()) if b.numel() else 0
    row_start = torch.arange(r, device=b.device) * C - (counts.cumsum(0) - counts)  # layout index - list index
    at = torch.arange(b.numel(), device=b.device) + row_start.index_select(0, b)
    return at, *(torch.zeros(r * C, dtype=v.dtype, device=v.device).scatter_(0, at, v).view(r, C) for v in values)


def _positions(compare: str, x: Tensor, bound: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where ``x compare bound`` holds (``compare``: "ge" or "eq"): flat indices (``row * C +
    column``), rows and columns, int64, in row-major order (as ``nonzero(as_tuple=True)``).
    x: ``[r, C]``; bound: ``[r, 1]``.

    On CPU through NumPy, at about half ATen's cost on masks of millions of entries: its
    comparison into bools is vectorised (ATen's is not), its flat nonzero faster.
    """
    C = x.shape[1]
    if x.device.type != "cpu":
        b, col = getattr(torch, compare)(x, bound).nonzero(as_tuple=True)
        return b * C + col, b, col
    mask = SCRATCH.get("mask", x.shape, torch.bool, x.device).numpy()
    getattr(np, {"ge": "greater_equal", "eq": "equal"}[compare])(x.numpy(), bound.numpy(), out=mask)
    flat = torch.from_numpy(np.flatnonzero(mask))
    b = flat // max(1, C)
    return flat, b, flat - b * C
