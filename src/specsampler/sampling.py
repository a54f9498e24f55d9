"""Logits to processed probabilities, and categorical sampling.

Processing (DESIGN.md): vocab mask, temperature, top-k, top-p on the top-k-renormalised
distribution, min-p, renormalise. Temperature 0 is greedy: a one-hot row at the argmax.
"Order" is logit (or probability) desc, id asc: top-k keeps exactly k tokens with ties
to the lower id, and top-p keeps the smallest prefix of that order whose mass reaches p.

A processed distribution is held compactly (:class:`Processed`). Rows whose kept set is
bounded (greedy, top-k, a top-p nucleus found among the top candidates) keep only their
ordered candidates ``[R, C]``; the others are dense ``[R, V]``. No full-vocabulary sort:
top-k is a ``torch.topk``, and a nucleus is searched among the top 64, 512, 4096, ...
candidates (a sort happens only when a nucleus holds a large part of the vocabulary).

Sampling draws one uniform ``u`` per row (see :mod:`specsampler.rng` for the counters) and
returns the first id, in id order, whose cumulative probability exceeds ``u * total``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .params import RowParams, SamplingParams
from .rng import STREAM_SAMPLE, Philox, check_rng, uniform
from .validation import (
    check_logits_values,
    check_mode,
    check_no_bad,
    check_probs_values,
    check_tensor,
    fail,
    shape_str,
)

_NUCLEUS_CANDIDATES = 64  # a nucleus within the first 64 candidates stays sparse
_KEY_SHIFT = 16  # radix select on bits 30..16 of non-negative float32 weights
_NUM_KEYS = 1 << 15


class SampleOutput(NamedTuple):
    """Result of :func:`sample_from_logits`; ``[B, ...]`` is the leading shape of the logits.

    tokens: int64 ``[B, ...]``, in ``[0, V)``.
    logprobs: float32 ``[B, ...]``, log-probability of each token under the processed distribution.
    top_token_ids: int64 ``[B, ..., N]`` (``num_logprobs = N``), the N most likely tokens of the
        processed distribution, most likely first; ``-1`` where it has fewer than N tokens.
        ``None`` when ``N == 0``.
    top_logprobs: float32 ``[B, ..., N]``, their log-probabilities (``-inf`` at ``-1``), or ``None``.
    """

    tokens: Tensor
    logprobs: Tensor
    top_token_ids: Tensor | None
    top_logprobs: Tensor | None


@dataclass(frozen=True)
class Part:
    """Some rows of a :class:`Processed`, held one way.

    rows: int64 ``[r]``, which of the ``R`` rows these are, or ``None`` for all of them.
    ids: int64 ``[r, C]``: each row's candidates in (logit desc, id asc) order (a row with
        fewer than C pads with id 0 at probability 0), or ``None`` when the rows are dense.
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
        if self.ids is None:
            return sample_by_inversion(self.probs, u)
        ids, perm = self.ids.sort(dim=-1)
        return ids.gather(1, sample_by_inversion(self.probs.gather(1, perm), u)[:, None])[:, 0]

    def prob(self, tokens: Tensor) -> Tensor:
        if self.ids is None:
            return self.probs.gather(1, tokens[:, None])[:, 0]
        return torch.where(self.ids == tokens[:, None], self.probs, 0.0).sum(-1)

    def top(self, n: int) -> tuple[Tensor, Tensor]:
        if self.ids is None:
            probs, ids = ordered_prefix(self.probs, n)
        else:
            probs, ids = self.probs[:, :n], self.ids[:, :n]
        if probs.shape[1] < n:  # fewer candidates than asked: pad
            pad = n - probs.shape[1]
            probs = torch.nn.functional.pad(probs, (0, pad))
            ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
        return torch.where(probs > 0, ids, -1), probs.log()


