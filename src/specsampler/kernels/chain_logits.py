"""Chain verification from logits: one Triton program per request (see :func:`specsampler.verify_chain_from_logits`).

The target at position i of request b is row i of its logits processed by its parameters (vocab mask,
temperature (0 = greedy), top-k, top-p, min-p): the program describes each row it needs with
:func:`specsampler.kernels.rows.describe_row` (no sort of the vocabulary; one pass over the row in
the common cases, the kept tokens then held in registers) and walks its chain from position 0 as the
kernel of :mod:`specsampler.kernels.chain` does, so rows after the position where the request stops
are never read (logits, mask or draft probabilities).

Small batches on a GPU (``rows_in_parallel``: at most two rows per SM, one program per row) describe
every row of every request in parallel (:func:`_describe_rows_kernel`, the same code), and the chain
kernel walks on the stored descriptors: one program per request would otherwise read its rows one
after the other while most SMs idle. Rows past a request's stop are then read by that first kernel.
With fewer rows than the GPU's program slots (e.g. B=1: 5 or 9 rows), each row's first pass is split
over several programs before that (:func:`specsampler.kernels.rows.scan_parts`), with the same results.

- ``token``: per position, the row's descriptor and ``p_i(x_i)`` (from the registers, or one
  logit), ``q_i(x_i)``; at the stop position the residual ``max(p - q, 0)`` (or ``p``): built from
  the kept tokens in registers (``q`` gathered there, since the residual is 0 where ``p`` is), else
  one pass for its mass and one search pass that stops at the token found.
- ``block``: per draft position ``i > 0`` also ``S_i`` (in registers, or one pass over the row and
  ``q_i``); positions after ``a_i`` drops to 0 are not read; the bonus row only when ``tau`` is it.
- ``target_only``: per position the row's descriptor and the draw of
  :func:`specsampler.kernels.rows.draw` (the draw of :func:`specsampler.sample_from_logits`, token
  for token), compared with the draft.
- ``greedy``: per position one argmax pass over the masked logits (the parameters are not read).

Draws from ``p`` and residuals are by inversion as in :mod:`specsampler.kernels.chain` (the first id of
positive weight whose cumulative weight exceeds ``u * total``, else the last id of positive weight, 0
for a row without mass), with ``p = kept weight / z`` as the reference normalises it. Sums are taken
in another order than torch's, so a draw or an acceptance test can differ from the reference's only
where float rounding decides.

Randomness (:mod:`specsampler.rng`): ``u_i`` (token) is ``STREAM_ACCEPT`` index ``i + 1``, ``eta_i``
(block) index ``i``, the draw at position ``i`` ``STREAM_SAMPLE`` index ``i``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .chain import METHODS, _draft, _ratio, _store_result, draft_counts
from .common import (
    ACCEPT,
    SAMPLE,
    TINY,
    block_size,
    check_randomness,
    describe,
    last_dim_contiguous,
    mask_strides,
    randomness,
    request_keys,
    uniform,
)
from .rows import (
    STAGES,
    describe_row_in_parts,
    draw,
    first_pass,
    kept_weights,
    launch_options,
    load_logits,
    row_config,
    row_scratch,
    scan_parts,
    scan_row,
    token_weight,
)


@triton.jit
def _prob(x, logits_row, mask_row, V, m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w,
          HAS_MASK: tl.constexpr):
    """The processed probability of token ``x`` (an int32 scalar, -1 = none: 0) in a described row."""
    w = tl.full((), 0.0, tl.float32)
    if in_regs != 0:
        w = tl.sum(tl.where(cand_ids == x, cand_w, 0.0), axis=0)
    else:
        w = token_weight(logits_row, mask_row, V, x, m, inv_t, tau, id_cut, w_min, HAS_MASK)
    return w / tl.maximum(z, TINY)


@triton.jit
def _cand_weights(cand_ids, cand_w, z, q_row, a, use_q, V):
    """At the kept tokens held in registers: ``max(a * p - q, 0)`` (``p`` when not ``use_q`` and ``a = 1``);
    elsewhere it is 0, as ``p`` is. ``q`` is read only when ``use_q``."""
    p = cand_w / tl.maximum(z, TINY)
    inside = cand_ids < V
    q = tl.load(q_row + tl.where(inside, cand_ids, 0), mask=inside & (cand_ids < tl.where(use_q, V, 0)), other=0.0)
    return tl.maximum(a * p - q.to(tl.float32), 0.0)


@triton.jit
def _row_weights(logits_row, mask_row, q_row, offs, V, m, inv_t, tau, id_cut, w_min, z, a, use_q,
                 HAS_MASK: tl.constexpr):
    """:func:`_cand_weights` at ``offs`` (a block of a whole row; 0 from V on)."""
    x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
    p = kept_weights(x, offs, m, inv_t, tau, id_cut, w_min) / tl.maximum(z, TINY)
    q = tl.load(q_row + offs, mask=offs < tl.where(use_q, V, 0), other=0.0).to(tl.float32)
    return tl.maximum(a * p - q, 0.0)


@triton.jit
def _stop_mass(a, use_q, m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w, logits_row, mask_row, q_row,
               V, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Mass of ``max(a * p - q, 0)`` (or of ``p``) and the last id of positive weight (0 if none): from the
    registers, or one pass over the row (block by block, as :func:`_stop_pick` accumulates it)."""
    total = tl.full((), 0.0, tl.float32)
    last = tl.full((), 0, tl.int32)
    if in_regs != 0:
        w = _cand_weights(cand_ids, cand_w, z, q_row, a, use_q, V)
        total = tl.sum(w, axis=0)
        last = tl.max(tl.where(w > 0, cand_ids, 0), axis=0)
    else:
        for start in tl.range(0, V, BLOCK_V, num_stages=STAGES):
            offs = start + tl.arange(0, BLOCK_V)
            w = _row_weights(logits_row, mask_row, q_row, offs, V, m, inv_t, tau, id_cut, w_min, z, a, use_q,
                             HAS_MASK)
            last = tl.maximum(last, tl.max(tl.where(w > 0, offs, 0), axis=0))
            total += tl.sum(w, axis=0)
    return total, last


