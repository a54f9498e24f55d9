"""Top-p rows without top-k: their nucleus found without sorting the vocabulary (a token that alone
reaches p; rows counted whole by a radix select on the weights' bit patterns; longer rows estimated
from their heaviest chunks and a subsample, then compacted), and the radix cut itself (:func:`cut_to_mass`).

The method: docs/design.md, "Processing without sorting the vocabulary".
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..params import RowParams
from .distributions import Part, _take
from .filters import (
    _TINY,
    _candidate_weights,
    _cut_candidates,
    _min_p_normalise_,
    _part_in_id_order,
    _rows_where,
    _take_params,
    _weights,
    _within,
)
from .masses import as_weight, mass_interval, masses, row_mass, top_p_target
from .rounding import grid_length
from .scratch import SCRATCH
from .topk import _by_row, _chunk_len, _positions, ordered_prefix

SMALL_NUCLEUS = 64  # nuclei first searched among the 64 most likely tokens
_ORDER_WHOLE = 1024  # top-p rows this short are ordered whole: cheaper than estimating a nucleus bound
_BLOCK = 512  # rows per block in the search for large nuclei
_WEIGHTS_BLOCK = 1 << 21  # values per block of rows whose weights are computed and summed at once (in cache)
_RADIX_SHIFT = 17  # the radix select's first digit: 64 bins per octave of weight,
_RADIX_KEYS = 1 << 11  # 2048 of them; then 11 bits at a time
_RADIX_SORT = 256  # pending tokens per row (on average) few enough to sort
_SUBSAMPLE = 4096  # tokens per row a large nucleus's threshold is estimated from,
_COUNT_WHOLE = 1 << 16  # in rows longer than this; shorter ones are counted whole
_EST_SHIFT = 20  # the estimate's bins: 8 per octave of weight,
_EST_BINS = 256  # over the 32 octaves below the most likely token


def _nucleus_parts(rows, x, rp, logits) -> list[Part]:
    """Top-p rows without top-k: sparse, their nucleus found without sorting the vocabulary.

    Rows are taken in blocks of :data:`_BLOCK`, which bounds the per-row histograms' memory.
    """
    r, V = x.shape
    if V <= _ORDER_WHOLE:  # the whole row is the candidate set
        vals, ids = ordered_prefix(x, V)
        w = _candidate_weights(vals, rp.temperature, logits)
        return [_part_in_id_order(rows, ids, _cut_candidates(w, ids, rp))]
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
    chunk_max, best, w, lo, hi = _weights_and_bounds(x, rp, logits)
    w_max = w.gather(1, best[:, None])
    # a token that alone reaches top-p is the nucleus (decided from bounds on each row's mass, :class:`_Target`)
    m_max = masses(w_max[:, 0])  # 0 for a row without mass (no finite logit), which is then done
    target = _Target(w, rp.top_p, lo, hi)
    done = target.reached(m_max)
    parts = []
    n_done = int(done.sum())
    if n_done:
        sub = None if n_done == r else done.nonzero()[:, 0]
        first = _first_of_largest(x, w, _take(w_max, sub), _take(chunk_max, sub) if chunk_max is not None else None,
                                  _take(best, sub), sub)
        mass = (_take(m_max, sub) > 0).float()[:, None]  # 1, or 0 for a row without mass
        parts.append(Part(_within(rows, sub), first[:, None], mass))
        if sub is None:
            return parts
    if V <= _COUNT_WHOLE or 2 * n_done > r:  # the rows that go on, copied (or most rows go on, and stay in place:
        sub = _rows_where(~done)  # copying them costs more than the later passes reading the few done ones too)
        rows, x, w, w_max = _within(rows, sub), _take(x, sub), _take(w, sub), _take(w_max, sub)
        rp, chunk_max = _take_params(rp, sub), _take(chunk_max, sub) if chunk_max is not None else None
        r = w.shape[0]
        if V <= _COUNT_WHOLE:  # short rows: counting them whole costs less than estimating
            return parts + _counted_nuclei(rows, w, rp, w_max)
        target = target.take(w, sub)
        done = torch.zeros(r, dtype=torch.bool, device=x.device)
    lb, likely, size = _nucleus_bound(w, w_max, target.high(), target.hi, chunk_max)
    small = (size <= SMALL_NUCLEUS // 2) & ~done
    if bool(small.any()):  # a small nucleus: among the most likely tokens, found as for top-k
        sub = _rows_where(small)
        vals, head = ordered_prefix(_take(x, sub), SMALL_NUCLEUS, _take(chunk_max, sub) if chunk_max is not None
                                    else None)
        head_w = _take(w, sub).gather(1, head)
        found = target.reached(row_mass(head_w), sub)
        if bool(found.any()):
            got = _within(sub, _rows_where(found))
            head_w, head, rp_got = head_w[found], head[found], _take_params(rp, got)
            kept = target.decide(lambda z: _cut_candidates(head_w, head, rp_got, z), got)
            parts.append(_part_in_id_order(_within(rows, got), head, kept))
            done[(torch.arange(r, device=x.device) if sub is None else sub)[found]] = True
    if not bool(done.all()):
        parts += _large_nuclei(rows, w, torch.where(done, float("inf"), lb), likely, target, rp, w_max)
    return parts


def _weights_and_bounds(x: Tensor, rp: RowParams, logits: bool) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor]:
    """The passes over whole rows ``x`` float32 ``[r, V]``, a block of rows at a time (about
    :data:`_WEIGHTS_BLOCK` values) so that all but the first read the caches, not memory: the chunk maxima of the
    logits, each row's largest and its lowest id, the unnormalised weights (:func:`_weights`, the most likely
    token's 1) and bounds on each row's mass (:func:`~.masses.mass_interval`). Row by row, the numbers of any
    block.

    Returns chunk_max ``[r, V / L]`` (None when V has no chunk length or x is not contiguous), best int64 ``[r]``,
    w float32 ``[r, V]`` (a scratch tensor) and lo, hi float64 ``[r]``.
    """
    r, V = x.shape
    L = _chunk_len(V) if x.is_contiguous() else 0
    step = max(1, _WEIGHTS_BLOCK // max(V, 1))
    # each block's weights in place in one buffer (the exponential's padding runs into the next block's rows,
    # written after it, and past the last into the buffer's own padding)
    size = max((s * V + grid_length(min(step, r - s) * V) for s in range(0, r, step)), default=0)
    flat = SCRATCH.get("weights", (size,), torch.float32, x.device)
    out = []
    for s in range(0, r, step):
        xb = x[s:s + step]
        chunk_max = xb.view(xb.shape[0], V // L, L).amax(-1) if L else None
        top, best = _max(xb, chunk_max)
        temperature = rp.temperature[s:s + step]
        wb = _weights(xb, top[:, None], temperature, logits, shared=rp.shared is not None, out=flat[s * V:])
        out.append((chunk_max, best, *mass_interval(wb)))
    chunk_max, best, lo, hi = (None if parts[0] is None else torch.cat(parts) for parts in zip(*out))
    return chunk_max, best, flat[:r * V].view(r, V), lo, hi


class _Target:
    """The mass each row's nucleus must reach, ``ceil(top_p * Z)``, known from bounds ``lo <= Z <= hi`` on the
    row's exact mass (:func:`~.masses.mass_interval`): a decision monotone in the target that both ends agree
    on is the exact one; rows where they differ are given their exact mass (``lo = hi = Z``) and decided again.

    w: float32 ``[r, V]``, the rows' weights (read only when a row is settled); top_p: float32 ``[r]``; lo, hi:
    float64 ``[r]``.
    """

    def __init__(self, w: Tensor, top_p: Tensor, lo: Tensor, hi: Tensor):
        self.w, self.top_p, self.lo, self.hi = w, top_p, lo.clone(), hi.clone()

    def high(self) -> Tensor:
        """float64 ``[r]``: the target at the upper bound (an estimate where the bounds differ)."""
        return top_p_target(self.top_p, self.hi)

    def take(self, w: Tensor, sub: Tensor | None) -> _Target:
        """The target of rows ``sub`` (None: all), whose weights are now ``w``."""
        return _Target(w, _take(self.top_p, sub), _take(self.lo, sub), _take(self.hi, sub))

    def _make_exact(self, open_rows: Tensor, sub: Tensor | None) -> None:
        """Give the rows ``sub[open_rows]`` (``sub``: indices into the ``r`` rows, None for all) their exact mass."""
        at = _within(sub, open_rows.nonzero()[:, 0])
        z = row_mass(self.w.index_select(0, at))
        self.lo[at], self.hi[at] = z, z

    def reached(self, mass: Tensor, sub: Tensor | None = None) -> Tensor:
        """bool ``[n]``: whether ``mass`` float64 ``[n]`` reaches the target of rows ``sub`` (None: all)."""
        return self.decide(lambda z: mass >= top_p_target(_take(self.top_p, sub), z), sub)

    def cut(self, w: Tensor, m: Tensor, sub: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:func:`cut_to_mass` of rows ``w`` float32 ``[n, C]`` (those of ``sub``, None: all; ``m``: their masses,
        float64) to their target, and the kept tokens' mass float64 ``[n]``: cut once, to the upper end's; the
        kept set is the same for every target above the mass before its last token (the lightest kept, whose mass
        every token of that weight has), so a row whose lower end's target is not above it is settled and cut
        again."""
        top_p = _take(self.top_p, sub)
        low, high = top_p_target(top_p, _take(self.lo, sub)), top_p_target(top_p, _take(self.hi, sub))
        kept, mass = _cut(w, high, m=m)
        before_last = mass - masses(torch.where(kept > 0, kept, float("inf")).amin(-1))
        open_rows = (low < high) & (before_last >= low)
        if bool(open_rows.any()):
            self._make_exact(open_rows, sub)
            at = open_rows.nonzero()[:, 0]
            kept[at], mass[at] = _cut(w[at], top_p_target(top_p[at], _take(self.lo, sub)[at]), m=m[at])
        return kept, mass

    def decide(self, fn, sub: Tensor | None = None) -> Tensor:
        """``fn(z)`` for the exact masses ``z`` float64 ``[n]`` of rows ``sub`` (None: all): a tensor ``[n, ...]``
        that depends on z only through a monotone decision on the target (e.g. a cut to it)."""
        low, high = fn(_take(self.lo, sub)), fn(_take(self.hi, sub))
        differ = (low != high).view(low.shape[0], -1).any(-1)
        if not bool(differ.any()):
            return low
        self._make_exact(differ, sub)
        return fn(_take(self.lo, sub))