@dataclass(frozen=True)
class Processed:
    """The processed distributions of ``R`` rows over a vocabulary of ``V`` tokens, in parts.

    Rows whose kept set is bounded keep only their ordered candidates; the others are dense.
    """

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
            parts.append(Part(None, _take(part.ids, rows) if part.ids is not None else None, part.probs[rows]))
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
                    parts.append(Part(sel, part.ids[loc] if part.ids is not None else None, part.probs[loc]))
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
    """
    cum = weights.cumsum(-1)
    total = cum[:, -1:].contiguous()
    idx = torch.searchsorted(cum, u[:, None] * total, right=True)
    last = torch.searchsorted(cum, total, right=False)  # the last column that adds mass
    return torch.minimum(idx, last).clamp_(0, weights.shape[1] - 1)[:, 0]


def ordered_prefix(scores: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The first ``n`` entries of each row in (score desc, id asc) order, exactly (ties included).

    scores: float32 ``[R, V]``. Returns values float32 ``[R, min(n, V)]`` and ids int64.
    A ``torch.topk``; rows with a tie across the cut are resolved by id with one extra pass.
    NaN counts as larger than any number (as in ``torch.topk``).
    """
    R, V = scores.shape
    n = min(n, V)
    if n == V:
        return torch.sort(scores, dim=-1, descending=True, stable=True)
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


def process(x: Tensor, rp: RowParams, *, logits: bool, min_candidates: int = 0) -> Processed:
    """Apply temperature (if ``logits``), top-k, top-p and min-p to each row, renormalised.

    x: float32 ``[R, V]``: masked logits (``-inf`` = masked) or, with ``logits=False``,
        probabilities (temperature is then ignored). Not modified.
    rp: per-row parameters ``[R]``.
    min_candidates: keep at least this many ordered candidates in sparse rows (for top-N).
    """
    R, V = x.shape
    greedy = rp.temperature == 0 if logits else torch.zeros(R, dtype=torch.bool, device=x.device)
    topk_on = (rp.top_k > 0) & (rp.top_k < V) & ~greedy
    bounded = greedy | topk_on  # at most k candidates
    nucleus = (rp.top_p < 1) & ~bounded  # top-p alone: the nucleus size is found per row
    plain = ~(bounded | nucleus)  # temperature and min-p only: dense
    parts = []
    if R == 0 or bool(plain.any()):
        rows = _rows_where(plain)
        parts.append(_plain_part(rows, _take(x, rows), _take_params(rp, rows), logits))
    if bool(bounded.any()):
        rows = _rows_where(bounded)
        parts.append(_bounded_part(rows, _take(x, rows), _take_params(rp, rows), _take(greedy, rows), logits,
                                   min_candidates))
    if bool(nucleus.any()):
        rows = _rows_where(nucleus)
        parts += _nucleus_parts(rows, _take(x, rows), _take_params(rp, rows), logits, min_candidates)
    return Processed(tuple(parts), R, V)


def _rows_where(mask: Tensor) -> Tensor | None:
    return None if bool(mask.all()) else mask.nonzero()[:, 0]


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    return t if rows is None else t[rows]


def _take_params(rp: RowParams, rows: Tensor | None) -> RowParams:
    return rp if rows is None else rp.take(rows)


def _within(outer: Tensor | None, inner: Tensor | None) -> Tensor | None:
    """Rows ``inner`` of the subset ``outer``, as indices into the full batch."""
    if inner is None:
        return outer
    return inner if outer is None else outer[inner]


def _weights(vals: Tensor, top: Tensor, temperature: Tensor, logits: bool) -> Tensor:
    """Unnormalised probabilities (a new tensor): ``exp((x - top) / T)`` for logits, else x.

    Non-finite results (rows with no finite logit, NaN) and negative probabilities become 0.
    """
    if not logits:
        return vals.nan_to_num(nan=0.0, posinf=0.0).clamp_(min=0.0)
    return (vals - top).div_(temperature[:, None]).exp_().nan_to_num_(nan=0.0)


def _normalise_(w: Tensor) -> Tensor:
    """Divide each row by its sum, in place (rows without mass stay 0)."""
    return w.div_(w.sum(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny))


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


def _bounded_part(rows, x, rp, greedy, logits, min_candidates) -> Part:
    """Greedy and top-k rows: their k (1 for greedy) ordered candidates."""
    keep_n = torch.where(greedy, 1, rp.top_k)
    vals, ids = ordered_prefix(x, max(min_candidates, int(keep_n.max())))
    w = _weights(vals, vals[:, :1], torch.where(greedy, 1.0, rp.temperature), logits)
    w = torch.where(torch.arange(w.shape[1], device=x.device) < keep_n[:, None], w, 0.0)
    return Part(rows, ids, _normalise_(_cut_candidates(w, rp)))


