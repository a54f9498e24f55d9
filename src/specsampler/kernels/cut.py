"""The end of a row's top-k / top-p prefix, found without sorting the vocabulary (for :mod:`.describe`).

Top-k: the k-th largest logit is at least the k-th largest chunk maximum ``c`` (pass 1 stored them); only the
tokens ``>= c`` of the chunks whose maximum is ``>= c`` are gathered, sorted in registers as packed 64-bit (logit
key, id) pairs and cut by top-p and min-p there (:func:`top_candidates`, :func:`cut_candidates`). A nucleus not
among the most likely tokens, or a top-k past the candidates, is found by a 16-ary search over the logits' order
keys (:func:`select_pivot`). Scratch: ``iscratch_row`` (int64 ``[2 * CAND]``), between ``tl.debug_barrier`` calls.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rows import STAGES, in_prefix, key_value, load_logits, order_key

_INT32_MIN = tl.constexpr(-(2**31))  # below every order key
_INT32_MAX = tl.constexpr(2**31 - 1)
_LAST = tl.constexpr(2**63 - 1)  # a sort's padding: after every entry (sorts are ascending)
_NO_CAND = tl.constexpr((2**31 - 1) << 32)  # a kept-token slot without a token (id order): id 2**31 - 1, weight 0
_WIDE_KEYS = tl.constexpr(1 << 24)  # a key range over more than two binades: pivots go by value


@triton.jit
def append_candidates(iscratch_row, n, sel, key, ids, CAND: tl.constexpr):
    """Append the selected entries of a 2-D tile to the candidate list at ``iscratch_row[n:CAND]`` as
    int64 ``~(key << 32 | (2**31 - 1 - id))``, smaller = earlier in order (the low word is computed as
    ``id ^ (2**31 - 1)``; the complement makes the order ascending, the one direction the sorts have);
    returns the new count (which may exceed CAND: entries past it are dropped)."""
    s = sel.to(tl.int32)
    per_row = tl.sum(s, axis=1)
    pos = n + (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(s, axis=1) - 1
    packed = (key.to(tl.int64) << 32) | (ids ^ _INT32_MAX).to(tl.int64)
    tl.store(iscratch_row + pos, ~packed, mask=sel & (pos < CAND))
    return n + tl.sum(per_row, axis=0)


@triton.jit(noinline=True)
def _sort_in_place(iscratch_row, n, SIZE: tl.constexpr):
    """Sort ``iscratch_row[:n]`` (int64, ``n <= SIZE``) in place, ascending, in registers of ``SIZE`` slots.
    Not inlined: one copy of each size serves every caller, which keeps the kernels' compile time in
    seconds (a sort is the largest code in them), for a call per sort."""
    j = tl.arange(0, SIZE)
    v = tl.sort(tl.load(iscratch_row + j, mask=j < n, other=_LAST))
    tl.debug_barrier()  # every thread has loaded before any stores
    tl.store(iscratch_row + j, v, mask=j < n)


@triton.jit
def sorted_prefix(iscratch_row, n, pad, CAND: tl.constexpr):
    """``iscratch_row[:n]`` (int64, ``n <= CAND``, stored before a barrier) sorted ascending, then ``pad``:
    ``[CAND]``; rewrites ``iscratch_row[:n]``. Sorted in ``CAND / 4`` or ``CAND / 2`` slots when ``n`` fits,
    then read back at full size: a sort's steps and barriers grow with its size (sm_90, 8 warps, loading,
    sorting and storing 64 int64: 248 instructions, 2 barriers; 256: 456 and 17), and a top-k of 50 or its
    kept tokens nearly always fit in 64."""
    if n <= CAND // 4:
        _sort_in_place(iscratch_row, n, CAND // 4)
    elif n <= CAND // 2:
        _sort_in_place(iscratch_row, n, CAND // 2)
    else:
        _sort_in_place(iscratch_row, n, CAND)
    tl.debug_barrier()
    j = tl.arange(0, CAND)
    return tl.load(iscratch_row + j, mask=j < n, other=pad)


@triton.jit
def sorted_candidates(iscratch_row, n, CAND: tl.constexpr):
    """The first ``n`` candidates of :func:`append_candidates`, sorted in order (logit desc, id asc), then
    empty slots (id 2**31 - 1); unpacked: (ids int32, logits float32) ``[CAND]``."""
    packed = ~sorted_prefix(iscratch_row, n, _LAST, CAND)
    ids = (packed & _INT32_MAX).to(tl.int32) ^ _INT32_MAX
    return ids, key_value((packed >> 32).to(tl.int32))


@triton.jit(noinline=True)
def top_candidates(logits_row, mask_row, V, k, fscratch_row, iscratch_row, HAS_MASK: tl.constexpr,
                   CHUNK: tl.constexpr, NCH_P2: tl.constexpr, GROUP: tl.constexpr, CAND: tl.constexpr):
    """Gather the k most likely tokens (and the next ones down to a bound) using pass 1's chunk maxima.

    Returns (c_key, n, ok): every token with order key >= c_key is gathered into the candidate list
    (n of them), and the k-th largest logit is >= c_key, so the candidates are the n most likely
    tokens. ok: the list holds them all (n <= CAND).
    """
    n_chunks = tl.cdiv(V, CHUNK)
    c = tl.arange(0, NCH_P2)
    valid = c < n_chunks
    ck = tl.where(valid, order_key(tl.load(fscratch_row + c, mask=valid, other=float("-inf"))), _INT32_MIN)
    # bisection for a bound lo at or below the k-th largest chunk maximum; invariant: n_lo = #chunks with
    # key >= lo >= k (or lo is the minimum), and the k-th largest is <= hi. Stops once at most `enough` chunks
    # are >= lo: k, or up to a gather step's GROUP while that is a sixteenth of the row's chunks at most (the
    # bound then stays in the row's top tail, so about as few tokens reach it; half the steps at k=50)
    lo = tl.min(ck, axis=0).to(tl.int64)
    hi = tl.max(ck, axis=0).to(tl.int64)
    n_lo = n_chunks
    enough = tl.maximum(k, tl.minimum(GROUP, n_chunks // 16))
    while (lo < hi) & (n_lo > enough):
        mid = lo + (hi - lo + 1) // 2
        n_mid = tl.sum((ck >= mid).to(tl.int32), axis=0)
        up = n_mid >= k
        lo = tl.where(up, mid, lo)
        n_lo = tl.where(up, n_mid, n_lo)
        hi = tl.where(up, hi, mid - 1)
    flagged = valid & (ck >= lo)
    n_flagged = tl.sum(flagged.to(tl.int32), axis=0)
    # k flagged chunks each hold a token >= their smallest maximum: the k-th largest logit is >= it
    c_key = tl.where(n_flagged >= k, tl.min(tl.where(flagged, ck, _INT32_MAX), axis=0), _INT32_MIN)
    pos = tl.cumsum(flagged.to(tl.int32), axis=0) - 1
    tl.store(iscratch_row + CAND + pos, c.to(tl.int64), mask=flagged & (pos < CAND))
    tl.debug_barrier()
    n_read = tl.where(n_flagged <= CAND, n_flagged, 0)  # too many chunks: the caller falls back
    g = tl.arange(0, GROUP)
    n = 0
    for start in range(0, n_read, GROUP):
        cid = tl.load(iscratch_row + CAND + start + g, mask=start + g < n_read, other=n_chunks).to(tl.int32)
        ids = cid[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        x = load_logits(logits_row, mask_row, ids, V, HAS_MASK)
        n = append_candidates(iscratch_row, n, (ids < V) & (order_key(x) >= c_key), order_key(x), ids, CAND)
    tl.debug_barrier()
    return c_key, n, (n_flagged <= CAND) & (n <= CAND)


@triton.jit
def pack_kept(ids, w):
    """Kept tokens as int64 ``id << 32 | weight's float32 bits`` (weights are non-negative: below 2**31), in id
    order when sorted: how :func:`cut_candidates` sorts them and :func:`specsampler.kernels.describe.describe_row`
    stores them."""
    return (ids.to(tl.int64) << 32) | w.to(tl.int32, bitcast=True).to(tl.int64)


@triton.jit
def unpack_kept(packed):
    """The (ids int32, weights float32) of :func:`pack_kept`."""
    return (packed >> 32).to(tl.int32), (packed & _INT32_MAX).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def cut_candidates(ids, x, limit, m, inv_t, own_mass, top_p, w_min, z_all, iscratch_row, CAND: tl.constexpr):
    """Top-p and min-p among the first ``limit`` candidates (in order): the top-k set, or (top-p alone)
    the most likely tokens. The top-p target is ``top_p`` times their own mass if ``own_mass``, else
    times ``z_all``, the row's mass. The kept tokens are sorted by id in ``iscratch_row`` (rewritten).

    Returns (reached, tau, id_cut, z, cand_ids, cand_w): reached = the prefix reaching the target lies
    among the candidates (always with own_mass or top_p >= 1); the kept tokens in id order.
    """
    j = tl.arange(0, CAND)
    live = j < limit
    w = tl.where(live, tl.exp((x - m) * inv_t), 0.0)
    cum = tl.cumsum(w, axis=0)
    mass = tl.sum(tl.where(j == limit - 1, cum, 0.0), axis=0)
    target = top_p * tl.where(own_mass, mass, z_all)
    # keep candidate j iff the mass strictly before it is < target: j <= #(cum < target)
    last = tl.where(top_p < 1.0, tl.minimum(tl.sum((live & (cum < target)).to(tl.int32), axis=0), limit - 1),
                    limit - 1)
    keep = (j <= last) & (w >= w_min)
    kept_w = tl.where(keep, w, 0.0)
    tau = tl.sum(tl.where(j == last, x, 0.0), axis=0)
    id_cut = tl.sum(tl.where(j == last, ids, 0), axis=0)
    # the kept tokens in id order, sorted from the start of the scratch (a NaN logit, first in order, is not
    # kept: the kept ones are packed there)
    packed = pack_kept(ids, kept_w)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # the candidates have been read
    tl.store(iscratch_row + pos, packed, mask=keep)
    tl.debug_barrier()
    cand_ids, cand_w = unpack_kept(sorted_prefix(iscratch_row, tl.sum(keep.to(tl.int32), axis=0), _NO_CAND, CAND))
    reached = (top_p >= 1.0) | (mass >= target)
    return reached, tau, id_cut, tl.sum(kept_w, axis=0), cand_ids, cand_w


# ----------------------------------------------------------------------------- search for a pivot


@triton.jit
def _contribution(x, ids, m, inv_t, by_count, tau0, id0):
    """Each token's contribution to a prefix's size: 1 (by_count) or its weight, inside the prefix
    (tau0, id0), else 0."""
    w = tl.where(by_count, 1.0, tl.exp((x - m) * inv_t))
    return tl.where(in_prefix(x, ids, tau0, id0), w, 0.0)


@triton.jit
def _above_pivots(logits_row, mask_row, V, m, inv_t, by_count, tau0, id0, pivots,
                  HAS_MASK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """One pass: for each pivot key, the contribution and the number of prefix tokens with key >= it.

    Summed per token slot of the block and across the slots once, after the pass: an iteration then needs no
    exchange between warps (two reductions of NPIV values per block made the pass issue-bound, several times
    slower than the row's read); keys are compared as int32 (the pivots lie between two keys)."""
    piv = pivots.to(tl.int32)[:, None]
    s = tl.zeros([NPIV, SEARCH_BLOCK], tl.float32)  # pivots first: each thread compares its tokens with all
    cnt = tl.zeros([NPIV, SEARCH_BLOCK], tl.int32)
    for start in tl.range(0, V, SEARCH_BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, SEARCH_BLOCK)
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        w = tl.where(by_count, 1.0, tl.exp((x - m) * inv_t))
        # a token outside the prefix (or past the row) takes the least key, below every pivot (each above the
        # search's lower bound, itself a key): it adds to no sum, with no test per pivot
        key = tl.where(in_prefix(x, offs, tau0, id0) & (offs < V), order_key(x), _INT32_MIN)
        above = key[None, :] >= piv
        s += tl.where(above, w[None, :], 0.0)
        cnt += above.to(tl.int32)
    return tl.sum(s, axis=1), tl.sum(cnt, axis=1)


@triton.jit
def _tie_cut(logits_row, mask_row, V, m, inv_t, by_count, target, s_hi, tau, tau0, id0,
             HAS_MASK: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """The id of the first token (in id order) at exactly ``tau`` in the prefix (tau0, id0) where
    ``s_hi`` plus the ties' running contribution reaches ``target``; V if none does (all ties kept)."""
    carry = s_hi
    id_cut = V
    start = 0
    while (start < V) & (id_cut == V):
        offs = start + tl.arange(0, SEARCH_BLOCK)
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        tie = (x == tau) & (offs < V)
        c = tl.where(tie, _contribution(x, offs, m, inv_t, by_count, tau0, id0), 0.0)
        tie = tie & in_prefix(x, offs, tau0, id0)
        cum = carry + tl.cumsum(c, axis=0)
        id_cut = tl.min(tl.where(tie & (cum >= target), offs, V), axis=0)
        carry += tl.sum(c, axis=0)
        start += SEARCH_BLOCK
    return id_cut


@triton.jit(noinline=True)
def select_pivot(logits_row, mask_row, V, m, inv_t, by_count, target, tau0, id0, lo, hi, iscratch_row,
                 HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, CAND: tl.constexpr,
                 SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """The end (tau, id_cut) of the smallest prefix of the order, within the prefix (tau0, id0), whose
    contribution (tokens if ``by_count``, else weights) reaches ``target``; several passes.

    lo, hi: int64 order keys with: the tokens with key >= lo contribute >= target, and the end's key
    is <= hi. (When rounding breaks the first, the whole prefix (tau0, id0) above lo is kept.)
    """
    # invariant: S(lo) >= target > S(hi + 1) = s_hi, S(k) = contribution of the tokens with key >= k;
    # the end's key is in [lo, hi]; n_lo, n_hi: the numbers of tokens with key >= lo, > hi.
    s_hi = 0.0
    n_hi = 0
    n_lo = _INT32_MAX  # unknown until a pivot reaches the target
    lo = tl.minimum(lo, hi)
    j = tl.arange(0, NPIV) + 1
    while (hi > lo) & (n_lo - n_hi > CAND):
        pivots = lo + ((hi - lo) * j + NPIV - 1) // NPIV  # in (lo, hi], the last one = hi
        # a range over several binades (or across 0) in even steps of value: even steps of key would spend
        # most pivots on the many binades of small values, about a pass more on a wide nucleus
        v_lo = key_value(lo)
        v_hi = key_value(hi)
        by_value = (hi - lo > _WIDE_KEYS) & (v_lo > float("-inf")) & (v_hi < float("inf"))
        v_lo = tl.where(by_value, v_lo, 0.0)
        step = tl.where(by_value, v_hi, 0.0) / NPIV - v_lo / NPIV  # no overflow
        by_value_pivots = tl.minimum(tl.maximum(order_key(v_lo + step * j.to(tl.float32)).to(tl.int64), lo + 1), hi)
        pivots = tl.where(by_value & (j < NPIV), by_value_pivots, pivots)
        s, cnt = _above_pivots(logits_row, mask_row, V, m, inv_t, by_count, tau0, id0, pivots,
                               HAS_MASK, SEARCH_BLOCK, NPIV)
        reach = s >= target
        lo = tl.max(tl.where(reach, pivots, lo), axis=0)
        n_lo = tl.min(tl.where(reach, cnt, n_lo), axis=0)
        s_hi = tl.max(tl.where(reach, s_hi, s), axis=0)  # S at the smallest pivot short of the target
        n_hi = tl.max(tl.where(reach, n_hi, cnt), axis=0)
        hi = tl.min(tl.where(reach, hi, pivots - 1), axis=0)
    tau = key_value(lo)
    id_cut = V
    if n_lo - n_hi <= CAND:
        # the undecided tokens (key in [lo, hi]) fit in registers: gather, sort, cut
        local = tl.arange(0, BLOCK_CHUNKS)
        tile = local[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        n = 0
        tl.debug_barrier()  # earlier candidates may still be read
        for start in tl.range(0, V, BLOCK_CHUNKS * CHUNK, num_stages=STAGES):
            offs = start + tile
            x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
            key = order_key(x)
            sel = (offs < V) & in_prefix(x, offs, tau0, id0) & (key >= lo) & (key <= hi)
            n = append_candidates(iscratch_row, n, sel, key, offs, CAND)
        tl.debug_barrier()
        ids, x = sorted_candidates(iscratch_row, n, CAND)
        jc = tl.arange(0, CAND)
        c = tl.where(jc < n, _contribution(x, ids, m, inv_t, by_count, tau0, id0), 0.0)
        cum = s_hi + tl.cumsum(c, axis=0)
        last = tl.maximum(tl.minimum(tl.sum(((jc < n) & (cum < target)).to(tl.int32), axis=0), n - 1), 0)
        tau = tl.sum(tl.where(jc == last, x, 0.0), axis=0)
        id_cut = tl.sum(tl.where(jc == last, ids, 0), axis=0)
    else:
        # lo == hi: more than CAND tokens tie at the end's logit; cut the ties in id order
        id_cut = _tie_cut(logits_row, mask_row, V, m, inv_t, by_count, target, s_hi, tau, tau0, id0,
                          HAS_MASK, SEARCH_BLOCK)
    return tau, id_cut