@triton.jit
def _stop_pick(t, last, a, use_q, m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w, logits_row, mask_row,
               q_row, V, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """The first id of positive weight whose cumulative weight (of :func:`_stop_mass`'s weights) exceeds ``t``,
    else ``last``. Blocks after the one holding the token are not read."""
    y = last
    if in_regs != 0:  # candidates in increasing id order: the smallest id past t is the first
        w = _cand_weights(cand_ids, cand_w, z, q_row, a, use_q, V)
        first = tl.min(tl.where((w > 0) & (tl.cumsum(w, axis=0) > t), cand_ids, V), axis=0)
        y = tl.where(first < V, first, last)
    else:
        total = tl.full((), 0.0, tl.float32)
        found = tl.full((), 0, tl.int1)
        start = 0
        while (start < V) & (found == 0):
            offs = start + tl.arange(0, BLOCK_V)
            w = _row_weights(logits_row, mask_row, q_row, offs, V, m, inv_t, tau, id_cut, w_min, z, a, use_q,
                             HAS_MASK)
            first = tl.min(tl.where((w > 0) & (total + tl.cumsum(w, axis=0) > t), offs, V), axis=0)
            found = first < V
            y = tl.where(found, first, y)
            total += tl.sum(w, axis=0)
            start += BLOCK_V
    return y


@triton.jit
def _descriptor(logits_row, mask_row, r, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
                iscratch_row, desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, DESCRIBED: tl.constexpr,
                HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr,
                CAND: tl.constexpr, NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                NPIV: tl.constexpr):
    """The descriptor of row ``r`` (request-major): described here, or (``DESCRIBED``) loaded where
    :func:`_store_descriptor` put it."""
    if DESCRIBED:
        j = tl.arange(0, CAND)
        return (tl.load(desc_f_ptr + 5 * r), tl.load(desc_f_ptr + 5 * r + 1), tl.load(desc_f_ptr + 5 * r + 2),
                tl.load(desc_i_ptr + 2 * r), tl.load(desc_f_ptr + 5 * r + 3), tl.load(desc_f_ptr + 5 * r + 4),
                tl.load(desc_i_ptr + 2 * r + 1), tl.load(cand_ids_ptr + r * CAND + j),
                tl.load(cand_w_ptr + r * CAND + j))
    else:
        return describe(logits_row, mask_row, r, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
                        iscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK,
                        NPIV)


@triton.jit
def _store_descriptor(desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, r, m, inv_t, tau, id_cut, w_min, z, in_regs,
                      cand_ids, cand_w, CAND: tl.constexpr):
    """Row ``r``'s descriptor for :func:`_descriptor`: ``m, inv_t, tau, w_min, z`` at ``desc_f[5r:5r+5]``,
    ``id_cut, in_regs`` at ``desc_i[2r:2r+2]`` (a greedy row's argmax alone at ``desc_i[2r]``), the kept
    tokens at ``cand_ids[r]``, ``cand_w[r]``."""
    tl.store(desc_f_ptr + 5 * r, m)
    tl.store(desc_f_ptr + 5 * r + 1, inv_t)
    tl.store(desc_f_ptr + 5 * r + 2, tau)
    tl.store(desc_f_ptr + 5 * r + 3, w_min)
    tl.store(desc_f_ptr + 5 * r + 4, z)
    tl.store(desc_i_ptr + 2 * r, id_cut)
    tl.store(desc_i_ptr + 2 * r + 1, in_regs)
    j = tl.arange(0, CAND)
    tl.store(cand_ids_ptr + r * CAND + j, cand_ids)
    tl.store(cand_w_ptr + r * CAND + j, cand_w)


@triton.jit
def _describe_rows_kernel(
    logits_ptr, mask_ptr, nd_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, fscratch_ptr, iscratch_ptr, part_m_ptr, part_arg_ptr, parts,
    K, V, stride_lb, stride_lk, stride_mb, stride_mk,
    GREEDY: tl.constexpr, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
    NCH_P2: tl.constexpr, CAND: tl.constexpr, NUCLEUS: tl.constexpr, GROUP: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr,
):
    """The first phase of a small batch (``rows_in_parallel``): program ``r`` describes row ``i = r % (K+1)``
    of request ``b = r // (K+1)`` if the request has it (``i <= num_drafts[b]``), with the code the chain
    kernel runs itself otherwise, and stores the descriptor (:func:`_store_descriptor`; greedy: the argmax)
    and, in ``fscratch`` row ``r``, the chunk masses that a draw reads. With ``parts > 0``, pass 1 over the
    rows was split into that many programs each (:func:`specsampler.kernels.rows.scan_parts`)."""
    r = tl.program_id(0).to(tl.int64)
    b = r // (K + 1)
    i = r % (K + 1)
    if i <= tl.minimum(tl.maximum(tl.load(nd_ptr + b), 0), K):
        logits_row = logits_ptr + b * stride_lb + i * stride_lk
        mask_row = mask_ptr + b * stride_mb + i * stride_mk
        fscratch_row = fscratch_ptr + r * (3 * NCH_P2)
        if GREEDY:
            _, arg = first_pass(logits_row, mask_row, V, 1.0, False, fscratch_row, part_m_ptr + r * parts,
                                part_arg_ptr + r * parts, parts, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
            tl.store(desc_i_ptr + 2 * r, arg)
        else:
            m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w = describe_row_in_parts(
                logits_row, mask_row, V, tl.load(temperature_ptr + r), tl.load(top_k_ptr + r), tl.load(top_p_ptr + r),
                tl.load(min_p_ptr + r), fscratch_row, iscratch_ptr + r * (2 * CAND), part_m_ptr + r * parts,
                part_arg_ptr + r * parts, parts, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP,
                SEARCH_BLOCK, NPIV)
            _store_descriptor(desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, r, m, inv_t, tau, id_cut, w_min, z,
                              in_regs, cand_ids, cand_w, CAND)


@triton.jit
def _chain_logits_kernel(
    logits_ptr, mask_ptr, q_ptr, x_ptr, nd_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seed_ptr, offset_ptr, ua_ptr, us_ptr, tokens_ptr, nacc_ptr, fscratch_ptr, iscratch_ptr,
    desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr,
    K, V, stride_lb, stride_lk, stride_mb, stride_mk, stride_qb, stride_qk, stride_ua, stride_us,
    METHOD: tl.constexpr, DESCRIBED: tl.constexpr, HAS_MASK: tl.constexpr, PHILOX: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr,
    CAND: tl.constexpr, NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kb = tl.minimum(tl.maximum(tl.load(nd_ptr + b), 0), K).to(tl.int32)
    seed, offset = request_keys(seed_ptr, offset_ptr, b, PHILOX)
    l_b = logits_ptr + b * stride_lb
    m_b = mask_ptr + b * stride_mb
    q_b = q_ptr + b * stride_qb
    x_row = x_ptr + b * K
    ua_row = ua_ptr + b * stride_ua
    us_row = us_ptr + b * stride_us
    r_b = b * (K + 1)  # the parameters (DESCRIBED: also the descriptor and scratch row) of row i are at r_b + i
    fscratch_row = fscratch_ptr + b * (3 * NCH_P2)
    iscratch_row = iscratch_ptr + b * (2 * CAND)

    n = tl.full((), 0, tl.int32)  # accepted drafts
    y = tl.full((), 0, tl.int32)  # the correction or bonus token
    # the descriptor of a row (see rows.py): of the row just described, or (block) of row tau
    d_m = tl.full((), 0.0, tl.float32)
    d_inv_t = tl.full((), 1.0, tl.float32)
    d_tau = tl.full((), float("-inf"), tl.float32)
    d_cut = tl.full((), 0, tl.int32)
    d_w_min = tl.full((), 0.0, tl.float32)
    d_z = tl.full((), 0.0, tl.float32)
    d_regs = tl.full((), 0, tl.int32)
    d_ids = tl.zeros([CAND], tl.int32)
    d_w = tl.zeros([CAND], tl.float32)
    if METHOD == 0:  # token: describe row n and test x_n until the first rejection; the residual (or p) at n
        go = n >= 0
        while go:
            logits_row = l_b + n * stride_lk
            mask_row = m_b + n * stride_mk
            d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w = _descriptor(
                logits_row, mask_row, r_b + n, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
                iscratch_row, desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, DESCRIBED, HAS_MASK, CHUNK,
                BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
            accept = n < 0
            if n < kb:
                x = _draft(x_row, n, kb, V)
                p_x = _prob(x, logits_row, mask_row, V, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w,
                            HAS_MASK)
                q_x = tl.load(q_b + n * stride_qk + x, mask=x >= 0, other=0.0).to(tl.float32)
                accept = (x >= 0) & (uniform(ua_row, seed, offset, n + 1, ACCEPT, PHILOX) * q_x < p_x)
            n += accept.to(tl.int32)
            go = accept
        logits_row = l_b + n * stride_lk
        mask_row = m_b + n * stride_mk
        q_row = q_b + n * stride_qk
        use_q = n < kb
        total, last = _stop_mass(1.0, use_q, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w,
                                 logits_row, mask_row, q_row, V, HAS_MASK, BLOCK_V)
        if use_q & (total <= 0.0):  # a residual without mass: draw from p itself
            use_q = n < 0
            total, last = _stop_mass(1.0, use_q, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w,
                                     logits_row, mask_row, q_row, V, HAS_MASK, BLOCK_V)
        t = uniform(us_row, seed, offset, n, SAMPLE, PHILOX) * total
        y = _stop_pick(t, last, 1.0, use_q, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w,
                       logits_row, mask_row, q_row, V, HAS_MASK, BLOCK_V)
    elif METHOD == 1:  # block: a_i and h_i forward while a_i > 0, keeping row tau's descriptor; then w_tau or p
        a = tl.full((), 1.0, tl.float32)  # a_i at the loop's position i
        a_tau = tl.full((), 1.0, tl.float32)
        s_tau = tl.full((), 0.0, tl.float32)  # S_tau and the last id of w_tau's support, for tau > 0
        last_tau = tl.full((), 0, tl.int32)
        tau = tl.full((), 0, tl.int32)
        i = tl.full((), 0, tl.int32)
        go = i < kb
        while go:
            logits_row = l_b + i * stride_lk
            mask_row = m_b + i * stride_mk
            q_row = q_b + i * stride_qk
            c_m, c_inv_t, c_tau, c_cut, c_w_min, c_z, c_regs, c_ids, c_w = _descriptor(
                logits_row, mask_row, r_b + i, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
                iscratch_row, desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, DESCRIBED, HAS_MASK, CHUNK,
                BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
            take = i == 0  # h_0 = 1
            if i > 0:
                s, last = _stop_mass(a, i >= 0, c_m, c_inv_t, c_tau, c_cut, c_w_min, c_z, c_regs, c_ids, c_w,
                                     logits_row, mask_row, q_row, V, HAS_MASK, BLOCK_V)
                h = tl.where(s > 0, s / tl.where(s > 0, s + 1 - a, 1.0), 0.0)
                take = uniform(ua_row, seed, offset, i, ACCEPT, PHILOX) < h
                s_tau = tl.where(take, s, s_tau)
                last_tau = tl.where(take, last, last_tau)
            tau = tl.where(take, i, tau)
            a_tau = tl.where(take, a, a_tau)
            d_m = tl.where(take, c_m, d_m)
            d_inv_t = tl.where(take, c_inv_t, d_inv_t)
            d_tau = tl.where(take, c_tau, d_tau)
            d_cut = tl.where(take, c_cut, d_cut)
            d_w_min = tl.where(take, c_w_min, d_w_min)
            d_z = tl.where(take, c_z, d_z)
            d_regs = tl.where(take, c_regs, d_regs)
            d_ids = tl.where(take, c_ids, d_ids)
            d_w = tl.where(take, c_w, d_w)
            x = _draft(x_row, i, kb, V)
            ok = x >= 0
            p_x = _prob(x, logits_row, mask_row, V, c_m, c_inv_t, c_tau, c_cut, c_w_min, c_z, c_regs, c_ids, c_w,
                        HAS_MASK)
            q_x = tl.load(q_row + x, mask=ok, other=0.0).to(tl.float32)
            a = tl.where(ok, _ratio(a * p_x, q_x), 0.0)
            i += 1
            go = (i < kb) & (a > 0)
        # h at position kb is a_kb (h_0 = 1 when kb = 0); a stop before kb left a = 0 there
        if (i == kb) & ((uniform(ua_row, seed, offset, kb, ACCEPT, PHILOX) < a) | (kb == 0)):
            tau = kb
            d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w = _descriptor(
                l_b + kb * stride_lk, m_b + kb * stride_mk, r_b + kb, V, temperature_ptr, top_k_ptr, top_p_ptr,
                min_p_ptr, fscratch_row, iscratch_row, desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, DESCRIBED,
                HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
        logits_row = l_b + tau * stride_lk
        mask_row = m_b + tau * stride_mk
        q_row = q_b + tau * stride_qk
        use_q = tau < kb
        a_w = tl.where(use_q, a_tau, 1.0)
        total = s_tau
        last = last_tau
        if (tau == 0) | (tau == kb):  # S_0 is not needed for h_0 = 1, the bonus row has none: found only now
            total, last = _stop_mass(a_w, use_q, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w,
                                     logits_row, mask_row, q_row, V, HAS_MASK, BLOCK_V)
        if use_q & (total <= 0.0):  # a residual without mass: draw from p_tau
            use_q = tau < 0
            a_w = 1.0
            total, last = _stop_mass(a_w, use_q, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w,
                                     logits_row, mask_row, q_row, V, HAS_MASK, BLOCK_V)
        t = uniform(us_row, seed, offset, tau, SAMPLE, PHILOX) * total
        y = _stop_pick(t, last, a_w, use_q, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w,
                       logits_row, mask_row, q_row, V, HAS_MASK, BLOCK_V)
        n = tau
    elif METHOD == 2:  # target_only: y_n ~ p_n (sample_from_logits' draw) while it equals x_n
        go = n >= 0
        while go:
            logits_row = l_b + n * stride_lk
            mask_row = m_b + n * stride_mk
            d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w = _descriptor(
                logits_row, mask_row, r_b + n, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
                iscratch_row, desc_f_ptr, desc_i_ptr, cand_ids_ptr, cand_w_ptr, DESCRIBED, HAS_MASK, CHUNK,
                BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
            u = uniform(us_row, seed, offset, n, SAMPLE, PHILOX)
            drawn, _ = draw(u, d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, d_regs, d_ids, d_w, logits_row, mask_row,
                            V, fscratch_ptr + (r_b + n) * (3 * NCH_P2) if DESCRIBED else fscratch_row, HAS_MASK,
                            CHUNK, NCH_P2)
            y = drawn.to(tl.int32)
            accept = y == _draft(x_row, n, kb, V)
            n += accept.to(tl.int32)
            go = accept
    else:  # greedy: y_n = argmax of the masked logits (lowest id among ties) while it equals x_n
        go = n >= 0
        while go:
            if DESCRIBED:  # the argmax, where _store_descriptor's layout keeps id_cut
                y = tl.load(desc_i_ptr + 2 * (r_b + n))
            else:
                _, arg = scan_row(l_b + n * stride_lk, m_b + n * stride_mk, V, 1.0, False, fscratch_row,
                                  HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
                y = arg.to(tl.int32)
            accept = y == _draft(x_row, n, kb, V)
            n += accept.to(tl.int32)
            go = accept

    _store_result(tokens_ptr, nacc_ptr, x_row, b, K, n, y, BLOCK_K)


def verify_chain_from_logits(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    num_drafts: Tensor | None,
    method: str,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    vocab_mask: Tensor | None = None,
    seed: Tensor | None = None,
    offset: Tensor | None = None,
    u_accept: Tensor | None = None,
    u_sample: Tensor | None = None,
    *,
    block_v: int = 4096,
    chunk: int = 64,
    cand: int = 256,
    tile: int = 2048,
    rows_in_parallel: bool | None = None,
    parts: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Process the target logits per row and verify one draft chain per request (the kernel of
    :func:`specsampler.verify_chain_from_logits`).

    Inputs are taken as validated by the reference's checks; nothing here syncs with the host.

    Args:
        target_logits: float32/bf16/fp16 ``[B, K+1, V]``, last dim contiguous (any batch and
            position strides): the target's logits at each position; row ``num_drafts[b]`` is the bonus row.
        draft_tokens: integer ``[B, K]``; an id outside ``[0, V)`` is never accepted.
        draft_probs: float ``[B, K, V]``, last dim contiguous (``token``, ``block``), else None.
        num_drafts: integer ``[B]`` in ``[0, K]`` (values outside are clamped), or None for K.
        method: ``"token"``, ``"block"``, ``"target_only"`` or ``"greedy"``.
        temperature: float32 ``[B * (K+1)]`` (0 = greedy); top_k: int64 ``[B * (K+1)]`` (<= 0 or >= V:
            off); top_p: float32 ``[B * (K+1)]`` (>= 1: off); min_p: float32 ``[B * (K+1)]``: the
            parameters of each row, request-major (row ``b * (K+1) + i``), as
            :meth:`specsampler.SamplingParams.rows` gives them. ``greedy`` does not read them.
        vocab_mask: bool (or uint8) ``[B * (K+1), V]`` (request-major) or ``[B, K+1, V]``, True = allowed;
            any strides but the last dim's, so an ``expand`` of a per-request or per-vocabulary mask
            needs no copy. None: all allowed.
        seed, offset: int64 ``[B]``: Philox keys, uniforms computed in the kernel at the counters of
            :mod:`specsampler.rng` (offset None = 0). When ``seed`` is None the uniforms are given:
        u_accept: float32 ``[B, K+1]``: ``STREAM_ACCEPT`` uniforms by index (``token`` reads index
            ``i + 1`` for draft i, ``block`` index ``i``); needed by ``token`` and ``block``.
        u_sample: float32 ``[B, K+1]``: ``STREAM_SAMPLE`` uniforms by position; needed by all methods but
            ``greedy``.
        block_v: vocabulary entries per block of the residual passes at most (a power of 2).
        chunk, cand, tile: tuning of the row descriptors (see :func:`specsampler.kernels.rows.row_config`, whose
            ``block`` is ``tile``);
            keep the defaults of :func:`specsampler.kernels.sampling.sample_from_logits` for ``target_only``
            to draw its tokens bit for bit.
        rows_in_parallel: describe every row a request has in a first kernel, one program per row, before
            the chain kernel walks (small batches: the walk's one program per request would leave most of
            the GPU idle; rows past the stop are then read too). False: the chain kernel describes each row
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
    if method not in METHODS:
        raise ValueError(f"verify_chain_from_logits kernel: method must be one of {tuple(METHODS)}, got {method!r}")
    sampled_drafts = method in ("token", "block")
    if sampled_drafts and draft_probs is None:
        raise ValueError(f"verify_chain_from_logits kernel: method {method!r} needs draft_probs")
    B, K1, V = target_logits.shape
    K, dev = K1 - 1, target_logits.device
    tokens = torch.empty(B, K1, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return tokens, num_accepted
    philox = check_randomness("verify_chain_from_logits kernel", method, seed, u_accept, u_sample, sampled_drafts, "")
    logits = last_dim_contiguous(target_logits)
    q = last_dim_contiguous(draft_probs) if sampled_drafts else logits
    mask, stride_mb, stride_mk = mask_strides(vocab_mask, logits)
    n = draft_counts(num_drafts, B, K, dev)
    seed, offset, ua, us = randomness(seed, offset, u_accept, u_sample, B, dev, unused=logits)
    cfg = row_config(V, chunk=chunk, cand=cand, block=tile)
    params = (temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous())
    # a fused multiply-add would round otherwise than torch (a * p - q) and than the sampling kernel
    meta = dict(HAS_MASK=vocab_mask is not None, enable_fp_fusion=False, **launch_options(8), **cfg)
    described = rows_in_parallel_by_default(B, K1, dev) if rows_in_parallel is None else rows_in_parallel
    if described:
        R = B * K1
        fscratch, iscratch = row_scratch(R, cfg, dev)
        desc_f = torch.empty(R, 5, dtype=torch.float32, device=dev)
        desc_i = torch.empty(R, 2, dtype=torch.int32, device=dev)
        cand_ids = torch.empty(R, cfg["CAND"], dtype=torch.int32, device=dev)
        cand_w = torch.empty(R, cfg["CAND"], dtype=torch.float32, device=dev)
        part_m, part_arg, parts = scan_parts(logits, (logits.stride(0), logits.stride(1)), mask, (stride_mb, stride_mk),
                                             n, params[0], params[1], fscratch, R, K1, parts, vocab_mask is not None,
                                             cfg, greedy=method == "greedy")
        _describe_rows_kernel[(R,)](
            logits, mask, n, *params, desc_f, desc_i, cand_ids, cand_w, fscratch, iscratch, part_m, part_arg, parts,
            K, V, logits.stride(0), logits.stride(1), stride_mb, stride_mk, GREEDY=method == "greedy", **meta)
    else:
        fscratch, iscratch = row_scratch(B, cfg, dev)
        desc_f = desc_i = cand_ids = cand_w = fscratch  # not read
    block = block_size(block_v, V)
    _chain_logits_kernel[(B,)](
        logits, mask, q, draft_tokens.contiguous(), n, *params, seed, offset, ua, us,
        tokens, num_accepted, fscratch, iscratch, desc_f, desc_i, cand_ids, cand_w,
        K, V, logits.stride(0), logits.stride(1), stride_mb, stride_mk, q.stride(0), q.stride(1),
        ua.stride(0), us.stride(0),
        METHOD=METHODS[method], DESCRIBED=described, PHILOX=philox, BLOCK_V=block,
        BLOCK_K=triton.next_power_of_2(K1), **meta,
    )
    return tokens, num_accepted


def rows_in_parallel_by_default(B: int, K1: int, device: torch.device) -> bool:
    """Whether ``B`` chains of ``K1`` rows describe their rows in a first, row-parallel kernel: on a GPU,
    when there are at most two rows per SM (one wave of the two programs an SM holds, ``launch_options``).
    A request's program then walks in about the time of a row instead of one row per accepted draft, at the
    cost of reading the rows past its stop, which the GPU (mostly idle at such sizes) has time for. Off a GPU
    (the interpreter) never: there the rows past the stop would only cost time."""
    if device.type != "cuda":
        return False
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count >= B * K1