def _nucleus_parts(rows, x, rp, logits, min_candidates) -> list[Part]:
    """Top-p rows without top-k: sparse where the nucleus lies among the first candidates,
    else dense with the nucleus cut by a radix select."""
    vals, ids = ordered_prefix(x, max(min_candidates, _NUCLEUS_CANDIDATES))
    top = vals[:, :1]
    wc = _weights(vals, top, rp.temperature, logits)
    w = _weights(x, top, rp.temperature, logits)
    z = w.sum(-1)
    small = wc.sum(-1) >= rp.top_p * z
    parts = []
    if bool(small.any()):
        sub = _rows_where(small)
        kept = _cut_candidates(_take(wc, sub), _take_params(rp, sub), _take(z, sub))
        parts.append(Part(_within(rows, sub), _take(ids, sub), _normalise_(kept)))
    if not bool(small.all()):
        sub = _rows_where(~small)
        big, rp_big = _take(w, sub), _take_params(rp, sub)
        nucleus_cut_(big, rp_big.top_p)
        if bool((rp_big.min_p > 0).any()):
            big.masked_fill_(big < rp_big.min_p[:, None] * big.amax(-1, keepdim=True), 0.0)
        parts.append(Part(_within(rows, sub), None, _normalise_(big)))
    return parts


def _plain_part(rows, x, rp, logits) -> Part:
    """Rows with neither top-k nor top-p: dense, with min-p."""
    top = x.amax(-1, keepdim=True)
    w = _weights(x, top, rp.temperature, logits)
    if bool((rp.min_p > 0).any()):
        w.masked_fill_(w < rp.min_p[:, None] * (1.0 if logits else top), 0.0)
    return Part(rows, None, _normalise_(w))


def nucleus_cut_(w: Tensor, top_p: Tensor) -> Tensor:
    """Zero, in place, the weights outside each row's top-p nucleus.

    The nucleus is the smallest prefix of the (weight desc, id asc) order whose mass reaches
    ``top_p`` times the row's mass. A radix select instead of a sort: one pass builds each
    row's histogram of mass over the top 15 bits of the weights' float32 bit patterns
    (monotone in the weight), which locates the bin where the prefix mass crosses the
    target; only the tokens of that bin are then ordered.

    w: float32 ``[r, V]``, finite, >= 0, contiguous (modified). top_p: float32 ``[r]``.
    """
    r, V = w.shape
    key = w.view(torch.int32) >> _KEY_SHIFT
    flat = key + torch.arange(r, dtype=torch.int32, device=w.device)[:, None] * _NUM_KEYS
    hist = torch.zeros(r * _NUM_KEYS, device=w.device).index_add_(0, flat.view(-1), w.view(-1))
    suffix = hist.view(r, _NUM_KEYS).flip(-1).cumsum(-1).flip(-1)  # mass of the bins >= k
    target = top_p * suffix[:, 0]
    crossing = (suffix >= target[:, None]).sum(-1, dtype=torch.int32) - 1  # where the prefix reaches the target
    suffix = torch.nn.functional.pad(suffix, (0, 1))  # bin _NUM_KEYS: nothing above the top bin
    above = suffix.gather(1, crossing.long()[:, None] + 1)[:, 0]  # mass of the bins above the crossing one
    # the crossing bin's tokens, ordered (weight desc, id asc) within their row
    b_row, b_col = (key == crossing[:, None]).nonzero(as_tuple=True)
    b_w, order = w[b_row, b_col].sort(descending=True, stable=True)
    b_row, b_col = b_row[order], b_col[order]
    b_row, order = b_row.sort(stable=True)
    b_col, b_w = b_col[order], b_w[order]
    counts = torch.bincount(b_row, minlength=r)
    pos = torch.arange(b_row.numel(), device=w.device) - (counts.cumsum(0) - counts)[b_row]
    grid = torch.zeros(r, int(counts.max()) if b_row.numel() else 0, device=w.device)
    grid[b_row, pos] = b_w
    before = torch.nn.functional.pad(grid.cumsum(-1)[:, :-1], (1, 0))[b_row, pos]
    drop = above[b_row] + before >= target[b_row]
    w.masked_fill_(key < crossing[:, None], 0.0)
    w[b_row[drop], b_col[drop]] = 0.0
    return w