def _first_of_largest(x: Tensor, w: Tensor, w_max: Tensor, chunk_max: Tensor | None, best: Tensor,
                      sub: Tensor | None = None) -> Tensor:
    """int64 ``[r]``: the first token of each row's (weight desc, id asc) order, the lowest id of the largest
    weight ``w_max`` ``[r, 1]``. Weights do not decrease with the logit ``x``, so the tokens of that weight lead
    the logits' order: it is ``best`` (int64 ``[r]``, the lowest id of the largest logit) where the next largest
    logit weighs less (:func:`_next_weight`, from the chunk maxima); elsewhere (ties at the top, rows without
    mass, no chunk maxima) found among the logits' first 8 when the 8th weighs less, else by a scan.

    x, w: float32 ``[R, V]``; the rows asked about are ``sub`` (int64 ``[r]``; None: all), read where needed
    rather than copied whole (a batch's other rows may be most of it); w_max, chunk_max, best: those rows'.
    """
    first = best.clone()
    open_rows = torch.ones_like(first, dtype=torch.bool) if chunk_max is None else ~(
        _next_weight(x, w, chunk_max, best, sub) < w_max[:, 0])  # a row without mass (w_max 0) stays open
    if not bool(open_rows.any()):
        return first
    rows = open_rows.nonzero()[:, 0]
    src = rows if sub is None else sub.index_select(0, rows)
    x, w, w_max = x[src], w[src], w_max[rows]
    _, ids = ordered_prefix(x, 8, None if chunk_max is None else chunk_max[rows])
    ties = w.gather(1, ids) == w_max
    first[rows] = torch.where(ties, ids, x.shape[1]).amin(-1)
    scan = ~ties[:, 0] | ties[:, -1]
    if bool(scan.any()):
        at = scan.nonzero()[:, 0]
        first[rows[at]] = (w[at] == w_max[at]).to(torch.uint8).argmax(-1)
    return first


