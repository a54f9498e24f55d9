"""Processed distributions: temperature, top-k, top-p and min-p, held compactly, and categorical draws.

Rules (DESIGN.md): vocab mask, temperature, top-k, top-p on the top-k-renormalised
distribution, min-p, renormalise; temperature 0 is greedy (one-hot at the argmax). "Order"
is logit (or probability) desc, id asc: top-k keeps exactly k tokens, ties to the lower id;
top-p keeps the smallest prefix of that order whose mass reaches p.

A processed distribution is held in :class:`Part` s: rows whose kept set is bounded keep
only their candidate tokens (in id order), the others are dense. Nothing sorts the
vocabulary:

- top-k: the k largest logits, found among the chunks of the row with the largest maxima
  (a pass computing chunk maxima; a bound, the k-th largest maximum of about 2k groups of
  chunks; the few tokens at or above it in the chunks reaching it, sorted);
- top-p alone: a token that alone reaches p is the nucleus. Rows of up to 65536 tokens are
  otherwise counted whole: the first digit of a radix select on the float bit patterns (a
  histogram of mass at 64 bins per octave) finds the bin where the nucleus ends, and the
  rows are compacted down to it, or cut densely when that leaves many tokens. In longer
  rows the chunks with the largest maxima (counted exactly) and a subsample of the other
  chunks estimate the nucleus size and a weight ``lb`` it lies above with a wide margin. A
  small nucleus is then found among the 64 most likely tokens as for top-k; a larger one
  is compacted above ``lb`` (the candidates' mass proves the nucleus is among them, else
  the row is cut densely) and cut exactly by the radix select.

Categorical draws use one uniform per row: the token is the first id, in id order, whose
cumulative probability exceeds ``u * total`` (see :mod:`specsampler.rng`).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..params import RowParams
from .greedy import nan_as_minus_inf

SMALL_NUCLEUS = 64  # nuclei first searched among the 64 most likely tokens
_ORDER_WHOLE = 1024  # top-p rows this short are ordered whole: cheaper than estimating a nucleus bound
_BLOCK = 512  # rows per block in the search for large nuclei
_RADIX_SHIFT = 17  # the radix select's first digit: 64 bins per octave of weight,
_RADIX_KEYS = 1 << 11  # 2048 of them; then 11 bits at a time
_RADIX_SORT = 256  # pending tokens per row (on average) few enough to sort
_SUBSAMPLE = 4096  # tokens per row a large nucleus's threshold is estimated from,
_COUNT_WHOLE = 1 << 16  # in rows longer than this; shorter ones are counted whole
_EST_SHIFT = 20  # the estimate's bins: 8 per octave of weight,
_EST_BINS = 256  # over the 32 octaves below the most likely token
_TINY = torch.finfo(torch.float32).tiny
_LOG2E = math.log2(math.e)
_FAR = 2.0**24  # |top * c| from which the multiply-add's offset loses units (see _weights)
_INVERSION_CHUNK = 256  # columns per chunk in the two-step inversion of wide rows
_SUM_BLOCK = 256  # values per block of the sums of padded rows (padded_row_sum)
_VECTOR_BODY = 64  # lengths that are whole iterations of ATen's vectorised CPU loops (in_vector_body)


class _Scratch(threading.local):
    """Large temporaries reused across calls, one set per thread (fresh allocations of this
    size cost more in page faults than the passes that fill them). Never part of a result."""

    def __init__(self):
        self.buffers: dict = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


SCRATCH = _Scratch()


@dataclass(frozen=True)
class Part:
    """Some rows of a :class:`Processed`, held one way.

    rows: int64 ``[r]``, which of the ``R`` rows these are, or ``None`` for all of them.
    ids: int64 ``[r, C]``: each row's candidate tokens in increasing id order, padded with
        id 0 at probability 0; or ``None`` when the rows are dense.
    probs: float32 ``[r, C]`` aligned with ``ids``, or ``[r, V]``: normalised, 0 outside the
        kept set (a row whose kept set has no mass, e.g. all masked, is all 0).
    """

    rows: Tensor | None
    ids: Tensor | None
    probs: Tensor

    def dense(self, vocab_size: int) -> Tensor:
        if self.ids is None:
            return self.probs
        out = torch.zeros(self.probs.shape[0], vocab_size, dtype=torch.float32, device=self.probs.device)
        return out.scatter_add_(1, self.ids, self.probs)

    def sample(self, u: Tensor) -> Tensor:
        if self.ids is not None and self.ids.shape[1] == 1:  # one candidate: it is the draw
            return self.ids[:, 0]
        idx = sample_by_inversion(self.probs, u)
        return idx if self.ids is None else self.ids.gather(1, idx[:, None])[:, 0]

    def prob(self, tokens: Tensor) -> Tensor:
        if self.ids is None:
            return self.probs.gather(1, tokens[:, None])[:, 0]
        return torch.where(self.ids == tokens[:, None], self.probs, 0.0).sum(-1)

    def top(self, n: int) -> tuple[Tensor, Tensor]:
        probs, pos = ordered_prefix(self.probs, n)
        ids = pos if self.ids is None else self.ids.gather(1, pos)
        if probs.shape[1] < n:  # fewer candidates than asked: pad
            pad = n - probs.shape[1]
            probs = torch.nn.functional.pad(probs, (0, pad))
            ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
        return torch.where(probs > 0, ids, -1), in_vector_body(torch.log, probs)


@dataclass(frozen=True)
class Processed:
    """The processed distributions of ``R`` rows over a vocabulary of ``V`` tokens, in parts."""

    parts: tuple[Part, ...]
    num_rows: int
    vocab_size: int

    def _per_row(self, fn, *row_args: Tensor) -> tuple[Tensor, ...]:
        """Run ``fn(part, *args of its rows)`` on every part and assemble its outputs ``[R, ...]``."""
        if len(self.parts) == 1 and self.parts[0].rows is None:
            out = fn(self.parts[0], *row_args)
            return out if isinstance(out, tuple) else (out,)
        outs = None
        for part in self.parts:
            res = fn(part, *(a[part.rows] for a in row_args))
            res = res if isinstance(res, tuple) else (res,)
            if outs is None:
                outs = tuple(r.new_empty((self.num_rows, *r.shape[1:])) for r in res)
            for o, r in zip(outs, res):
                o[part.rows] = r
        return outs

    @staticmethod
    def from_dense(probs: Tensor) -> Processed:
        """Distributions given as they are: float32 ``[R, V]`` (not copied)."""
        return Processed((Part(None, None, probs),), probs.shape[0], probs.shape[1])

    def select(self, rows: Tensor) -> Processed:
        """The distributions of ``rows`` (int64 ``[n]``, any order, repeats allowed), copied."""
        parts = []
        if len(self.parts) == 1 and self.parts[0].rows is None:
            part = self.parts[0]
            parts.append(Part(None, _take(part.ids, rows) if part.ids is not None else None, _take(part.probs, rows)))
        else:
            part_of = torch.empty(self.num_rows, dtype=torch.int64, device=rows.device)
            local = torch.empty_like(part_of)
            for k, part in enumerate(self.parts):
                part_of[part.rows] = k
                local[part.rows] = torch.arange(part.rows.numel(), device=rows.device)
            for k, part in enumerate(self.parts):
                sel = (part_of[rows] == k).nonzero()[:, 0]
                if sel.numel():
                    loc = local[rows[sel]]
                    ids = _take(part.ids, loc) if part.ids is not None else None
                    parts.append(Part(sel, ids, _take(part.probs, loc)))
            if not parts:  # no rows selected
                parts.append(Part(None, None, self.parts[0].probs.new_zeros(0, self.vocab_size)))
        return Processed(tuple(parts), rows.numel(), self.vocab_size)

    def dense(self) -> Tensor:
        """float32 ``[R, V]``."""
        return self._per_row(lambda part: part.dense(self.vocab_size))[0]

    def sample(self, u: Tensor) -> Tensor:
        """One token per row by inversion of ``u`` float32 ``[R]``; int64 ``[R]``, always in ``[0, V)``."""
        return self._per_row(Part.sample, u)[0]

    def prob(self, tokens: Tensor) -> Tensor:
        """Probability of ``tokens`` int64 ``[R]`` (in ``[0, V)``); float32 ``[R]``."""
        return self._per_row(Part.prob, tokens)[0]

    def top(self, n: int) -> tuple[Tensor, Tensor]:
        """The ``n`` most likely tokens per row: ids int64 ``[R, n]`` (-1 past the support), logprobs."""
        return self._per_row(lambda part: part.top(n))


def sample_by_inversion(weights: Tensor, u: Tensor) -> Tensor:
    """Index of the first column whose cumulative weight exceeds ``u * total``, per row.

    weights: float32 ``[R, C]`` (need not be normalised); u: float32 ``[R]`` in [0, 1).
    Returns int64 ``[R]`` in ``[0, C)``; never an index of zero weight when the row has mass.
    Wide rows are inverted in two steps: over the sums of chunks of 256 columns, then within
    the chunk found (the same draw but for float rounding at a chunk boundary).
    """
    R, C = weights.shape
    if C < 4 * _INVERSION_CHUNK or C % _INVERSION_CHUNK or not weights.is_contiguous():
        return _invert(weights.cumsum(-1), u[:, None] * padded_row_sum(weights, keepdim=True).clamp(min=0))[:, 0]
    chunks = weights.view(R, C // _INVERSION_CHUNK, _INVERSION_CHUNK)
    csum = chunks.sum(-1).cumsum(-1)
    t = u[:, None] * csum[:, -1:]
    c = _invert(csum, t)
    before = torch.where(c > 0, csum.gather(1, (c - 1).clamp(min=0)), 0.0)
    inner = chunks[torch.arange(R, device=weights.device), c[:, 0]]
    return (c * _INVERSION_CHUNK + _invert(inner.cumsum(-1), t - before))[:, 0]


def _invert(cum: Tensor, t: Tensor) -> Tensor:
    """``[R, 1]``: the first column of the row-wise cumulative sums ``cum`` ``[R, C]`` exceeding
    ``t`` ``[R, 1]``, but not past the last column that adds mass."""
    total = cum[:, -1:].contiguous()
    idx = torch.searchsorted(cum, t.contiguous(), right=True)
    last = torch.searchsorted(cum, total, right=False)
    return torch.minimum(idx, last).clamp_(0, cum.shape[1] - 1)


# ----------------------------------------------------------------------------- ordered prefixes


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
        rows = tie.nonzero()[:, 0]
        s = scores[rows]
        cut = vals[rows, n - 1 : n]
        above = (s > cut) | s.isnan()
        at = s == cut
        keep = above | (at & (at.cumsum(-1) <= n - above.sum(-1, keepdim=True)))
        sel = keep.nonzero()[:, 1].view(-1, n)
        ids, vals = ids.clone(), vals.clone()
        ids[rows], vals[rows] = sel, s.gather(1, sel)
    ids, perm = ids.sort(dim=-1)
    vals, perm2 = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, perm2)


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
    S = chunk_max.shape[1]
    g = _group_size(S, n)
    top = torch.topk(chunk_max.view(R, g, S // g).amax(1), n, dim=-1, sorted=False).values
    bound = top.amin(-1, keepdim=True)  # NaN in a row with NaN: nothing reaches it, the row falls back
    bound = bound.clamp(min=torch.finfo(torch.float32).min)  # finite: the -inf tokens stay out
    flat, b, col = _positions("ge", chunk_max, bound)
    cand = chunks.reshape(-1, L).index_select(0, flat)  # whole chunks: faster than a gather
    tok, at, off = _positions("ge", cand, bound.index_select(0, b))
    b = b.index_select(0, at)
    bad = torch.bincount(b, minlength=R) < n
    n_bad = int(bad.sum())
    if n_bad == R:
        return _ordered_prefix_of_rows(scores, n)
    vals, ids = _ordered_prefix_of_entries(b, R, cand.view(-1).index_select(0, tok),
                                           col.index_select(0, at) * L + off, n)
    if n_bad:
        rows = bad.nonzero()[:, 0]
        vals[rows], ids[rows] = _ordered_prefix_of_rows(scores[rows], n)
    return vals, ids


# ----------------------------------------------------------------------------- processing


def process(x: Tensor, rp: RowParams, *, logits: bool, min_candidates: int = 0) -> Processed:
    """Apply temperature (if ``logits``), top-k, top-p and min-p to each row, renormalised.

    x: float32 ``[R, V]``: masked logits (``-inf`` = masked) or, with ``logits=False``,
        probabilities (temperature is then ignored). Not modified.
    rp: per-row parameters ``[R]``.
    min_candidates: keep at least this many candidates in rows of at most that many
        tokens' support found by top-k (for top-N log-probabilities).
    """
    R, V = x.shape
    on_host = rp.shared if rp.shared is not None else rp  # every row's parameters as numbers, when shared
    greedy, bounded, nucleus, plain = _kinds(on_host.temperature, on_host.top_k, on_host.top_p, V, logits)
    if isinstance(nucleus, Tensor) and R and bool(nucleus.all()):  # the common case: rows of one kind
        greedy, bounded, nucleus, plain = False, False, True, False
    parts = []
    some, rows = _rows_of(plain, R)
    if some or R == 0:
        parts.append(_plain_part(rows, _take(x, rows), _take_params(rp, rows), logits))
    some, rows = _rows_of(bounded, R)
    if some:
        if not isinstance(greedy, Tensor):
            greedy = torch.full((R,), greedy, dtype=torch.bool, device=x.device)
        parts.append(_bounded_part(rows, _take(x, rows), _take_params(rp, rows), _take(greedy, rows), logits,
                                   min_candidates))
    some, rows = _rows_of(nucleus, R)
    if some:
        parts += _nucleus_parts(rows, _take(x, rows), _take_params(rp, rows), logits)
    return Processed(tuple(parts), R, V)


def _kinds(temperature, top_k, top_p, V: int, logits: bool) -> tuple:
    """How each row is processed: ``(greedy, bounded, nucleus, plain)``. greedy: temperature 0 (from
    logits); bounded: greedy or top-k on (at most k candidates); nucleus: top-p alone (its size found
    per row); plain: temperature and min-p only (dense). On parameter tensors ``[R]`` (bool tensors)
    or on the host numbers that every row shares (bools) alike."""
    greedy = (temperature == 0) & logits
    bounded = greedy | ((top_k > 0) & (top_k < V))
    nucleus = (top_p < 1) & (bounded ^ True)  # ^ True: "not", for tensors and bools alike
    return greedy, bounded, nucleus, (bounded | nucleus) ^ True


def _rows_of(kind, R: int) -> tuple[bool, Tensor | None]:
    """Whether any of the ``R`` rows is of a kind (bool ``[R]``, or one bool for every row), and
    which (None: all of them)."""
    if isinstance(kind, bool):
        return kind and R > 0, None
    return (True, _rows_where(kind)) if bool(kind.any()) else (False, None)


def _rows_where(mask: Tensor) -> Tensor | None:
    return None if bool(mask.all()) else mask.nonzero()[:, 0]


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    """Rows of ``t`` (dim 0) at int64 ``rows`` (whole rows copied: ``index_select``), or ``t`` for None."""
    return t if rows is None else t.index_select(0, rows)


def _take_params(rp: RowParams, rows: Tensor | None) -> RowParams:
    return rp if rows is None else rp.take(rows)


def _within(outer: Tensor | None, inner: Tensor | None) -> Tensor | None:
    """Rows ``inner`` of the subset ``outer``, as indices into the full batch."""
    if inner is None:
        return outer
    return inner if outer is None else outer[inner]


def _weights(vals: Tensor, top: Tensor, temperature: Tensor, logits: bool, *, shared: bool = False,
             scratch: str | None = None) -> Tensor:
    """Unnormalised probabilities: ``exp((x - top) / T)`` for logits, else x (negative or NaN
    probabilities count as 0); a new tensor, or in the named scratch buffer.

    From logits, computed as ``2 ** (x * c - top * c)`` with ``c = log2(e) / T`` (float32):
    one multiply-add and a base-2 exponential, which costs half of ``exp`` on CPU. The
    exponential runs over whole iterations of ATen's vectorised loop (the values rounded up
    to a multiple of 64, see :func:`in_vector_body`), so that a row's values round the same
    whatever rows come before it.
    top: float32 ``[r, 1]``, the row maximum; a row whose maximum is not finite has no mass.
    temperature: float32 ``[r]``; ``shared``: every row's is the same (a scalar multiply-add,
    faster, with the same arithmetic).
    """
    n = vals.numel()
    whole = -(-n // _VECTOR_BODY) * _VECTOR_BODY
    buf = torch.empty(whole, device=vals.device) if scratch is None else SCRATCH.get(scratch, (whole,), torch.float32,
                                                                                     vals.device)
    w = buf[:n].view(vals.shape)
    if not logits:
        return torch.nan_to_num(vals, nan=0.0, posinf=0.0, out=w).clamp_(min=0.0)
    finite = torch.isfinite(top)
    top = torch.where(finite, top, 0.0)
    c = torch.full_like(temperature, _LOG2E).div_(temperature)[:, None]
    if shared and c.numel():
        torch.add(-top * c, vals, alpha=float(c[0]), out=w)
    else:
        torch.addcmul(-top * c, vals, c, out=w)
    buf.exp2_()  # with the few values past n: whatever they are, they are not read
    # from |top * c| >= 2**24 the multiply-add's offset rounds by more than a unit (1e10 gave a row of zeros,
    # 1e15 NaN): such rows subtract first, exactly as the kernels do
    far = (top * c).abs()[:, 0] >= _FAR
    if bool(far.any()):
        w[far] = torch.exp2((vals[far] - top[far]) * c[far])
    if not bool(finite.all()):
        w.masked_fill_(~finite, 0.0)
    return w


def row_sum(t: Tensor, keepdim: bool = False) -> Tensor:
    """Sums over the last dim of ``t`` ``[..., C]`` for rows of a length of their own (a
    vocabulary, not a batch's widest row: see :func:`padded_row_sum`), each as in any batch.

    A request's results must not depend on its neighbours (DESIGN.md), but ATen splits the
    sum of a lone long row across threads, which rounds otherwise than a row among others
    (summed by one thread): a lone row is summed as one of two.
    """
    if t.device.type == "cpu" and t.dim() and math.prod(t.shape[:-1]) == 1:
        s = t.reshape(1, -1).expand(2, -1).sum(-1)[:1]
        return s.view(*t.shape[:-1], 1) if keepdim else s.view(t.shape[:-1])
    return t.sum(-1, keepdim=keepdim)


def padded_row_sum(t: Tensor, keepdim: bool = False) -> Tensor:
    """Sums over the last dim of ``t`` ``[..., C]`` that zeros at the end of a row do not change
    (rows padded to the widest of a batch, whose width depends on the others).

    ATen's sum of a row associates its values by the row's length. Here: sums of 256
    consecutive values (the last block padded with zeros), then of 256 of those, and so on,
    each an ATen sum of fixed length (never split across threads); zeros add nothing.
    """
    W = _SUM_BLOCK
    while (C := t.shape[-1]) > W:
        full = C - C % W
        sums = t[..., :full].unflatten(-1, (full // W, W)).sum(-1)
        if full < C:
            tail = torch.nn.functional.pad(t[..., full:], (0, W - C + full))
            sums = torch.cat([sums, tail.sum(-1, keepdim=True)], -1)
        t = sums
    return torch.nn.functional.pad(t, (0, W - C)).sum(-1, keepdim=keepdim)  # a new tensor, even of one column


def in_vector_body(fn, t: Tensor) -> Tensor:
    """``fn(t)`` for an elementwise ``fn`` with exponentials or logarithms, on CPU computed over
    ``t`` padded (last dim) to a multiple of 64 values, contiguous, then cut back.

    ATen's CPU loops round these (and fused multiply-adds) one way in their vectorised body
    and another in the scalar tail of a loop, and where a value falls depends on the batch
    when its place in the tensor does: a row's candidates padded to the widest row's, a
    request's log-probability among the others'. Padded, every value is in the body. (A loop
    over 32768 values or more is split across threads; with two, the split falls on the
    vector grid too; with more it may not, and a few values at a split can round otherwise.)
    """
    if t.device.type != "cpu":
        return fn(t)
    C = t.shape[-1]
    return fn(torch.nn.functional.pad(t, (0, -C % _VECTOR_BODY)))[..., :C]


def _normalise_(w: Tensor) -> Tensor:
    """Divide each row by its sum, in place (rows without mass stay 0)."""
    return w.div_(padded_row_sum(w, keepdim=True).clamp_(min=_TINY))


def _cut_candidates(w: Tensor, rp: RowParams, z: Tensor | None = None) -> Tensor:
    """top-p (against the mass ``z``, default the candidates' own) and min-p on ordered candidates.

    w: float32 ``[r, C]`` in (logit desc, id asc) order. Returns the kept weights.
    """
    cum = w.cumsum(-1)
    z = cum[:, -1] if z is None else z
    before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # mass strictly before each candidate
    keep = (rp.top_p >= 1)[:, None] | (before < rp.top_p[:, None] * z[:, None])
    keep &= w >= rp.min_p[:, None] * w[:, :1]
    return torch.where(keep, w, 0.0)


def _candidate_weights(vals: Tensor, temperature: Tensor, logits: bool) -> Tensor:
    """:func:`_weights` of candidates ``[r, C]`` in (logit desc, id asc) order (the first the
    row's top), C padded to whole vector iterations: C is the widest row's of the batch."""
    return in_vector_body(lambda v: _weights(v, v[:, :1], temperature, logits), vals)


def _part_in_id_order(rows: Tensor | None, ids: Tensor, weights: Tensor) -> Part:
    """The candidates ``ids`` with their kept ``weights`` (in (logit desc, id asc) order: the kept
    ones first), normalised in that order, where a row's sum does not see how many candidates
    the widest row of the batch took, then put in id order."""
    ids, perm = ids.sort(dim=-1)
    return Part(rows, ids, _normalise_(weights).gather(1, perm))


def _bounded_part(rows, x, rp, greedy, logits, min_candidates) -> Part:
    """Greedy and top-k rows: their k (1 for greedy) most likely tokens."""
    keep_n = torch.where(greedy, 1, rp.top_k)
    if logits and bool(greedy.any()):  # the greedy choice never takes a NaN (greedy.greedy_ids)
        x = torch.where(greedy[:, None], nan_as_minus_inf(x), x)
    vals, ids = ordered_prefix(x, max(min_candidates, int(keep_n.max())))
    w = _candidate_weights(vals, torch.where(greedy, 1.0, rp.temperature), logits)
    w = torch.where(torch.arange(w.shape[1], device=x.device) < keep_n[:, None], w, 0.0)
    return _part_in_id_order(rows, ids, _cut_candidates(w, rp))


def _nucleus_parts(rows, x, rp, logits) -> list[Part]:
    """Top-p rows without top-k: sparse, their nucleus found without sorting the vocabulary.

    Rows are taken in blocks of :data:`_BLOCK`, which bounds the per-row histograms' memory.
    """
    r, V = x.shape
    if V <= _ORDER_WHOLE:  # the whole row is the candidate set
        vals, ids = ordered_prefix(x, V)
        w = _candidate_weights(vals, rp.temperature, logits)
        return [_part_in_id_order(rows, ids, _cut_candidates(w, rp))]
    if r <= _BLOCK:
        return _nucleus_block(rows, x, rp, logits)
    parts = []
    for start in range(0, r, _BLOCK):
        block = torch.arange(start, min(r, start + _BLOCK), device=x.device)
        parts += _nucleus_block(_within(rows, block), x[block], rp.take(block), logits)
    return parts


def _nucleus_block(rows, x, rp, logits) -> list[Part]:
    """Top-p rows without top-k, at most :data:`_BLOCK` of them. In turn: a token that alone
    reaches top-p is the nucleus; rows of up to :data:`_COUNT_WHOLE` tokens are then counted
    whole (:func:`_counted_nuclei`); in longer ones, a nucleus the subsample estimates small
    is looked for among the 64 most likely tokens, the others are compacted above an
    estimated bound (or cut densely when too large)."""
    r, V = x.shape
    L = _chunk_len(V)
    chunk_max = x.view(r, V // L, L).amax(-1) if L and x.is_contiguous() else None
    top, best = _max(x, chunk_max)
    # unnormalised weights (the most likely token's about 1), in a scratch buffer; z: each row's mass
    w = _weights(x, top[:, None], rp.temperature, logits, shared=rp.shared is not None, scratch="weights")
    z = row_sum(w)
    target = rp.top_p * z
    parts = []
    w_max = w.gather(1, best[:, None])
    done = w_max[:, 0] >= target  # a token that alone reaches top-p is the nucleus
    n_done = int(done.sum())
    if n_done:
        sub = None if n_done == r else done.nonzero()[:, 0]
        mass = _take(z, sub).sign()[:, None]  # 1, or 0 for a row without mass (no finite logit)
        parts.append(Part(_within(rows, sub), _take(best, sub)[:, None], mass))
        if sub is None:
            return parts
    if V <= _COUNT_WHOLE:  # short rows: counting them whole costs less than estimating
        sub = _rows_where(~done)
        parts += _counted_nuclei(_within(rows, sub), _take(w, sub), _take(target, sub), _take_params(rp, sub),
                                 _take(w_max, sub))
        return parts
    lb, likely, size = _nucleus_bound(w, w_max, target, z, chunk_max)
    small = (size <= SMALL_NUCLEUS // 2) & ~done
    if bool(small.any()):  # a small nucleus: among the most likely tokens, found as for top-k
        sub = _rows_where(small)
        vals, head = ordered_prefix(_take(x, sub), SMALL_NUCLEUS, _take(chunk_max, sub) if chunk_max is not None
                                    else None)
        head_w = _take(w, sub).gather(1, head)
        found = head_w.sum(-1) >= _take(target, sub)
        if bool(found.any()):
            got = _rows_where(found)
            kept = _cut_candidates(_take(head_w, got), _take_params(_take_params(rp, sub), got),
                                   _take(_take(z, sub), got))
            parts.append(_part_in_id_order(_within(rows, _within(sub, got)), _take(head, got), kept))
            done = done.clone()
            done[(torch.arange(r, device=x.device) if sub is None else sub)[found]] = True
    if not bool(done.all()):
        parts += _large_nuclei(rows, w, torch.where(done, float("inf"), lb), likely, target, rp, w_max)
    return parts


def _max(x: Tensor, chunk_max: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each row's largest value and its lowest id, from the chunk maxima when given."""
    if chunk_max is None:
        return x.amax(-1), x.argmax(-1)
    r, n = chunk_max.shape
    top, c = chunk_max.max(-1)  # the first chunk holding the maximum
    return top, c * (x.shape[1] // n) + x.view(r, n, -1)[torch.arange(r, device=x.device), c].argmax(-1)


def _plain_part(rows, x, rp, logits) -> Part:
    """Rows with neither top-k nor top-p: dense, with min-p."""
    w = _weights(x, x.amax(-1, keepdim=True), rp.temperature, logits, shared=rp.shared is not None)
    if not rp.all_equal("min_p", 0):
        w.mul_(w >= rp.min_p[:, None] * w.amax(-1, keepdim=True))
    return Part(rows, None, _normalise_(w))


# ----------------------------------------------------------------------------- large nuclei


def _keys(w: Tensor, shift: int, scratch: str | None = None) -> Tensor:
    """Bins of non-negative float32 weights by their bit patterns (monotone in the weight),
    int32; in the named scratch buffer when given."""
    bits = w.contiguous().view(torch.int32)
    if scratch is None:
        return bits >> shift
    return torch.bitwise_right_shift(bits, shift, out=SCRATCH.get(scratch, bits.shape, torch.int32, w.device))


def _histogram(keys: Tensor, values: Tensor, num_keys: int) -> Tensor:
    """Per-row sums of ``values`` by key: ``[r, n]`` int32 keys -> float32 ``[r, num_keys]``."""
    return torch.zeros(keys.shape[0], num_keys, device=keys.device).scatter_add_(1, keys.long(), values)


def _nucleus_bound(w: Tensor, w_max: Tensor, target: Tensor, z: Tensor,
                   chunk_max: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Estimates for each row: a weight ``lb`` the nucleus very likely lies above, whether the
    tokens above it very likely reach the target, and the nucleus size.

    The mass above each bin edge (8 bins per octave of weight, over the 32 octaves below the
    most likely token; the tokens further below share the last bin) is counted exactly over
    the chunks with the largest maxima (which hold the most likely tokens), and estimated over
    the rest from a strided subsample scaled to their exact mass (a ratio estimator); where
    it reaches the target is the estimated nucleus edge, with n tokens above. The bound is
    the lowest bin edge with an estimated 2n + 128 tokens or fewer above it (at most V/16),
    so that compaction stays cheap while keeping a wide margin for the estimate's error.

    w: float32 ``[r, V]``; w_max: ``[r, 1]``, its row maxima; target, z: ``[r]``, the mass to
    reach and the row's mass; chunk_max: ``[r, V / L]``, the chunk maxima of the logits, or None.
    Returns lb float32 ``[r]``, likely bool ``[r]``, n float32 ``[r]``.
    """
    r, V = w.shape
    head = torch.zeros(r, 0, device=w.device)
    if chunk_max is not None and chunk_max.shape[1] > 4 * (SMALL_NUCLEUS + 1):
        # whole chunks: the head's and every stride-th one (contiguous reads), the head counted once
        n = chunk_max.shape[1]
        chunks = w.view(r, n, -1)
        picked = torch.topk(chunk_max, SMALL_NUCLEUS + 1, dim=-1).indices
        picked_rows = (picked + torch.arange(r, device=w.device)[:, None] * n).view(-1)
        head = chunks.reshape(r * n, -1).index_select(0, picked_rows).view(r, -1)
        stride = max(1, n * chunks.shape[2] // _SUBSAMPLE)
        outside = torch.ones(r, n, device=w.device).scatter_(1, picked, 0.0)[:, ::stride, None]
        sub = (chunks[:, ::stride] * outside).reshape(r, -1)
    else:
        sub = w[:, :: max(1, V // _SUBSAMPLE)].contiguous()
    # mass and count in each bin below the most likely token's (the tokens far below it share
    # the last one), of the subsample scaled to what it stands for, and of the head
    top = _keys(w_max, _EST_SHIFT)
    hist = torch.zeros(r, 2, _EST_BINS, device=w.device)
    sub_scale = (z - head.sum(-1)).clamp(min=0) / sub.sum(-1).clamp(min=_TINY)
    for part, mass_scale, count_scale in ((sub, sub_scale[:, None], (V - head.shape[1]) / sub.shape[1]),
                                          (head, 1.0, 1.0)):
        below = (top - _keys(part, _EST_SHIFT)).clamp_(0, _EST_BINS - 1).long()
        hist[:, 0].scatter_add_(1, below, part * mass_scale)
        hist[:, 1].scatter_add_(1, below, torch.full_like(part, count_scale))
    mass, count = hist.cumsum(-1).unbind(1)  # above each bin's lower edge
    edge = (mass < target[:, None]).sum(-1).clamp(max=_EST_BINS - 1)  # the estimated nucleus edge
    size = count.gather(1, edge[:, None])[:, 0]
    room = (2 * size + 128).clamp(max=V // 16)  # candidates to allow
    j = ((count <= room[:, None]).sum(-1) - 1).clamp(min=0)  # the lowest bin with at most that many above
    k = torch.where(j < _EST_BINS - 1, top[:, 0] - j.to(torch.int32), 0)
    lb = torch.where(k > 0, (k << _EST_SHIFT).view(torch.float32), 0.0)
    return lb, mass.gather(1, j[:, None])[:, 0] >= target, size


def _counted_nuclei(rows, w: Tensor, target: Tensor, rp: RowParams, w_max: Tensor) -> list[Part]:
    """Top-p rows whose nucleus holds more than one token, counted whole: the radix cut's first
    digit (a histogram of each row's mass by bin, :func:`_first_digit`) finds the bin where
    the nucleus ends. A bin's tokens weigh within 1.1% of each other, so its mass over its
    lowest weight bounds its token count: rows with few tokens down to the crossing bin (up
    to a sixteenth of the row) are compacted (candidates in id order), the others cut densely.

    w: float32 ``[r, V]`` weights (only read: may be a scratch tensor); target: ``[r]``;
    w_max: ``[r, 1]``, the weight of the most likely token, for min-p.
    """
    r, V = w.shape
    digit, crossing, above, hist, base = _first_digit(w, target)
    bins = torch.arange(_RADIX_KEYS, dtype=torch.int32, device=w.device)
    lowest = ((base + bins) << _RADIX_SHIFT).clamp_(min=0).view(torch.float32)  # each bin's lowest weight
    count = torch.where(hist > 0, hist / lowest, 0.0)  # at least each bin's tokens
    n = count.flip(-1).cumsum(-1).gather(1, (_RADIX_KEYS - 1 - crossing.clamp(min=0)).long())[:, 0]  # bins >= it
    few = (crossing[:, 0] >= 1) & (n <= V // 16)  # bin 0 has no lowest weight: rows crossing in it are cut densely
    parts = []
    if bool(few.any()):
        sub = _rows_where(few)
        # the tokens of those rows down to the crossing bin, in id order (other rows: none)
        c = torch.where(few[:, None], crossing, _RADIX_KEYS)
        flat, b, col = _positions("ge", digit, c)
        local = b if sub is None else (few.cumsum(0) - 1).index_select(0, b)
        at, ids, cand = _by_row(local, r if sub is None else sub.numel(), col, w.view(-1).index_select(0, flat))
        pending = digit.view(-1).index_select(0, flat) == crossing[:, 0].index_select(0, b)
        pb = local[pending]
        _settle(cand, pb, at[pending] - pb * cand.shape[1], *(_take(t, sub) for t in (crossing, above, target)))
        parts.append(Part(_within(rows, sub), ids, _min_p_normalise_(cand, _take_params(rp, sub), w_max, sub)))
    if not bool(few.all()):
        sub = _rows_where(~few)
        rows_w = _take(w, sub)  # the scratch weights are only read; a selection is a copy
        kept = _cut_from(rows_w, _take(digit, sub), _take(crossing, sub), _take(above, sub), _take(target, sub),
                         out=None if sub is None else rows_w)
        parts.append(Part(_within(rows, sub), None, _min_p_normalise_(kept, _take_params(rp, sub), w_max, sub)))
    return parts


def _large_nuclei(rows, w: Tensor, lb: Tensor, likely: Tensor, target: Tensor, rp: RowParams, w_max) -> list[Part]:
    """The rows with a finite ``lb``, whose nucleus holds more than the head.

    Their tokens above ``lb`` are compacted (candidates in id order) when their mass proves
    the nucleus is among them; rows whose tokens above ``lb`` are not ``likely`` to reach the
    target, or do not, are cut densely instead.

    w: float32 ``[r, V]`` weights (a scratch tensor: read only); lb, target: ``[r]``; likely:
    bool ``[r]``; w_max: ``[r, 1]``, the weight of the most likely token, for min-p.
    """
    r, V = w.shape
    compact = likely & (lb != float("inf"))
    parts = []
    if bool(compact.any()):
        flat, b, cols = _positions("ge", w, torch.where(compact, lb, float("inf"))[:, None])
        _, ids, cand = _by_row(b, r, cols, w.view(-1).index_select(0, flat))  # candidates in id order
        compact &= padded_row_sum(cand) >= target  # rows short of it drop out
    dense = (lb != float("inf")) & ~compact
    if bool(compact.any()):
        sub = _rows_where(compact)
        ids, cand = _take(ids, sub), _take(cand, sub)
        cut_to_mass(cand, _take(target, sub), out=cand)
        parts.append(Part(_within(rows, sub), ids, _min_p_normalise_(cand, _take_params(rp, sub), w_max, sub)))
    if bool(dense.any()):
        sub = _rows_where(dense)
        rows_w = w if sub is None else w[sub]  # the scratch weights are only read; a selection is a copy
        rows_w = cut_to_mass(rows_w, _take(target, sub), out=None if sub is None else rows_w)
        parts.append(Part(_within(rows, sub), None, _min_p_normalise_(rows_w, _take_params(rp, sub), w_max, sub)))
    return parts


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


def _min_p_normalise_(w: Tensor, rp: RowParams, w_max: Tensor, rows: Tensor | None) -> Tensor:
    """min-p (threshold ``min_p * w_max``, with ``w_max`` ``[r, 1]`` taken at ``rows``) and
    renormalisation, in place."""
    if not rp.all_equal("min_p", 0):
        w.mul_(w >= rp.min_p[:, None] * _take(w_max, rows))
    return _normalise_(w)


def _cross(mass: Tensor, above: Tensor, target: Tensor) -> Tensor:
    """The bucket where each row's prefix mass crosses the target (-1 if never), from a
    histogram ``[r, k]`` of the pending tokens' mass by digit (the highest digit the
    heaviest); adds to ``above`` (in place) the mass of the buckets above it."""
    k = mass.shape[1]
    from_top = mass.flip(-1).cumsum(-1)  # the mass of the j + 1 heaviest buckets
    j = torch.searchsorted(from_top, (target - above)[:, None], side="left")  # the first reaching it
    above += torch.where(j > 0, from_top.gather(1, (j - 1).clamp_(min=0)), 0.0)[:, 0]
    return (k - 1) - j[:, 0]


def cut_to_mass(w: Tensor, target: Tensor, out: Tensor | None = None) -> Tensor:
    """``w`` with each row's weights zeroed outside the smallest prefix of the (weight desc,
    position asc) order whose mass reaches ``target`` (all of them kept if none does).

    A radix select on the weights' float32 bit patterns (monotone in the weight): the first
    digit (:func:`_first_digit`) finds the bin where each row's prefix mass crosses the
    target; tokens above it are kept, below dropped, and the crossing bin's tokens are
    settled by :func:`_settle`.

    w: float32 ``[r, C]``, >= 0. target: float32 ``[r]``, absolute mass. out: where to write
    the result (``w`` itself: in place); default a new tensor, ``w`` then only read.
    """
    digit, crossing, above, _, _ = _first_digit(w, target)
    return _cut_from(w, digit, crossing, above, target, out)


def _first_digit(w: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The radix cut's first digit, over the whole matrix: each row's weights binned by bits
    30..17 (64 bins per octave) relative to its largest, 2047 bins over the 32 octaves below
    it and the lowest bin (0) holding everything further below; a histogram of mass by bin
    gives the bin where the prefix mass crosses the target.

    w: float32 ``[r, C]``, >= 0; target: ``[r]``. Returns the bins int32 ``[r, C]`` (a scratch
    tensor), the crossing bin int32 ``[r, 1]`` (-1 if never), the mass above it ``[r]``, the
    histogram float32 ``[r, 2048]`` and the bit pattern >> 17 of bin 0, int32 ``[r, 1]``.
    """
    base = (w.amax(-1, keepdim=True).view(torch.int32) >> _RADIX_SHIFT) - (_RADIX_KEYS - 1)
    digit = _keys(w, _RADIX_SHIFT, "digits").sub_(base).clamp_(min=0)
    hist = _histogram(digit, w, _RADIX_KEYS)
    above = torch.zeros(w.shape[0], device=w.device)
    crossing = _cross(hist, above, target).to(torch.int32)[:, None]
    return digit, crossing, above, hist, base


def _cut_from(w: Tensor, digit: Tensor, crossing: Tensor, above: Tensor, target: Tensor,
              out: Tensor | None) -> Tensor:
    """:func:`cut_to_mass` after its first digit (:func:`_first_digit` of ``w``)."""
    # drop the bins below (comparisons into float / int32 scratch: no masked_fill_, no bool
    # temporaries, which are slower); from here on w is the result
    keep = SCRATCH.get("keep", digit.shape, torch.float32, w.device)
    w = torch.mul(w, torch.ge(digit, crossing, out=keep), out=out)
    _, b, col = _positions("eq", digit, crossing)
    _settle(w, b, col, crossing, above, target)
    return w


def _settle(w: Tensor, b: Tensor, col: Tensor, crossing: Tensor, above: Tensor, target: Tensor) -> None:
    """Zeroes, in place, the tokens ``w[b, col]`` of each row's crossing bin of the first digit
    that lie past the cut: they are split by 11 bits at a time (the bits they do not yet
    share), and the few left are ordered by a sort.

    w: float32 ``[r, C]``; b, col: int64 ``[n]``, row-major; crossing: int32 ``[r, 1]``;
    above: ``[r]``, the mass of the tokens above the bin (updated); target: ``[r]``.
    """
    r = w.shape[0]
    # the bits the pending tokens of each row share: those above bit 17, but none in bin 0
    shared = torch.where(crossing[:, 0] > 0, _RADIX_SHIFT, 31)
    while b.numel() > r * _RADIX_SORT and bool(shared.any()):
        v = w[b, col]
        shift = (shared - 11).clamp_(min=0)
        digit = (v.view(torch.int32) >> shift[b]) & (_RADIX_KEYS - 1)
        mass = torch.zeros(r * _RADIX_KEYS, device=w.device).index_add_(0, b * _RADIX_KEYS + digit, v)
        crossing = _cross(mass.view(r, _RADIX_KEYS), above, target)
        below = digit < crossing[b]
        w[b[below], col[below]] = 0.0
        stay = digit == crossing[b]
        b, col = b[stay], col[stay]
        shared = shift
    # the last pending tokens of each row, ordered (weight desc, position asc)
    v, order = w[b, col].sort(descending=True, stable=True)
    b, col = b[order], col[order]
    b, order = b.sort(stable=True)
    col, v = col[order], v[order]
    at, grid = _by_row(b, r, v)
    before = torch.nn.functional.pad(grid.cumsum(-1)[:, :-1], (1, 0)).view(-1)[at]
    drop = above[b] + before >= target[b]
    w[b[drop], col[drop]] = 0.0