# ----------------------------------------------------------------------------- public API


def _leading(op: str, name: str, t: Tensor) -> tuple[int, int, int]:
    """(B, M, V) of a ``[B, ..., V]`` tensor: M rows per request."""
    check_tensor(op, name, t, kind="float", ndim=(2, 8))
    B, V = t.shape[0], t.shape[-1]
    if V == 0:
        fail(op, name, "a vocabulary dimension V >= 1", f"shape {shape_str(t.shape)}")
    return B, (t.numel() // (B * V)) if B else 0, V


def logit_inputs(op, logits, params, vocab_mask, full) -> tuple[RowParams, Tensor | None, int, int]:
    """Validate the inputs of an op on logits ``[B, ..., V]``.

    Returns the parameters of each of the ``R = B * M`` rows, the vocab mask broadcast to the
    logits' shape (a view, or None), B and M. Reads no logits unless ``full``.
    """
    B, M, V = _leading(op, "logits", logits)
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        fail(op, "params", "a SamplingParams or None", type(params).__name__)
    rp = params.rows(op, B, M, logits.device, full)
    mask = None
    if vocab_mask is not None:
        check_tensor(op, "vocab_mask", vocab_mask, kind="bool")
        try:
            mask = vocab_mask.to(logits.device).expand(logits.shape)
        except RuntimeError:
            fail(op, "vocab_mask", f"a shape broadcastable to logits {shape_str(logits.shape)}",
                 shape_str(vocab_mask.shape))
        if full:
            none_allowed = ~mask.any(-1)
            check_no_bad(op, "vocab_mask", none_allowed, none_allowed, "at least one allowed token per row")
    if full:
        check_logits_values(op, "logits", logits)
    return rp, mask, B, M


def logit_rows(op, logits, params, vocab_mask, full) -> tuple[Tensor, RowParams, int, int]:
    """Validated, masked float32 rows ``[R, V]`` and their parameters, B and M."""
    rp, mask, B, M = logit_inputs(op, logits, params, vocab_mask, full)
    V = logits.shape[-1]
    x = logits.reshape(-1, V).float()
    if mask is not None:
        x = x.masked_fill(~mask.reshape(-1, V), float("-inf"))
    return x, rp, B, M


def logits_to_probs(
    logits: Tensor,
    params: SamplingParams | None = None,
    vocab_mask: Tensor | None = None,
    *,
    validate: str = "structure",
) -> Tensor:
    """The processed target distribution.

    Args:
        logits: float32/bf16/fp16 ``[B, ..., V]``.
        params: per-request :class:`SamplingParams` (scalars or ``[B]``); default: temperature 1.
        vocab_mask: bool, broadcastable to ``[B, ..., V]``; True = allowed. Applied first.
        validate: ``"structure"`` or ``"full"``.
    Returns:
        float32 ``[B, ..., V]``, each row summing to 1 (greedy rows one-hot at the argmax;
        a row with no allowed finite logit is all 0).
    """
    op = "logits_to_probs"
    full = check_mode(op, validate)
    x, rp, _, _ = logit_rows(op, logits, params, vocab_mask, full)
    return process(x, rp, logits=True).dense().reshape(logits.shape)


def _renorm(op: str, probs: Tensor, params: SamplingParams, validate: str) -> Tensor:
    full = check_mode(op, validate)
    B, M, V = _leading(op, "probs", probs)
    if full:
        check_probs_values(op, "probs", probs)
    rp = params.rows(op, B, M, probs.device, full)
    return process(probs.reshape(-1, V).float(), rp, logits=False).dense().reshape(probs.shape)


def top_k_renorm(probs: Tensor, top_k: int | Tensor, *, validate: str = "structure") -> Tensor:
    """Keep the ``top_k`` most likely tokens of each row (ties to the lower id) and renormalise.

    probs: float ``[B, ..., V]`` (need not be normalised); top_k: int or int tensor ``[B]``,
    ``<= 0`` or ``>= V`` is off. Returns float32 ``[B, ..., V]``.
    """
    return _renorm("top_k_renorm", probs, SamplingParams(top_k=top_k), validate)


def top_p_renorm(probs: Tensor, top_p: float | Tensor, *, validate: str = "structure") -> Tensor:
    """Keep the smallest prefix of the (prob desc, id asc) order whose mass reaches ``top_p``.

    probs: float ``[B, ..., V]``; top_p: float in (0, 1] or float tensor ``[B]``.
    Returns float32 ``[B, ..., V]``, renormalised.
    """
    return _renorm("top_p_renorm", probs, SamplingParams(top_p=top_p), validate)


def min_p_renorm(probs: Tensor, min_p: float | Tensor, *, validate: str = "structure") -> Tensor:
    """Keep tokens with probability ``>= min_p * max probability`` of their row, renormalised.

    probs: float ``[B, ..., V]``; min_p: float in [0, 1] or float tensor ``[B]``.
    Returns float32 ``[B, ..., V]``.
    """
    return _renorm("min_p_renorm", probs, SamplingParams(min_p=min_p), validate)


def sample(probs: Tensor, rng: torch.Generator | Philox | None = None, *, validate: str = "structure") -> Tensor:
    """Draw one token from each distribution (categorical over the last dim).

    probs: float ``[B, ..., V]``, non-negative (need not be normalised).
    rng: ``None``, a ``torch.Generator`` or :class:`Philox` (row ``(b, j)`` uses request b's
    stream, index j = flat position inside the request).
    Returns int64 ``[B, ...]`` in ``[0, V)``.
    """
    op = "sample"
    full = check_mode(op, validate)
    check_rng(op, rng)
    B, M, V = _leading(op, "probs", probs)
    if full:
        check_probs_values(op, "probs", probs)
    u = uniform(rng, op, B, M, STREAM_SAMPLE, probs.device).reshape(-1)
    return sample_by_inversion(probs.reshape(-1, V).float(), u).reshape(probs.shape[:-1])


def sample_from_logits(
    logits: Tensor,
    params: SamplingParams | None = None,
    rng: torch.Generator | Philox | None = None,
    vocab_mask: Tensor | None = None,
    num_logprobs: int = 0,
    *,
    validate: str = "structure",
) -> SampleOutput:
    """Process the logits (see :func:`logits_to_probs`) and draw one token per row.

    Draws the same token as ``sample(logits_to_probs(logits, params, vocab_mask), rng)`` for
    the same random stream (up to float rounding at a cumulative-probability boundary),
    without building the dense distribution when the kept set is small.

    Args:
        logits: float32/bf16/fp16 ``[B, ..., V]``.
        params: :class:`SamplingParams`, scalars or per request ``[B]``; temperature 0 = greedy.
        rng: ``None``, a ``torch.Generator`` or :class:`Philox`.
        vocab_mask: bool broadcastable to ``[B, ..., V]``, True = allowed.
        num_logprobs: N >= 0; also return the N most likely tokens and their log-probabilities.
    Returns:
        :class:`SampleOutput`.
    """
    op = "sample_from_logits"
    full = check_mode(op, validate)
    check_rng(op, rng)
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int) or num_logprobs < 0:
        fail(op, "num_logprobs", "an int >= 0", repr(num_logprobs))
    x, rp, B, M = logit_rows(op, logits, params, vocab_mask, full)
    proc = process(x, rp, logits=True, min_candidates=num_logprobs)
    u = uniform(rng, op, B, M, STREAM_SAMPLE, logits.device).reshape(-1)
    tokens = proc.sample(u)
    lead = logits.shape[:-1]
    logprobs = proc.prob(tokens).log().reshape(lead)
    top_ids = top_lp = None
    if num_logprobs:
        top_ids, top_lp = proc.top(num_logprobs)
        top_ids, top_lp = top_ids.reshape(*lead, num_logprobs), top_lp.reshape(*lead, num_logprobs)
    return SampleOutput(tokens.reshape(lead), logprobs, top_ids, top_lp)