def _next_weight(x: Tensor, w: Tensor, chunk_max: Tensor, best: Tensor, sub: Tensor | None) -> Tensor:
    """float32 ``[r]``: the weight of a token holding each row's largest logit but ``best``'s, found from the
    chunk maxima ``[r, V / L]`` of ``x`` float32 ``[R, V]`` (contiguous; the rows ``sub``, None: all): ``best``'s
    chunk without it, then the chunk with the largest maximum (the rows' weights ``w``: any token of that logit
    has that weight)."""
    r, n = chunk_max.shape
    L = x.shape[1] // n
    chunks = x.view(x.shape[0], n, L)
    row = torch.arange(r, device=x.device) if sub is None else sub
    c = best // L
    own = chunks[row, c].scatter(1, (best % L)[:, None], float("-inf"))
    c2 = chunk_max.scatter(1, c[:, None], own.amax(-1, keepdim=True)).argmax(-1)
    at = c2 * L + torch.where((c2 == c)[:, None], own, chunks[row, c2]).argmax(-1)
    return w[row, at]


def _max(x: Tensor, chunk_max: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each row's largest value and its lowest id, from the chunk maxima when given."""
    if chunk_max is None:
        return x.amax(-1), x.argmax(-1)
    r, n = chunk_max.shape
    top, c = chunk_max.max(-1)  # the first chunk holding the maximum
    return top, c * (x.shape[1] // n) + x.view(r, n, -1)[torch.arange(r, device=x.device), c].argmax(-1)


def _keys(w: Tensor, shift: int, scratch: str | None = None) -> Tensor:
    """Bins of non-negative float32 weights by their bit patterns (monotone in the weight),
    int32; in the named scratch buffer when given."""
    bits = w.contiguous().view(torch.int32)
    if scratch is None:
        return bits >> shift
    return torch.bitwise_right_shift(bits, shift, out=SCRATCH.get(scratch, bits.shape, torch.int32, w.device))


def _histogram(keys: Tensor, values: Tensor, num_keys: int) -> Tensor:
    """Per-row sums of ``values`` (float32 weights or float64 masses) by key: ``[r, n]`` int32 keys ->
    ``[r, num_keys]``."""
    return torch.zeros(keys.shape[0], num_keys, dtype=values.dtype, device=keys.device).scatter_add_(
        1, keys.long(), values)


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

    w: float32 ``[r, V]``; w_max: ``[r, 1]``, its row maxima; target, z: float64 ``[r]``, the mass to
    reach and the row's mass (:mod:`.masses`); chunk_max: ``[r, V / L]``, the chunk maxima of the logits, or None.
    Returns lb float32 ``[r]``, likely bool ``[r]``, n float32 ``[r]``.
    """
    r, V = w.shape
    target, z = as_weight(target), as_weight(z)  # an estimate: in float32
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


def _counted_nuclei(rows, w: Tensor, rp: RowParams, w_max: Tensor) -> list[Part]:
    """Top-p rows whose nucleus holds more than one token, counted whole: the radix cut's first
    digit (a histogram of each row's mass by bin, :func:`_first_digit`, whose total is the row's
    exact mass) finds the bin where the nucleus ends. A bin's tokens weigh within 1.1% of each
    other, so its mass over its lowest weight bounds its token count: rows with few tokens down to
    the crossing bin (up to a sixteenth of the row) are compacted (candidates in id order), the
    others cut densely.

    w: float32 ``[r, V]`` weights (only read: may be a scratch tensor); w_max: ``[r, 1]``, the weight of the
    most likely token, for min-p.
    """
    r, V = w.shape
    digit, hist, base = _first_digit(w)
    target = top_p_target(rp.top_p, hist.sum(-1))
    crossing, above = _first_crossing(hist, target)
    bins = torch.arange(_RADIX_KEYS, dtype=torch.int32, device=w.device)
    lowest = ((base + bins) << _RADIX_SHIFT).clamp_(min=0).view(torch.float32)  # each bin's lowest weight
    count = torch.where(hist > 0, as_weight(hist) / lowest, 0.0)  # at least each bin's tokens
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
        kept = _take(above, sub)  # the mass above the crossing bin, then (settled) the kept tokens'
        _settle(cand, pb, at[pending] - pb * cand.shape[1], _take(crossing, sub), kept, _take(target, sub))
        parts.append(Part(_within(rows, sub), ids, _min_p_normalise_(cand, _take_params(rp, sub), w_max, sub, kept)))
    if not bool(few.all()):
        sub = _rows_where(~few)
        rows_w = _take(w, sub)  # the scratch weights are only read; a selection is a copy
        mass = _take(above, sub)  # becomes the kept tokens' mass
        kept = _cut_from(rows_w, _take(digit, sub), _take(crossing, sub), mass, _take(target, sub),
                         out=None if sub is None else rows_w)
        parts.append(Part(_within(rows, sub), None, _min_p_normalise_(kept, _take_params(rp, sub), w_max, sub, mass)))
    return parts


def _large_nuclei(rows, w: Tensor, lb: Tensor, likely: Tensor, target: _Target, rp: RowParams, w_max) -> list[Part]:
    """The rows with a finite ``lb``, whose nucleus holds more than the head.

    Their tokens above ``lb`` are compacted (candidates in id order) when their mass proves
    the nucleus is among them; rows whose tokens above ``lb`` are not ``likely`` to reach the
    target, or do not, are cut densely instead.

    w: float32 ``[r, V]`` weights (a scratch tensor: read only); lb: ``[r]``; target: the rows' :class:`_Target`;
    likely: bool ``[r]``; w_max: ``[r, 1]``, the weight of the most likely token, for min-p.
    """
    r, V = w.shape
    compact = likely & (lb != float("inf"))
    parts = []
    if bool(compact.any()):
        flat, b, cols = _positions("ge", w, torch.where(compact, lb, float("inf"))[:, None])
        _, ids, cand = _by_row(b, r, cols, w.view(-1).index_select(0, flat))  # candidates in id order
        m = masses(cand, "candidate masses")
        compact &= target.reached(m.sum(-1))  # rows short of it drop out
    dense = (lb != float("inf")) & ~compact
    if bool(compact.any()):
        sub = _rows_where(compact)
        (cand, mass), ids = target.cut(_take(cand, sub), _take(m, sub), sub), _take(ids, sub)
        parts.append(Part(_within(rows, sub), ids, _min_p_normalise_(cand, _take_params(rp, sub), w_max, sub, mass)))
    if bool(dense.any()):
        sub = _rows_where(dense)
        rows_w = w if sub is None else w[sub]  # the scratch weights are only read; a selection is a copy
        top_p = _take(target.top_p, sub)  # the exact target from the cut's own sum of the rows' masses
        rows_w, mass = _cut(rows_w, lambda z: top_p_target(top_p, z), out=None if sub is None else rows_w)
        parts.append(Part(_within(rows, sub), None, _min_p_normalise_(rows_w, _take_params(rp, sub), w_max, sub, mass)))
    return parts


def _cross(mass: Tensor, above: Tensor, target: Tensor) -> Tensor:
    """The bucket where each row's prefix mass crosses the target (-1 if never), from a
    histogram ``[r, k]`` of the pending tokens' mass by digit (the highest digit the
    heaviest); adds to ``above`` (in place) the mass of the buckets above it."""
    k = mass.shape[1]
    from_top = mass.flip(-1).cumsum(-1)  # the mass of the j + 1 heaviest buckets
    j = torch.searchsorted(from_top, (target - above)[:, None], side="left")  # the first reaching it
    above += torch.where(j > 0, from_top.gather(1, (j - 1).clamp_(min=0)), 0)[:, 0]
    return (k - 1) - j[:, 0]


def _first_crossing(hist: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_cross` on the first digit's histogram ``[r, 2048]``: the crossing bin int32 ``[r, 1]`` and the mass
    of the bins above it, float64 ``[r]``."""
    above = torch.zeros(hist.shape[0], dtype=torch.float64, device=hist.device)
    return _cross(hist, above, target).to(torch.int32)[:, None], above


def cut_to_mass(w: Tensor, target: Tensor, out: Tensor | None = None, m: Tensor | None = None) -> Tensor:
    """``w`` with each row's weights zeroed outside the smallest prefix of the (weight desc,
    position asc) order whose exact mass (:mod:`.masses`) reaches ``target`` (all of them kept if none does).

    A radix select on the weights' float32 bit patterns (monotone in the weight): the first
    digit (:func:`_first_digit`) finds the bin where each row's prefix mass crosses the
    target; tokens above it are kept, below dropped, and the crossing bin's tokens are
    settled by :func:`_settle`.

    w: float32 ``[r, C]`` in [0, 1]. target: float64 ``[r]``, absolute mass. out: where to write
    the result (``w`` itself: in place); default a new tensor, ``w`` then only read. m: the masses of ``w``
    (:func:`~.masses.masses`) when the caller has them.
    """
    return _cut(w, target, out, m)[0]


def _cut(w: Tensor, target, out: Tensor | None = None, m: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`cut_to_mass`, and the kept tokens' mass float64 ``[r]``. ``target``: float64 ``[r]``, or a function
    of the rows' exact masses float64 ``[r]`` giving it (the first digit's histogram sums them: no pass of its
    own)."""
    digit, hist, _ = _first_digit(w, m)
    if callable(target):
        target = target(hist.sum(-1))
    crossing, above = _first_crossing(hist, target)
    return _cut_from(w, digit, crossing, above, target, out), above


def _first_digit(w: Tensor, m: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The radix cut's first digit, over the whole matrix: each row's weights binned by bits
    30..17 (64 bins per octave) relative to its largest, 2047 bins over the 32 octaves below
    it and the lowest bin (0) holding everything further below, and a histogram of mass by bin,
    in which :func:`_cross` finds the bin where the prefix mass crosses a target.

    w: float32 ``[r, C]`` in [0, 1]; m: its masses float64, or None (computed). Returns the bins int32 ``[r, C]``
    (a scratch tensor), the histogram of masses float64 ``[r, 2048]`` (its total: each row's exact mass) and the
    bit pattern >> 17 of bin 0, int32 ``[r, 1]``.
    """
    base = (w.amax(-1, keepdim=True).view(torch.int32) >> _RADIX_SHIFT) - (_RADIX_KEYS - 1)
    digit = _keys(w, _RADIX_SHIFT, "digits").sub_(base).clamp_(min=0)
    return digit, _histogram(digit, masses(w, "cut masses") if m is None else m, _RADIX_KEYS), base


def _cut_from(w: Tensor, digit: Tensor, crossing: Tensor, above: Tensor, target: Tensor,
              out: Tensor | None) -> Tensor:
    """:func:`cut_to_mass` after its first digit (:func:`_first_digit` of ``w``); ``above`` (the mass of the bins
    above the crossing one) becomes the kept tokens' mass."""
    # drop the bins below (comparisons into float / int32 scratch: no masked_fill_, no bool
    # temporaries, which are slower); from here on w is the result
    keep = SCRATCH.get("keep", digit.shape, torch.float32, w.device)
    w = torch.mul(w, torch.ge(digit, crossing, out=keep), out=out)
    _, b, col = _positions("eq", digit, crossing)
    _settle(w, b, col, crossing, above, target)
    return w


def _settle_equal(w: Tensor, b: Tensor, col: Tensor, above: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_settle` of the rows whose pending tokens ``w[b, col]`` all weigh the same: in position order (their
    order), each adds the same mass m, so a row keeps the first ``k`` of them, the fewest with ``above + k m``
    reaching ``target`` (none once ``above`` does; all where m is 0 and it does not), and zeroes the rest in place;
    no ordering, whatever their number (every token of a flat row ties); adds the kept ones' mass to ``above``.
    Returns the other rows' pending tokens."""
    r = w.shape[0]
    v = w[b, col]
    low = torch.full((r,), torch.inf, device=w.device).scatter_reduce_(0, b, v, "amin")
    high = torch.full((r,), -torch.inf, device=w.device).scatter_reduce_(0, b, v, "amax")
    equal = (low == high).index_select(0, b)
    if not bool(equal.any()):
        return b, col
    counts = torch.bincount(b, minlength=r)
    m = masses(low.clamp(min=0.0))  # every pending token's mass, in the rows where they are equal
    short = (target - above).clamp(min=0.0)  # exact integers in float64
    k = torch.ceil(short / m.clamp(min=1.0))
    k = k - ((k - 1) * m >= short).double() + (k * m < short).double()  # the division's rounding, corrected
    k = torch.where(m > 0, k, torch.where(short > 0, counts.double(), 0.0))
    rank = torch.arange(b.numel(), device=w.device) - (counts.cumsum(0) - counts).index_select(0, b)
    drop = equal & (rank >= k.index_select(0, b))
    w[b[drop], col[drop]] = 0.0
    above += torch.where(low == high, torch.minimum(k, counts.double()) * m, 0.0)
    return b[~equal], col[~equal]


def _settle(w: Tensor, b: Tensor, col: Tensor, crossing: Tensor, above: Tensor, target: Tensor) -> None:
    """Zeroes, in place, the tokens ``w[b, col]`` of each row's crossing bin of the first digit
    that lie past the cut: they are split by 11 bits at a time (the bits they do not yet
    share), and the few left are ordered by a sort.

    w: float32 ``[r, C]``; b, col: int64 ``[n]``, row-major; crossing: int32 ``[r, 1]``;
    above: float64 ``[r]``, the mass of the tokens above the bin, in place becomes the kept tokens'; target: float64
    ``[r]``.
    """
    r = w.shape[0]
    if b.numel() > r * _RADIX_SORT:  # rows whose pending tokens all weigh the same (a flat row) are cut by count
        b, col = _settle_equal(w, b, col, above, target)
    # the bits the pending tokens of each row share: those above bit 17, but none in bin 0
    shared = torch.where(crossing[:, 0] > 0, _RADIX_SHIFT, 31)
    while b.numel() > r * _RADIX_SORT and bool(shared.any()):
        v = w[b, col]
        shift = (shared - 11).clamp_(min=0)
        digit = (v.view(torch.int32) >> shift[b]) & (_RADIX_KEYS - 1)
        mass = torch.zeros(r * _RADIX_KEYS, dtype=torch.float64, device=w.device).index_add_(
            0, b * _RADIX_KEYS + digit, masses(v))
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
    m = masses(v)
    at, grid = _by_row(b, r, m)
    before = torch.nn.functional.pad(grid.cumsum(-1)[:, :-1], (1, 0)).view(-1)[at]
    drop = above[b] + before >= target[b]
    w[b[drop], col[drop]] = 0.0
    above.index_add_(0, b[~drop], m[~drop])
