"""Chain verification: one Triton program per request walks its draft chain.

One kernel serves :func:`specsampler.verify.chain.verify_chain` (target rows are probabilities) and
:func:`specsampler.verify.chain.verify_chain_from_logits` (``FROM_LOGITS``: each row of logits is processed by its
parameters on the way, through its descriptor, :mod:`specsampler.kernels.describe`); each method's walk is a helper
that reads beside its branch of the reference's ``_verify``, and reads no row past the position where its request
stops. On a GPU every row is first described in a row-parallel kernel (``DESCRIBED``). Draws are by
inversion as :func:`specsampler.sampling.masses.sample_by_inversion`, sums taken block by block in float32 (a
token can differ from the reference's only where rounding decides), without fused multiply-add.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    ACCEPT,
    NO_LOGIT_ROWS,
    SAMPLE,
    TINY,
    LogitRows,
    Randomness,
    RowConfig,
    Strided,
    aligned_rows,
    argmax,
    block_size,
    check_randomness,
    choose,
    describe,
    draw_from,
    fixed_types,
    last_dim_contiguous,
    logit_rows,
    mask_row,
    randomness,
    request_keys,
    row_ptr,
    scratch_rows,
    strides,
    uniform,
)
from .describe import describe_row_in_parts, unpack_candidates
from .rows import (
    STAGES,
    first_pass,
    kept_weights,
    launch_options,
    load_logits,
    multiprocessors,
    row_config,
    row_stride,
    scan_parts,
    scan_row,
    token_weight,
)

METHODS = {"token": 0, "block": 1, "target_only": 2, "greedy": 3}  # the kernel's METHOD


class Descriptors(NamedTuple):
    """In the chain kernel: every row's descriptor, as :func:`_describe_rows_kernel` stores them (``DESCRIBED``):
    row ``r``'s ``m, inv_t, tau, w_min, z`` at ``floats[r]`` (float32 ``[R, 5]``), ``id_cut, in_regs`` at ``ints[r]``
    (int32 ``[R, 2]``; a greedy row's argmax alone at ``ints[r, 0]``), its kept tokens at ``cands[r]`` (int64
    ``[R, CAND]``, :func:`specsampler.kernels.describe.unpack_candidates`)."""

    floats: object
    ints: object
    cands: object


# the kernel arguments of the Descriptors of a chain kernel that describes its rows itself
NO_DESCRIPTORS = dict(desc_floats_ptr=None, desc_ints_ptr=None, cands_ptr=None)


@triton.jit
def _prob_weights(target_row, draft_row, offs, end, a, use_q, HAS_Q: tl.constexpr):
    """Probabilities: ``max(a * p - q, 0)`` at ``offs``, 0 from ``end`` on (not read); ``q`` is read only when
    ``use_q``. (Scalar conditions enter masks through ``end``, not ``&``: the interpreter mistypes broadcast
    scalar bools.)"""
    p = tl.load(target_row + offs, mask=offs < end, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(draft_row + offs, mask=offs < tl.where(use_q, end, 0), other=0.0).to(tl.float32)
        return tl.maximum(a * p - q, 0.0)
    else:
        return tl.maximum(a * p, 0.0)


@triton.jit
def _prob_scan(target_row, draft_row, a, use_q, x, V, HAS_Q: tl.constexpr, WITH_X: tl.constexpr,
               BLOCK_V: tl.constexpr):
    """One pass over the weights of a row of probabilities (:func:`_prob_weights`).

    Returns ``(total, last, below_x, cum_x, pos_x)``: ``total`` is their sum, accumulated block by
    block as :func:`_prob_search` accumulates it; ``last`` the last id of positive weight (0 if none).
    With ``WITH_X`` also what decides, once ``t = u * total`` is known, whether :func:`_prob_search`
    at ``t`` returns ``x`` (computed from the same cumulative sums): ``below_x``, the largest
    cumulative weight at a positive id before ``x`` (-1 if none), ``cum_x``, the cumulative
    weight at ``x``, and ``pos_x``, whether ``x`` has positive weight.
    """
    total = tl.full((), 0.0, tl.float32)
    last = tl.full((), 0, tl.int32)
    below_x = tl.full((), -1.0, tl.float32)
    cum_x = tl.full((), 0.0, tl.float32)
    pos_x = tl.full((), 0, tl.int1)
    for start in tl.range(0, V, BLOCK_V, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK_V)
        w = _prob_weights(target_row, draft_row, offs, V, a, use_q, HAS_Q)
        pos = w > 0
        last = tl.maximum(last, tl.max(tl.where(pos, offs, 0), 0))
        if WITH_X:
            cum = total + tl.cumsum(w, 0)
            below_x = tl.maximum(below_x, tl.max(tl.where(pos & (offs < x), cum, -1.0), 0))
            cum_x += tl.sum(tl.where(offs == x, cum, 0.0), 0)
            pos_x = pos_x | (tl.max(tl.where(pos & (offs == x), 1, 0), 0) > 0)
        total += tl.sum(w, 0)
    return total, last, below_x, cum_x, pos_x


@triton.jit
def _prob_search(target_row, draft_row, a, use_q, V, t, last, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """The first id of positive weight whose cumulative weight exceeds ``t``, else ``last``.
    Blocks after the one holding the token are not read."""
    total = tl.full((), 0.0, tl.float32)
    found = tl.full((), 0, tl.int1)
    y = last
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = _prob_weights(target_row, draft_row, offs, tl.where(found, 0, V), a, use_q, HAS_Q)
        first = tl.min(tl.where((w > 0) & (total + tl.cumsum(w, 0) > t), offs, V), 0)
        y = tl.where(found | (first == V), y, first)
        found = found | (first < V)
        total += tl.sum(w, 0)
    return y


@triton.jit
def _logit_weights_in_regs(d, draft_row, a, use_q, V):
    """Logits whose kept tokens are in registers: ``max(a * p - q, 0)`` at them (``p`` when not ``use_q`` and
    ``a = 1``); elsewhere it is 0, as ``p`` is. ``q`` is read only when ``use_q``."""
    _, _, _, _, _, z, _, cand_ids, cand_w = d
    p = cand_w / tl.maximum(z, TINY)
    inside = cand_ids < V
    q = tl.load(draft_row + tl.where(inside, cand_ids, 0), mask=inside & (cand_ids < tl.where(use_q, V, 0)),
                other=0.0)
    return tl.maximum(a * p - q.to(tl.float32), 0.0)


@triton.jit
def _logit_weights(target_row, mask_row, draft_row, offs, V, d, a, use_q, HAS_MASK: tl.constexpr):
    """:func:`_logit_weights_in_regs` at ``offs`` (a block of a whole row of logits; 0 from V on)."""
    m, inv_t, tau, id_cut, w_min, z, _, _, _ = d
    x = load_logits(target_row, mask_row, offs, V, HAS_MASK)
    p = kept_weights(x, offs, m, inv_t, tau, id_cut, w_min) / tl.maximum(z, TINY)
    q = tl.load(draft_row + offs, mask=offs < tl.where(use_q, V, 0), other=0.0).to(tl.float32)
    return tl.maximum(a * p - q, 0.0)


@triton.jit
def _position(target, draft_probs, rows, b, i, FROM_LOGITS: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_Q: tl.constexpr):
    """Position ``i`` of request ``b``: its target row, mask row (the target row where there is none) and
    draft row (the target row without ``HAS_Q``)."""
    target_row = row_ptr(target, b, i)
    vocab_mask_row = mask_row(rows, target_row, b, i, HAS_MASK) if FROM_LOGITS else target_row
    draft_row = row_ptr(draft_probs, b, i) if HAS_Q else target_row
    return target_row, vocab_mask_row, draft_row


@triton.jit
def _no_descriptor(FROM_LOGITS: tl.constexpr, ROWS: tl.constexpr):
    """The descriptor a walk starts from, before it describes a row (a scalar stand-in for probabilities)."""
    d = tl.full((), 0, tl.int32)
    if FROM_LOGITS:
        # tl.full, not tl.zeros: Triton 3.6's tl.zeros takes no plain int (a RowConfig field) as a size
        d = fixed_types(0.0, 1.0, float("-inf"), 0, 0.0, 0.0, 0, tl.full([ROWS.CAND], 0, tl.int32),
                        tl.full([ROWS.CAND], 0.0, tl.float32))
    return d


@triton.jit
def _descriptor(at, rows, described, b, r, V, FROM_LOGITS: tl.constexpr, DESCRIBED: tl.constexpr,
                HAS_MASK: tl.constexpr, ROWS: tl.constexpr):
    """The descriptor of the row at ``at`` (:func:`_position`), whose parameters are at index ``r``:
    described here (in request ``b``'s scratch), or loaded where :func:`_describe_rows_kernel` stored it
    (``DESCRIBED``); for probabilities :func:`_no_descriptor`'s."""
    d = _no_descriptor(FROM_LOGITS, ROWS)
    if FROM_LOGITS:
        if DESCRIBED:
            f = described.floats + 5 * r
            i = described.ints + 2 * r
            cand_ids, cand_w = unpack_candidates(described.cands + r * ROWS.CAND, ROWS.CAND)
            d = (tl.load(f), tl.load(f + 1), tl.load(f + 2), tl.load(i), tl.load(f + 3), tl.load(f + 4),
                 tl.load(i + 1), cand_ids, cand_w)
        else:
            target_row, vocab_mask_row, _ = at
            fscratch_row, iscratch_row = scratch_rows(rows, b, ROWS)
            d = describe(rows, r, target_row, vocab_mask_row, V, fscratch_row, iscratch_row, HAS_MASK, ROWS)
    return d


@triton.jit
def _prob_at(at, d, x, V, FROM_LOGITS: tl.constexpr, HAS_MASK: tl.constexpr):
    """The target probability of token ``x`` (an int32 scalar, -1 = none: 0) in the row at ``at``."""
    target_row, vocab_mask_row, _ = at
    if FROM_LOGITS:
        m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w = d
        w = tl.full((), 0.0, tl.float32)
        if in_regs != 0:
            w = tl.sum(tl.where(cand_ids == x, cand_w, 0.0), axis=0)
        else:
            w = token_weight(target_row, vocab_mask_row, V, x, m, inv_t, tau, id_cut, w_min, HAS_MASK)
        p = w / tl.maximum(z, TINY)
    else:
        p = tl.load(target_row + x, mask=x >= 0, other=0.0).to(tl.float32)
    return p


@triton.jit
def _residual_mass(at, d, a, use_q, V, FROM_LOGITS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Mass of ``max(a * p - q, 0)`` (of ``p`` when not ``use_q`` and ``a = 1``) in the row at ``at``, and the
    last id of positive weight (0 if none): one pass over the row, block by block as :func:`_residual_draw`
    accumulates it, or from the registers (kept tokens of logits)."""
    target_row, vocab_mask_row, draft_row = at
    total = tl.full((), 0.0, tl.float32)
    last = tl.full((), 0, tl.int32)
    if FROM_LOGITS:
        _, _, _, _, _, _, in_regs, cand_ids, _ = d
        if in_regs != 0:
            w = _logit_weights_in_regs(d, draft_row, a, use_q, V)
            total = tl.sum(w, axis=0)
            last = tl.max(tl.where(w > 0, cand_ids, 0), axis=0)
        else:
            for start in tl.range(0, V, BLOCK_V, num_stages=STAGES):
                offs = start + tl.arange(0, BLOCK_V)
                w = _logit_weights(target_row, vocab_mask_row, draft_row, offs, V, d, a, use_q, HAS_MASK)
                last = tl.maximum(last, tl.max(tl.where(w > 0, offs, 0), axis=0))
                total += tl.sum(w, axis=0)
    else:
        total, last, _, _, _ = _prob_scan(target_row, draft_row, a, use_q, -1, V, True, False, BLOCK_V)
    return total, last


@triton.jit
def _residual_draw(at, d, t, last, a, use_q, V, FROM_LOGITS: tl.constexpr, HAS_MASK: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """The first id of positive weight whose cumulative weight (of :func:`_residual_mass`'s weights) exceeds
    ``t``, else ``last``. Blocks after the one holding the token are not read."""
    target_row, vocab_mask_row, draft_row = at
    y = last
    if FROM_LOGITS:
        _, _, _, _, _, _, in_regs, cand_ids, _ = d
        if in_regs != 0:  # candidates in increasing id order: the smallest id past t is the first
            w = _logit_weights_in_regs(d, draft_row, a, use_q, V)
            first = tl.min(tl.where((w > 0) & (tl.cumsum(w, axis=0) > t), cand_ids, V), axis=0)
            y = tl.where(first < V, first, last)
        else:
            total = tl.full((), 0.0, tl.float32)
            found = tl.full((), 0, tl.int1)
            start = 0
            while (start < V) & (found == 0):
                offs = start + tl.arange(0, BLOCK_V)
                w = _logit_weights(target_row, vocab_mask_row, draft_row, offs, V, d, a, use_q, HAS_MASK)
                first = tl.min(tl.where((w > 0) & (total + tl.cumsum(w, axis=0) > t), offs, V), axis=0)
                found = first < V
                y = tl.where(found, first, y)
                total += tl.sum(w, axis=0)
                start += BLOCK_V
    else:
        y = _prob_search(target_row, draft_row, a, use_q, V, t, last, True, BLOCK_V)
    return y


@triton.jit
def _draft(draft_tokens_row, i, kb, V):
    """Draft ``i`` as an int32 id when ``i < kb`` and it lies in ``[0, V)``, else -1 (never accepted)."""
    x = tl.load(draft_tokens_row + i, mask=i < kb, other=-1)
    return tl.where((x >= 0) & (x < V), x, -1).to(tl.int32)


@triton.jit
def _ratio(num, den):
    """``min(1, num / den)`` with ``num <= 0 -> 0`` (as :func:`specsampler.verify.chain._ratio`)."""
    return tl.where(num > 0, tl.where(num >= den, 1.0, num / tl.where(num >= den, 1.0, den)), 0.0)


@triton.jit
def _token_walk(target, draft_probs, draft_tokens_row, kb, randomness, req, rows, described, K, V,
                FROM_LOGITS: tl.constexpr, DESCRIBED: tl.constexpr, HAS_MASK: tl.constexpr,
                BLOCK_V: tl.constexpr, ROWS: tl.constexpr):
    """``token``: accept draft n while ``u_n * q_n(x_n) < p_n(x_n)`` (``u_n``: ``STREAM_ACCEPT`` index n + 1),
    then draw from the residual ``max(p_n - q_n, 0)`` (``p_n`` when it has no mass, or after the last draft).
    Returns ``(n, y)``."""
    b = req[0]
    n = tl.full((), 0, tl.int32)
    d = _no_descriptor(FROM_LOGITS, ROWS)
    go = n >= 0
    while go:
        at = _position(target, draft_probs, rows, b, n, FROM_LOGITS, HAS_MASK, True)
        d = _descriptor(at, rows, described, b, b * (K + 1) + n, V, FROM_LOGITS, DESCRIBED, HAS_MASK, ROWS)
        accept = n < 0
        if n < kb:
            x = _draft(draft_tokens_row, n, kb, V)
            p_x = _prob_at(at, d, x, V, FROM_LOGITS, HAS_MASK)
            q_x = tl.load(at[2] + x, mask=x >= 0, other=0.0).to(tl.float32)
            # p(x) = 0: never, whatever q(x) says (a negative one passes the comparison)
            accept = (x >= 0) & (uniform(randomness, req, n + 1, ACCEPT) * q_x < p_x) & (p_x > 0.0)
        n += accept.to(tl.int32)
        go = accept
    at = _position(target, draft_probs, rows, b, n, FROM_LOGITS, HAS_MASK, True)
    use_q = n < kb
    total, last = _residual_mass(at, d, 1.0, use_q, V, FROM_LOGITS, HAS_MASK, BLOCK_V)
    if use_q & ~(total > 0.0):  # a residual without mass: draw from p itself
        use_q = n < 0
        total, last = _residual_mass(at, d, 1.0, use_q, V, FROM_LOGITS, HAS_MASK, BLOCK_V)
    t = uniform(randomness, req, n, SAMPLE) * total
    return n, _residual_draw(at, d, t, last, 1.0, use_q, V, FROM_LOGITS, HAS_MASK, BLOCK_V)


@triton.jit
def _block_walk(target, draft_probs, draft_tokens_row, kb, randomness, req, rows, described, K, V,
                FROM_LOGITS: tl.constexpr, DESCRIBED: tl.constexpr, HAS_MASK: tl.constexpr,
                BLOCK_V: tl.constexpr, ROWS: tl.constexpr):
    """``block``: ``a_i`` and ``h_i = S_i / (S_i + 1 - a_i)`` forward while ``a_i > 0`` (``S_i``: the mass of
    ``w_i = max(a_i p_i - q_i, 0)``); ``tau`` = the last i with ``eta_i < h_i`` (``STREAM_ACCEPT`` index i;
    ``h_0 = 1``, ``h_kb = a_kb``); then draw from ``w_tau`` (``p_tau`` at kb, or when it has no mass), keeping
    row tau's descriptor on the way. Returns ``(tau, y)``."""
    b = req[0]
    a = tl.full((), 1.0, tl.float32)  # a_i at the loop's position i
    a_tau = tl.full((), 1.0, tl.float32)
    s_tau = tl.full((), 0.0, tl.float32)  # S_tau and the last id of w_tau's support, for tau > 0
    last_tau = tl.full((), 0, tl.int32)
    tau = tl.full((), 0, tl.int32)
    d_tau = _no_descriptor(FROM_LOGITS, ROWS)
    i = tl.full((), 0, tl.int32)
    go = i < kb
    while go:
        at = _position(target, draft_probs, rows, b, i, FROM_LOGITS, HAS_MASK, True)
        d = _descriptor(at, rows, described, b, b * (K + 1) + i, V, FROM_LOGITS, DESCRIBED, HAS_MASK, ROWS)
        take = i == 0  # h_0 = 1
        if i > 0:
            s, last = _residual_mass(at, d, a, i >= 0, V, FROM_LOGITS, HAS_MASK, BLOCK_V)
            h = tl.where(s > 0, s / tl.where(s > 0, s + 1 - a, 1.0), 0.0)
            take = uniform(randomness, req, i, ACCEPT) < h
            s_tau = tl.where(take, s, s_tau)
            last_tau = tl.where(take, last, last_tau)
        tau = tl.where(take, i, tau)
        a_tau = tl.where(take, a, a_tau)
        if FROM_LOGITS:
            d_tau = choose(take, d, d_tau)
        x = _draft(draft_tokens_row, i, kb, V)
        p_x = _prob_at(at, d, x, V, FROM_LOGITS, HAS_MASK)
        q_x = tl.load(at[2] + x, mask=x >= 0, other=0.0).to(tl.float32)
        a = tl.where(x >= 0, _ratio(a * p_x, q_x), 0.0)
        i += 1
        go = (i < kb) & (a > 0)
    # h at position kb is a_kb (h_0 = 1 when kb = 0); a stop before kb left a = 0 there
    if (i == kb) & ((uniform(randomness, req, kb, ACCEPT) < a) | (kb == 0)):
        tau = kb
        at = _position(target, draft_probs, rows, b, kb, FROM_LOGITS, HAS_MASK, True)
        d_tau = _descriptor(at, rows, described, b, b * (K + 1) + kb, V, FROM_LOGITS, DESCRIBED, HAS_MASK, ROWS)
    at = _position(target, draft_probs, rows, b, tau, FROM_LOGITS, HAS_MASK, True)
    use_q = tau < kb
    a_w = tl.where(use_q, a_tau, 1.0)
    total = s_tau
    last = last_tau
    if (tau == 0) | (tau == kb):  # S_0 is not needed for h_0 = 1, the bonus row has none: found only now
        total, last = _residual_mass(at, d_tau, a_w, use_q, V, FROM_LOGITS, HAS_MASK, BLOCK_V)
    if use_q & ~(total > 0.0):  # a residual without mass: draw from p_tau
        use_q = tau < 0
        a_w = 1.0
        total, last = _residual_mass(at, d_tau, a_w, use_q, V, FROM_LOGITS, HAS_MASK, BLOCK_V)
    t = uniform(randomness, req, tau, SAMPLE) * total
    return tau, _residual_draw(at, d_tau, t, last, a_w, use_q, V, FROM_LOGITS, HAS_MASK, BLOCK_V)


@triton.jit
def _target_only_walk(target, draft_tokens_row, kb, randomness, req, rows, described, K, V,
                      FROM_LOGITS: tl.constexpr, DESCRIBED: tl.constexpr, HAS_MASK: tl.constexpr,
                      BLOCK_V: tl.constexpr, ROWS: tl.constexpr):
    """``target_only``: draw ``y_n ~ p_n`` (``STREAM_SAMPLE`` index n) while it equals draft n. From logits the
    draw of :func:`specsampler.kernels.describe.draw` (that of ``sample_from_logits``, token for token); from
    probabilities one pass per row decides whether the draw is the draft (so an accepted row is read once),
    and the search pass runs at the first mismatch only. Returns ``(n, y)``."""
    b = req[0]
    n = tl.full((), 0, tl.int32)
    y = tl.full((), 0, tl.int32)
    go = n >= 0
    while go:
        at = _position(target, target, rows, b, n, FROM_LOGITS, HAS_MASK, False)
        x = _draft(draft_tokens_row, n, kb, V)
        u = uniform(randomness, req, n, SAMPLE)
        accept = n < 0
        if FROM_LOGITS:
            r = b * (K + 1) + n
            d = _descriptor(at, rows, described, b, r, V, FROM_LOGITS, DESCRIBED, HAS_MASK, ROWS)
            fscratch_row, _ = scratch_rows(rows, r if DESCRIBED else b, ROWS)  # where the chunk masses are
            drawn, w_y = draw_from(u, d, at[0], at[1], V, fscratch_row, HAS_MASK, ROWS)
            y = drawn.to(tl.int32)
            accept = (y == x) & (w_y > 0.0)  # a row without mass draws 0, of target probability 0
        else:
            total, last, below_x, cum_x, pos_x = _prob_scan(at[0], at[0], 1.0, n < 0, x, V, False, True, BLOCK_V)
            t = u * total
            # _prob_search at t gives the first positive id past t, else `last`: it is x when x is positive,
            # no earlier positive id is past t, and x is past t or the last (a row without mass draws 0, of target
            # probability 0: never the draft)
            drawn_x = (below_x <= t) & pos_x & ((cum_x > t) | (x == last))
            accept = (x >= 0) & drawn_x
            if ~accept:
                y = _prob_search(at[0], at[0], 1.0, n < 0, V, t, last, False, BLOCK_V)
        n += accept.to(tl.int32)
        go = accept
    return n, y


@triton.jit
def _greedy_walk(target, draft_tokens_row, kb, req, rows, described, K, V, FROM_LOGITS: tl.constexpr,
                 DESCRIBED: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr):
    """``greedy``: ``y_n = argmax p_n`` (of the masked logits: the parameters are not read; lowest id among
    ties) while it equals draft n. Returns ``(n, y)``."""
    b = req[0]
    n = tl.full((), 0, tl.int32)
    y = tl.full((), 0, tl.int32)
    go = n >= 0
    while go:
        target_row = row_ptr(target, b, n)
        if not FROM_LOGITS:
            y = argmax(target_row, V, BLOCK_V)
        elif DESCRIBED:  # the argmax, where the descriptors keep id_cut
            y = tl.load(described.ints + 2 * (b * (K + 1) + n))
        else:
            fscratch_row, _ = scratch_rows(rows, b, ROWS)
            _, arg = scan_row(target_row, mask_row(rows, target_row, b, n, HAS_MASK), V, 1.0, False, fscratch_row,
                              HAS_MASK, ROWS.CHUNK, ROWS.BLOCK_CHUNKS, ROWS.NCH_P2)
            y = arg.to(tl.int32)
        accept = y == _draft(draft_tokens_row, n, kb, V)
        n += accept.to(tl.int32)
        go = accept
    return n, y


@triton.jit(do_not_specialize=["target_stride_b", "target_stride_row", "draft_probs_stride_b", "draft_probs_stride_row",
                               "u_accept_stride", "u_sample_stride", "philox", "vocab_mask_stride_b",
                               "vocab_mask_stride_row", "K"],
            do_not_specialize_on_alignment=["draft_tokens_ptr", "num_drafts_ptr", "seed_ptr", "offset_ptr",
                                            "u_accept_ptr", "u_sample_ptr", "temperature_ptr", "top_k_ptr",
                                            "top_p_ptr", "min_p_ptr", "desc_floats_ptr", "desc_ints_ptr",
                                            "cands_ptr", "tokens_ptr", "num_accepted_ptr"])
def _chain_kernel(
    target_ptr,  # float32/bf16/fp16 [B, K+1, V], last dim contiguous: probabilities, or logits (FROM_LOGITS)
    target_stride_b,
    target_stride_row,
    draft_probs_ptr,  # float [B, K, V], last dim contiguous (token, block), else None
    draft_probs_stride_b,
    draft_probs_stride_row,
    draft_tokens_ptr,  # int64 [B, K], contiguous
    num_drafts_ptr,  # int64 [B] (clamped to [0, K])
    seed_ptr,  # int64 [B] (philox; else a stand-in, not read)
    offset_ptr,  # int64 [B] (philox; else a stand-in)
    u_accept_ptr,  # float32 [B, >= K+1] (token, block without philox), else a stand-in
    u_accept_stride,
    u_sample_ptr,  # float32 [B, >= K+1] (without philox, but greedy), else a stand-in
    u_sample_stride,
    philox,  # 1: the uniforms come from Philox keys; 0: from u_accept / u_sample
    vocab_mask_ptr,  # uint8 [B * (K+1), V] or [B, K+1, V], last dim contiguous (HAS_MASK), else None
    vocab_mask_stride_b,
    vocab_mask_stride_row,
    temperature_ptr,  # float32 [B * (K+1)], request-major (FROM_LOGITS), else None
    top_k_ptr,  # int64 [B * (K+1)] (FROM_LOGITS), else None
    top_p_ptr,  # float32 [B * (K+1)] (FROM_LOGITS), else None
    min_p_ptr,  # float32 [B * (K+1)] (FROM_LOGITS), else None
    fscratch_ptr,  # float32 [B or B * (K+1) (DESCRIBED), 3 * NCH_P2]: rows.row_scratch (FROM_LOGITS), else None
    iscratch_ptr,  # int64 [B or B * (K+1), 3 * CAND] (FROM_LOGITS), else None
    desc_floats_ptr,  # float32 [B * (K+1), 5]: Descriptors (DESCRIBED), else None
    desc_ints_ptr,  # int32 [B * (K+1), 2] (DESCRIBED), else None
    cands_ptr,  # int64 [B * (K+1), CAND] (DESCRIBED), else None
    tokens_ptr,  # out int64 [B, K+1]: accepted drafts, the correction or bonus token, then -1
    num_accepted_ptr,  # out int64 [B]
    K,  # drafts per chain at most
    V,  # vocabulary size
    METHOD: tl.constexpr,  # METHODS[method]
    FROM_LOGITS: tl.constexpr,  # target rows are logits processed by their row's parameters
    DESCRIBED: tl.constexpr,  # _describe_rows_kernel stored every row's descriptor
    HAS_MASK: tl.constexpr,  # vocab_mask_ptr is given
    ALIGNED: tl.constexpr,  # the row strides are multiples of 16 (rows.aligned_strides)
    BLOCK_V: tl.constexpr,  # vocabulary entries per block of the passes over probabilities and residuals
    ROWS: tl.constexpr,  # RowConfig (FROM_LOGITS), else None
):
    """One program per request: the walk of ``METHOD`` (the kernel of :func:`specsampler.verify.chain.verify_chain`
    and of :func:`specsampler.verify.chain.verify_chain_from_logits`; reference: their ``_verify``, plain loops
    :func:`specsampler.verify.reference.chain_token`, ``chain_block``, ``chain_draws``)."""
    target = Strided(target_ptr, row_stride(target_stride_b, ALIGNED), row_stride(target_stride_row, ALIGNED))
    draft_probs = Strided(draft_probs_ptr, row_stride(draft_probs_stride_b, ALIGNED),
                          row_stride(draft_probs_stride_row, ALIGNED))
    randomness = Randomness(seed_ptr, offset_ptr, u_accept_ptr, u_accept_stride, u_sample_ptr, u_sample_stride,
                            philox)
    mask = Strided(vocab_mask_ptr, row_stride(vocab_mask_stride_b, ALIGNED), row_stride(vocab_mask_stride_row, ALIGNED))
    rows = LogitRows(mask, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_ptr, iscratch_ptr)
    described = Descriptors(desc_floats_ptr, desc_ints_ptr, cands_ptr)
    b = tl.program_id(0).to(tl.int64)
    kb = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K).to(tl.int32)
    req = request_keys(randomness, b)
    draft_tokens_row = draft_tokens_ptr + b * K
    if METHOD == 0:
        n, y = _token_walk(target, draft_probs, draft_tokens_row, kb, randomness, req, rows, described, K, V,
                           FROM_LOGITS, DESCRIBED, HAS_MASK, BLOCK_V, ROWS)
    elif METHOD == 1:
        n, y = _block_walk(target, draft_probs, draft_tokens_row, kb, randomness, req, rows, described, K, V,
                           FROM_LOGITS, DESCRIBED, HAS_MASK, BLOCK_V, ROWS)
    elif METHOD == 2:
        n, y = _target_only_walk(target, draft_tokens_row, kb, randomness, req, rows, described, K, V, FROM_LOGITS,
                                 DESCRIBED, HAS_MASK, BLOCK_V, ROWS)
    else:
        n, y = _greedy_walk(target, draft_tokens_row, kb, req, rows, described, K, V, FROM_LOGITS, DESCRIBED,
                            HAS_MASK, BLOCK_V, ROWS)
    for start in range(0, K + 1, 16):  # the K + 1 outputs in blocks (K is a run-time size)
        pos = start + tl.arange(0, 16)
        drafts = tl.load(draft_tokens_row + pos, mask=pos < n, other=-1)
        out = tl.where(pos < n, drafts, tl.where(pos == n, y.to(tl.int64), -1))
        tl.store(tokens_ptr + b * (K + 1) + pos, out, mask=pos <= K)
    tl.store(num_accepted_ptr + b, n.to(tl.int64))


@triton.jit(do_not_specialize=["target_stride_b", "target_stride_row", "vocab_mask_stride_b", "vocab_mask_stride_row",
                               "parts", "K"],
            do_not_specialize_on_alignment=["num_drafts_ptr", "temperature_ptr", "top_k_ptr", "top_p_ptr",
                                            "min_p_ptr", "part_m_ptr", "part_arg_ptr", "desc_floats_ptr",
                                            "desc_ints_ptr", "cands_ptr"])
def _describe_rows_kernel(
    target_ptr,  # float32/bf16/fp16 logits [B, K+1, V], last dim contiguous
    target_stride_b,
    target_stride_row,
    num_drafts_ptr,  # int64 [B] (clamped to [0, K])
    vocab_mask_ptr,  # uint8 [B * (K+1), V] or [B, K+1, V], last dim contiguous (HAS_MASK), else None
    vocab_mask_stride_b,
    vocab_mask_stride_row,
    temperature_ptr,  # float32 [B * (K+1)], request-major
    top_k_ptr,  # int64 [B * (K+1)]
    top_p_ptr,  # float32 [B * (K+1)]
    min_p_ptr,  # float32 [B * (K+1)]
    fscratch_ptr,  # float32 [B * (K+1), 3 * NCH_P2]: rows.row_scratch, one row per program
    iscratch_ptr,  # int64 [B * (K+1), 3 * CAND]
    part_m_ptr,  # float32 [B * (K+1) * parts]: pass 1's part maxima (rows.scan_parts)
    part_arg_ptr,  # int32 [B * (K+1) * parts]: their ids
    parts,  # parts per row of pass 1 (0: none)
    desc_floats_ptr,  # out float32 [B * (K+1), 5]: Descriptors
    desc_ints_ptr,  # out int32 [B * (K+1), 2]
    cands_ptr,  # out int64 [B * (K+1), CAND]
    K,  # drafts per chain at most
    V,  # vocabulary size
    GREEDY: tl.constexpr,  # greedy: only the argmax is stored
    HAS_MASK: tl.constexpr,  # vocab_mask_ptr is given
    ALIGNED: tl.constexpr,  # the row strides are multiples of 16 (rows.aligned_strides)
    ROWS: tl.constexpr,  # RowConfig
):
    """The first phase on a GPU (``rows_in_parallel``): program ``r`` describes row ``i = r % (K+1)``
    of request ``b = r // (K+1)`` if the request has it (``i <= num_drafts[b]``), with the code the chain
    kernel runs itself otherwise (:func:`specsampler.kernels.describe.describe_row_in_parts`, whose reference is
    :func:`specsampler.sampling.processing.process`), and stores the descriptor (greedy: the argmax) in
    ``described`` and, in its scratch row, the chunk masses that a draw reads."""
    target = Strided(target_ptr, row_stride(target_stride_b, ALIGNED), row_stride(target_stride_row, ALIGNED))
    mask = Strided(vocab_mask_ptr, row_stride(vocab_mask_stride_b, ALIGNED), row_stride(vocab_mask_stride_row, ALIGNED))
    rows = LogitRows(mask, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_ptr, iscratch_ptr)
    described = Descriptors(desc_floats_ptr, desc_ints_ptr, cands_ptr)
    r = tl.program_id(0).to(tl.int64)
    b = r // (K + 1)
    i = r % (K + 1)
    if i <= tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K):
        target_row = row_ptr(target, b, i)
        vocab_mask_row = mask_row(rows, target_row, b, i, HAS_MASK)
        fscratch_row, iscratch_row = scratch_rows(rows, r, ROWS)
        if GREEDY:
            _, arg = first_pass(target_row, vocab_mask_row, V, 1.0, False, fscratch_row, part_m_ptr + r * parts,
                                part_arg_ptr + r * parts, parts, HAS_MASK, ROWS.CHUNK, ROWS.BLOCK_CHUNKS,
                                ROWS.NCH_P2)
            tl.store(described.ints + 2 * r, arg)
        else:
            m, inv_t, tau, id_cut, w_min, z, in_regs = describe_row_in_parts(
                target_row, vocab_mask_row, V, tl.load(rows.temperature + r), tl.load(rows.top_k + r),
                tl.load(rows.top_p + r), tl.load(rows.min_p + r), fscratch_row, iscratch_row,
                described.cands + r * ROWS.CAND, part_m_ptr + r * parts,
                part_arg_ptr + r * parts, parts, HAS_MASK, ROWS.CHUNK, ROWS.BLOCK_CHUNKS, ROWS.NCH_P2, ROWS.CAND,
                ROWS.NUCLEUS, ROWS.GROUP, ROWS.SEARCH_BLOCK, ROWS.NPIV)
            f = described.floats + 5 * r
            tl.store(f, m)
            tl.store(f + 1, inv_t)
            tl.store(f + 2, tau)
            tl.store(f + 3, w_min)
            tl.store(f + 4, z)
            tl.store(described.ints + 2 * r, id_cut)
            tl.store(described.ints + 2 * r + 1, in_regs)


def _launch(op: str, target: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None, num_drafts: Tensor | None,
            method: str, seed, offset, u_accept: Tensor | None, u_sample: Tensor | None, block_v: int,
            logits: dict | None) -> tuple[Tensor, Tensor]:
    """Both launchers: ``logits`` holds :func:`verify_chain_from_logits`' own arguments (None: probabilities)."""
    if method not in METHODS:
        raise ValueError(f"{op}: method must be one of {tuple(METHODS)}, got {method!r}")
    sampled_drafts = method in ("token", "block")
    if sampled_drafts and draft_probs is None:
        raise ValueError(f"{op}: method {method!r} needs draft_probs")
    B, K1, V = target.shape
    K, dev = K1 - 1, target.device
    tokens = torch.empty(B, K1, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return tokens, num_accepted
    check_randomness(op, method, seed, u_accept, u_sample, sampled_drafts, "")
    num_drafts = (torch.full((B,), K, dtype=torch.int64, device=dev) if num_drafts is None
                  else num_drafts.to(torch.int64).contiguous())
    target = last_dim_contiguous(target)
    draft_probs = last_dim_contiguous(draft_probs) if sampled_drafts else None
    mask = None if logits is None or logits["vocab_mask"] is None else last_dim_contiguous(logits["vocab_mask"])
    block = block_size(block_v, V)
    target_args = dict(target_ptr=target, target_stride_b=target.stride(0), target_stride_row=target.stride(1))
    kernel_args = dict(
        **target_args, draft_probs_ptr=draft_probs, draft_probs_stride_b=strides(draft_probs)[0],
        draft_probs_stride_row=strides(draft_probs)[1], draft_tokens_ptr=draft_tokens.to(torch.int64).contiguous(),
        num_drafts_ptr=num_drafts, **randomness(seed, offset, u_accept, u_sample, B, dev), tokens_ptr=tokens,
        num_accepted_ptr=num_accepted, K=K, V=V, METHOD=METHODS[method], BLOCK_V=block,
        enable_fp_fusion=False,  # a * p - q rounded as torch rounds it, and as the sampling kernel does
    )
    if logits is None:
        _chain_kernel[(B,)](**NO_LOGIT_ROWS, **NO_DESCRIPTORS, FROM_LOGITS=False, DESCRIBED=False, HAS_MASK=False,
                            ALIGNED=aligned_rows(target, draft_probs), ROWS=None, **kernel_args,
                            **launch_options(8 if block >= 2048 else 4))
        return tokens, num_accepted
    cfg = row_config(V, chunk=logits["chunk"], cand=logits["cand"], block=logits["tile"])
    described = logits["rows_in_parallel"]
    described = rows_in_parallel_by_default(dev) if described is None else described
    params = logits["temperature"], logits["top_k"], logits["top_p"], logits["min_p"]
    rows = logit_rows(target, mask, *params, B * K1 if described else B, cfg)
    meta = dict(HAS_MASK=mask is not None, ALIGNED=aligned_rows(target, draft_probs, mask), ROWS=RowConfig(**cfg),
                **launch_options(8))
    descriptors = NO_DESCRIPTORS
    if described:
        R = B * K1
        descriptors = dict(desc_floats_ptr=torch.empty(R, 5, dtype=torch.float32, device=dev),
                           desc_ints_ptr=torch.empty(R, 2, dtype=torch.int32, device=dev),
                           cands_ptr=torch.empty(R, cfg["CAND"], dtype=torch.int64, device=dev))
        mask_strides = rows["vocab_mask_stride_b"], rows["vocab_mask_stride_row"]
        part_m, part_arg, parts = scan_parts(target, strides(target), rows["vocab_mask_ptr"], mask_strides, num_drafts,
                                             rows["temperature_ptr"], rows["top_k_ptr"], rows["fscratch_ptr"], R, K1,
                                             logits["parts"], cfg, greedy=method == "greedy")
        _describe_rows_kernel[(R,)](**target_args, num_drafts_ptr=num_drafts, **rows, part_m_ptr=part_m,
                                    part_arg_ptr=part_arg, parts=parts, **descriptors, K=K, V=V,
                                    GREEDY=method == "greedy", enable_fp_fusion=False, **meta)
    _chain_kernel[(B,)](**rows, **descriptors, FROM_LOGITS=True, DESCRIBED=described, **kernel_args, **meta)
    return tokens, num_accepted


def verify_chain(target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None, num_drafts: Tensor | None,
                 method: str, seed: Tensor | None = None, offset: Tensor | None = None, u_accept: Tensor | None = None,
                 u_sample: Tensor | None = None, *, block_v: int = 4096) -> tuple[Tensor, Tensor]:
    """Verify one draft chain per request (the kernel of :func:`specsampler.verify.chain.verify_chain`).

    Inputs are taken as validated by the reference's checks; nothing here syncs with the host.

    Args:
        target_probs: float ``[B, K+1, V]`` (float32, or fp16/bf16 read as float32), last dim
            contiguous: the target distribution at each position; row ``num_drafts[b]`` is the bonus row.
        draft_tokens: integer ``[B, K]``; an id outside ``[0, V)`` is never accepted.
        draft_probs: float ``[B, K, V]``, last dim contiguous (``token``, ``block``), else None.
        num_drafts: integer ``[B]`` in ``[0, K]`` (values outside are clamped), or None for K.
        method: ``"token"``, ``"block"``, ``"target_only"`` or ``"greedy"``.
        seed, offset: int64 ``[B]``: Philox keys, uniforms computed in the kernel at the counters of
            :mod:`specsampler.rng` (offset None = 0). When ``seed`` is None the uniforms are given:
        u_accept: float32 ``[B, >= K+1]``: ``STREAM_ACCEPT`` uniforms by index (``token`` reads
            index ``i + 1`` for draft i, ``block`` index ``i``); needed by ``token`` and ``block``.
        u_sample: float32 ``[B, >= K+1]``: ``STREAM_SAMPLE`` uniforms by position; needed by all
            methods but ``greedy``.
        block_v: vocabulary entries per block at most (a power of 2); rows are read in blocks of
            ``min(block_v, next_power_of_2(V))``.
    Returns:
        tokens: int64 ``[B, K+1]``: accepted drafts, then one correction or bonus token, then -1.
        num_accepted: int64 ``[B]``.
    """
    return _launch("verify_chain kernel", target_probs, draft_tokens, draft_probs, num_drafts, method, seed, offset,
                   u_accept, u_sample, block_v, None)


def verify_chain_from_logits(target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                             num_drafts: Tensor | None, method: str, temperature: Tensor, top_k: Tensor,
                             top_p: Tensor, min_p: Tensor, vocab_mask: Tensor | None = None,
                             seed: Tensor | None = None, offset: Tensor | None = None, u_accept: Tensor | None = None,
                             u_sample: Tensor | None = None, *, block_v: int = 4096, chunk: int = 64, cand: int = 256,
                             tile: int = 2048, rows_in_parallel: bool | None = None,
                             parts: int | None = None) -> tuple[Tensor, Tensor]:
    """Process the target logits per row and verify one draft chain per request (the kernel of
    :func:`specsampler.verify.chain.verify_chain_from_logits`).

    Inputs are taken as validated by the reference's checks; nothing here syncs with the host. The arguments
    :func:`verify_chain` shares mean the same here (``target_logits`` for ``target_probs``: float32/bf16/fp16,
    any batch and position strides), and:

    Args:
        temperature: float32 ``[B * (K+1)]`` (0 = greedy); top_k: int64 ``[B * (K+1)]`` (<= 0 or >= V:
            off); top_p: float32 ``[B * (K+1)]`` (>= 1: off); min_p: float32 ``[B * (K+1)]``: the
            parameters of each row, request-major (row ``b * (K+1) + i``), as
            :meth:`specsampler.SamplingParams.rows` gives them. ``greedy`` does not read them.
        vocab_mask: bool (or uint8) ``[B * (K+1), V]`` (request-major) or ``[B, K+1, V]``, True = allowed;
            any strides but the last dim's, so an ``expand`` of a per-request or per-vocabulary mask
            needs no copy. None: all allowed.
        block_v: vocabulary entries per block of the residual passes at most (a power of 2).
        chunk, cand, tile: tuning of the row descriptors (see :func:`specsampler.kernels.rows.row_config`, whose
            ``block`` is ``tile``); keep the defaults of :func:`specsampler.kernels.sampling.sample_from_logits`
            for ``target_only`` to draw its tokens bit for bit.
        rows_in_parallel: describe every row a request has in a first kernel, one program per row, before
            the chain kernel walks (the walk then takes about a row's time instead of one row per accepted draft;
            rows past the stop are read too). False: the chain kernel describes each row
            it reaches and reads no row past the stop. None: :func:`rows_in_parallel_by_default`. The
            results are the same either way (the same code describes a row).
        parts: with rows in parallel, split each row's first pass over this many programs (a kernel before
            them, :func:`specsampler.kernels.rows.scan_parts`); 0: none; None:
            :func:`specsampler.kernels.rows.parts_per_row` (fewer rows than a GPU's program slots, e.g. B=1).
            The results are the same bit for bit.
    Returns:
        tokens: int64 ``[B, K+1]``: accepted drafts, then one correction or bonus token, then -1.
        num_accepted: int64 ``[B]``.
    """
    logits = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, vocab_mask=vocab_mask, chunk=chunk,
                  cand=cand, tile=tile, rows_in_parallel=rows_in_parallel, parts=parts)
    return _launch("verify_chain_from_logits kernel", target_logits, draft_tokens, draft_probs, num_drafts, method,
                   seed, offset, u_accept, u_sample, block_v, logits)


def rows_in_parallel_by_default(device: torch.device) -> bool:
    """Whether chains describe their rows in a first, row-parallel kernel: on a GPU, whatever the batch and chain;
    off a GPU (the interpreter) never, where the rows past a request's stop would only cost time.

    From measurement (NVIDIA H100, Triton 3.6, chain ``token`` from bf16 logits, top-k 50 + top-p 0.95,
    V = 128256, CUDA-graph replays): the row-parallel mode was faster at every shape measured, including
    those where a rule of "at most two rows per SM" had chosen the serial walk (B=32 K=8: 454 -> 114 us,
    B=128 K=4: 315 -> 174 us, B=128 K=8: 546 -> 296 us, V=200064 B=128 K=4: 421 -> 258 us). The serial walk
    reads no row past a request's stop but describes the rows one after another; describing them all at
    once costs reads that the GPU's bandwidth absorbs. ``benchmarks/gpu.py`` keeps both modes' records
    (``chain-serial``) so that a later GPU run can re-check the rule."""
    return multiprocessors(device) is not None
