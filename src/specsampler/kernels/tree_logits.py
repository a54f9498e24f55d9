"""Tree verification from logits: one Triton program per request (see :func:`specsampler.verify_tree_from_logits`).

The target at node v of request b is row v of its logits processed by the row's parameters (vocab
mask, temperature (0 = greedy), top-k, top-p, min-p). Each program walks its request's tree along
the ``first_child`` / ``next_sibling`` links as the kernels of :mod:`specsampler.kernels.tree` do,
and describes a row (:func:`specsampler.kernels.rows.describe_row`: no sort of the vocabulary, one
pass over the row in the common cases, the kept tokens then held in registers) only when the walk
needs it, so rows of nodes the walk does not visit are never read (logits, mask or draft rows):

- ``greedy``: at each node of the path one argmax pass over the masked logits (the parameters are
  not read); the children are matched by their token ids alone.
- ``target_only``: at each node of the path the row's descriptor and the draw of
  :func:`specsampler.kernels.rows.draw` with the uniform of that node: the token
  :func:`specsampler.sample_from_logits` draws for that row with that uniform.
- ``rrs``: at each node of the path the row's descriptor; children are tested with ``r(x_c)``
  (from the registers, or one logit) and ``q(x_c)``. When the kept tokens are in registers the
  residual ``r`` stays there (it is 0 wherever ``p`` is): a rejection gathers ``q`` at the kept
  tokens only (without replacement also one pass over the shared ``q``, for its new mass).
  Otherwise a rejection is one pass over the logits (the first time) or the residual, and ``q``.
- ``traversal``: the current leftmost path's slots hold ``Mb``, ``Ms`` (without replacement) and
  ``a``, as in :mod:`specsampler.kernels.tree`, and each slot the descriptor of its node's row,
  found when its first child is pushed; ``Mb = p`` is read through it (one logit per push, one
  pass per deletion) until a deletion changes it. A leaf's row is described only when it is the
  accepted last node.

Rows that change (``r``, ``Mb``, and ``q`` / ``Ms`` without replacement) live in a per-request
scratch buffer as in :mod:`specsampler.kernels.tree`: unnormalised, with their divisor kept
aside, and swapped in only when a residual has mass. Processed probabilities are
``kept weight / z``; their sums are taken in another order than torch's, so a result can differ
from the reference's only where float rounding decides (a uniform within rounding of a
cumulative boundary, an acceptance ratio within rounding of the uniform). Kernels are launched
without floating-point contraction, as the reference computes ``a * Mb - q``.

Randomness (:mod:`specsampler.rng`): the acceptance test of node c (``rrs``: child c tested;
``traversal``: leaf c) is ``STREAM_ACCEPT`` index c; the draw at node v is ``STREAM_SAMPLE`` index v.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import (
    ACCEPT,
    SAMPLE,
    TINY,
    block_size,
    describe,
    last_dim_contiguous,
    mask_strides,
    randomness,
    request_keys,
    uniform,
)
from .rows import draw, invert, kept_weights, load_logits, row_config, row_scratch, scan_row
from .tree import _child_with, _clamp_divisor, _invert, _pick, _row, _store_result, check_args, outputs, scratch


@triton.jit
def _current(logits_row, mask_row, held_row, held, div, offs, V, m, inv_t, tau, id_cut, w_min, z,
             HAS_MASK: tl.constexpr):
    """A row that starts as a processed row at ``offs`` (any shape; 0 from V on): while ``held`` is 0
    the processed probability ``kept weight / z`` (logits read), else ``held_row / div`` (the scratch
    row read). Only the source in use is loaded."""
    x = load_logits(logits_row, mask_row, offs, tl.where(held == 0, V, 0), HAS_MASK)
    p = tl.div_rn(kept_weights(x, offs, m, inv_t, tau, id_cut, w_min), tl.maximum(z, TINY))
    w = tl.load(held_row + offs, mask=tl.where(held != 0, offs < V, False), other=0.0)
    return tl.where(held != 0, tl.div_rn(w, div), p)


@triton.jit
def _draw_in_regs(u, cand_ids, w):
    """Inversion of ``u`` over weights ``w`` at the increasing ids ``cand_ids`` (a row that is 0
    elsewhere): the first id of positive weight whose cumulative weight exceeds ``u * total``,
    else the last id of positive weight; 0 without mass (int64)."""
    total = tl.sum(w, 0)
    idx, _ = invert(w, u * total)
    token = tl.sum(tl.where(tl.arange(0, w.shape[0]) == idx, cand_ids, 0), 0)
    return tl.where(total > 0.0, token, 0).to(tl.int64)


@triton.jit
def _draws_kernel(
    logits_ptr, mask_ptr, x_ptr, fc_ptr, ns_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seed_ptr, offset_ptr, us_ptr, fscratch_ptr, iscratch_ptr, path_ptr, n_ptr, y_ptr,
    N, V, D, stride_lb, stride_ln, stride_mb, stride_mn,
    GREEDY: tl.constexpr, PHILOX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr, CAND: tl.constexpr,
    NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr,
):
    """greedy / target_only: y at the current node (argmax, or the draw), move to its first child carrying y."""
    b = tl.program_id(0).to(tl.int64)
    seed, offset = request_keys(seed_ptr, offset_ptr, b, PHILOX)
    l_b = logits_ptr + b * stride_lb
    mk_b = mask_ptr + b * stride_mb
    x_b = x_ptr + b * N
    fc_b = fc_ptr + b * N
    ns_b = ns_ptr + b * N
    us_b = us_ptr + b * N
    fscratch_row = fscratch_ptr + b * (3 * NCH_P2)
    iscratch_row = iscratch_ptr + b * (2 * CAND)
    slots = tl.arange(0, BLOCK_D)
    path = tl.where(slots == 0, 0, -1).to(tl.int64)
    v = tl.full((), 0, tl.int64)
    n = tl.full((), 0, tl.int32)
    y = tl.full((), 0, tl.int64)
    walking = n == 0
    while walking:
        logits_row = l_b + v * stride_ln
        mask_row = mk_b + v * stride_mn
        if GREEDY:
            _, arg = scan_row(logits_row, mask_row, V, 1.0, False, fscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
            y = arg.to(tl.int64)
        else:
            m, inv_t, tau, cut, w_min, z, regs, cand_ids, cand_w = describe(
                logits_row, mask_row, b * N + v, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
                iscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
            token, _ = draw(uniform(us_b, seed, offset, v, SAMPLE, PHILOX), m, inv_t, tau, cut, w_min, z, regs,
                            cand_ids, cand_w, logits_row, mask_row, V, fscratch_row, HAS_MASK, CHUNK, NCH_P2)
            y = token.to(tl.int64)
        found = _child_with(x_b, ns_b, tl.load(fc_b + v), y)
        walking = found >= 0
        if walking:
            n += 1
            path = tl.where(slots == n, found, path)
            v = found
    _store_result(path_ptr, n_ptr, y_ptr, b, D, slots, path, n, y)


@triton.jit
def _rrs_kernel(
    logits_ptr, mask_ptr, q_ptr, x_ptr, fc_ptr, ns_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seed_ptr, offset_ptr, ua_ptr, us_ptr, scratch_ptr, fscratch_ptr, iscratch_ptr, path_ptr, n_ptr, y_ptr,
    N, V, D, stride_lb, stride_ln, stride_mb, stride_mn, stride_qb, stride_qn,
    WO: tl.constexpr, PHILOX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr, CAND: tl.constexpr,
    NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr,
):
    """Recursive rejection sampling down the tree.

    At each node the residual ``r`` starts as the processed row: in registers at the kept tokens
    (``r_vec``, when the descriptor holds them), else read through the descriptor until a
    rejection writes it to scratch rows 0 and 1 (one current, one to write the next into).
    Scratch row 2 holds the shared ``q`` (without replacement).
    """
    b = tl.program_id(0).to(tl.int64)
    seed, offset = request_keys(seed_ptr, offset_ptr, b, PHILOX)
    l_b = logits_ptr + b * stride_lb
    mk_b = mask_ptr + b * stride_mb
    q_b = q_ptr + b * stride_qb
    x_b = x_ptr + b * N
    fc_b = fc_ptr + b * N
    ns_b = ns_ptr + b * N
    ua_b = ua_ptr + b * N
    us_b = us_ptr + b * N
    scratch = scratch_ptr + b * (3 if WO else 2) * V
    q_held_row = scratch + 2 * V
    fscratch_row = fscratch_ptr + b * (3 * NCH_P2)
    iscratch_row = iscratch_ptr + b * (2 * CAND)
    cols = tl.arange(0, BLOCK_V)
    slots = tl.arange(0, BLOCK_D)
    path = tl.where(slots == 0, 0, -1).to(tl.int64)
    v = tl.full((), 0, tl.int64)
    n = tl.full((), 0, tl.int32)
    y = tl.full((), 0, tl.int64)
    walking = n == 0
    while walking:
        logits_row = l_b + v * stride_ln
        mask_row = mk_b + v * stride_mn
        m, inv_t, tau, cut, w_min, z, regs, cand_ids, cand_w = describe(
            logits_row, mask_row, b * N + v, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
            iscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
        cand_in = cand_ids < V
        r_vec = tl.div_rn(cand_w, tl.maximum(z, TINY))  # r = p_v at the kept tokens (regs != 0)
        r_held = tl.full((), 0, tl.int32)  # otherwise r = p_v until a rejection changes it
        r_buf = tl.full((), 0, tl.int32)
        r_div = tl.full((), 1.0, tl.float32)
        kid = tl.load(fc_b + v)
        q_shared = q_b + tl.maximum(kid, 0) * stride_qn  # the first child's q, shared by its siblings
        q_held = tl.full((), 0, tl.int32)
        q_div = tl.full((), 1.0, tl.float32)
        chosen = tl.full((), -1, tl.int64)
        while (kid >= 0) & (chosen < 0):
            x = tl.load(x_b + kid)
            inside = (x >= 0) & (x < V)
            xc = tl.minimum(tl.maximum(x, 0), V - 1).to(tl.int32)
            q_row = q_shared if WO else q_b + kid * stride_qn
            q_x = _row(q_row, q_held_row, q_held, q_div, xc, xc >= 0)
            r_x = tl.full((), 0.0, tl.float32)
            if regs != 0:
                r_x = tl.sum(tl.where(cand_ids == xc, r_vec, 0.0), 0)
            else:
                r_x = _current(logits_row, mask_row, scratch + r_buf * V, r_held, r_div, xc, V, m, inv_t, tau, cut,
                               w_min, z, HAS_MASK)
            u = uniform(ua_b, seed, offset, kid, ACCEPT, PHILOX)
            if inside & (u * q_x < r_x):
                chosen = kid
            else:  # r = norm(max(r - q, 0)) (unchanged without mass); without replacement q loses x
                tl.debug_barrier()  # every thread has read r(x_c), q(x_c) before q is rewritten in place
                mass = tl.full((), 0.0, tl.float32)
                if regs != 0:  # r - q is 0 outside the kept tokens: q is needed there only
                    q_c = _row(q_row, q_held_row, q_held, q_div, tl.where(cand_in, cand_ids, 0), cand_in)
                    d_c = r_vec - q_c
                    w_c = tl.where(d_c < 0.0, 0.0, d_c)
                    mass = tl.sum(w_c, 0)
                    r_vec = tl.where(mass > 0.0, tl.div_rn(w_c, _clamp_divisor(mass)), r_vec)
                    tl.debug_barrier()  # q gathered before the pass below rewrites it in place
                out = tl.where(r_held != 0, 1 - r_buf, r_buf)
                q_mass = tl.full((), 0.0, tl.float32)
                end = tl.where(regs == 0, V, 0)  # a pass over the row: for a residual not in registers,
                if WO:  # and for the new mass of the shared q
                    end = V
                for start in range(0, end, BLOCK_V):
                    offs = start + cols
                    mask = offs < V
                    q = _row(q_row, q_held_row, q_held, q_div, offs, mask)
                    if regs == 0:
                        d = _current(logits_row, mask_row, scratch + r_buf * V, r_held, r_div, offs, V, m, inv_t,
                                     tau, cut, w_min, z, HAS_MASK) - q
                        w = tl.where(d < 0.0, 0.0, d)
                        tl.store(scratch + out * V + offs, w, mask=mask)
                        mass += tl.sum(w, 0)
                    if WO:
                        q = tl.where(offs == xc, 0.0, q)
                        tl.store(q_held_row + offs, q, mask=mask)
                        q_mass += tl.sum(q, 0)
                tl.debug_barrier()
                if regs == 0:
                    has_mass = mass > 0.0
                    r_buf = tl.where(has_mass, out, r_buf)
                    r_div = tl.where(has_mass, _clamp_divisor(mass), r_div)
                    r_held = tl.where(has_mass, 1, r_held)
                if WO:
                    q_held = tl.full((), 1, tl.int32)
                    q_div = _clamp_divisor(q_mass)
                kid = tl.load(ns_b + kid)
        walking = chosen >= 0
        if walking:
            n += 1
            path = tl.where(slots == n, chosen, path)
            v = chosen
        else:
            u = uniform(us_b, seed, offset, v, SAMPLE, PHILOX)
            if regs != 0:
                y = _draw_in_regs(u, cand_ids, r_vec)
            elif r_held != 0:
                y = _invert(logits_row, scratch + r_buf * V, r_held, r_div, u, V, BLOCK_V)
            else:  # r = p_v: the draw of the descriptor (the chunk masses are still in fscratch)
                token, _ = draw(u, m, inv_t, tau, cut, w_min, z, regs, cand_ids, cand_w, logits_row, mask_row, V,
                                fscratch_row, HAS_MASK, CHUNK, NCH_P2)
                y = token.to(tl.int64)
    _store_result(path_ptr, n_ptr, y_ptr, b, D, slots, path, n, y)


@triton.jit
def _traversal_kernel(
    logits_ptr, mask_ptr, q_ptr, x_ptr, fc_ptr, ns_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seed_ptr, offset_ptr, ua_ptr, us_ptr, scratch_ptr, fscratch_ptr, iscratch_ptr, path_ptr, n_ptr, y_ptr,
    N, V, D, stride_lb, stride_ln, stride_mb, stride_mn, stride_qb, stride_qn,
    WO: tl.constexpr, PHILOX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr, CAND: tl.constexpr,
    NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr,
):
    """Traversal verification: the first leaf in depth-first order is tested; a rejected leaf
    is deleted and its parent updated.

    As :func:`specsampler.kernels.tree._traversal_kernel` (the top slot's state in scalars, the
    slots below in small per-slot vectors, ``Mb`` in scratch rows 0..D+1 once held, ``Ms`` in
    rows D+2+slot), plus each slot's row descriptor (``d_*``): the top's row is described when
    its first child is pushed, and its ``Mb`` read through it while ``held`` is 0.
    """
    b = tl.program_id(0).to(tl.int64)
    seed, offset = request_keys(seed_ptr, offset_ptr, b, PHILOX)
    l_b = logits_ptr + b * stride_lb
    mk_b = mask_ptr + b * stride_mb
    q_b = q_ptr + b * stride_qb
    x_b = x_ptr + b * N
    fc_b = fc_ptr + b * N
    ns_b = ns_ptr + b * N
    ua_b = ua_ptr + b * N
    us_b = us_ptr + b * N
    scratch = scratch_ptr + b * ((2 * D + 3) if WO else (D + 2)) * V
    ms_scratch = scratch + (D + 2) * V
    fscratch_row = fscratch_ptr + b * (3 * NCH_P2)
    iscratch_row = iscratch_ptr + b * (2 * CAND)
    cols = tl.arange(0, BLOCK_V)
    slots = tl.arange(0, BLOCK_D)
    stack = tl.full((BLOCK_D,), -1, tl.int64)
    a = tl.zeros((BLOCK_D,), tl.float32)
    mb_held = tl.zeros((BLOCK_D,), tl.int32)
    mb_buf = slots
    mb_div = tl.full((BLOCK_D,), 1.0, tl.float32)
    ms_src = tl.zeros((BLOCK_D,), tl.int64)
    ms_held = tl.zeros((BLOCK_D,), tl.int32)
    ms_div = tl.full((BLOCK_D,), 1.0, tl.float32)
    s_m = tl.zeros((BLOCK_D,), tl.float32)
    s_inv_t = tl.full((BLOCK_D,), 1.0, tl.float32)
    s_tau = tl.zeros((BLOCK_D,), tl.float32)
    s_cut = tl.zeros((BLOCK_D,), tl.int32)
    s_w_min = tl.zeros((BLOCK_D,), tl.float32)
    s_z = tl.zeros((BLOCK_D,), tl.float32)
    top = tl.full((), 0, tl.int32)  # the root, a(root) = 1, Mb = p_root
    node = tl.full((), 0, tl.int64)
    a_top = tl.full((), 1.0, tl.float32)
    held = tl.full((), 0, tl.int32)
    buf = tl.full((), 0, tl.int32)
    div = tl.full((), 1.0, tl.float32)
    q_src = tl.full((), 0, tl.int64)
    q_held = tl.full((), 0, tl.int32)
    q_div = tl.full((), 1.0, tl.float32)
    d_m = tl.full((), 0.0, tl.float32)
    d_inv_t = tl.full((), 1.0, tl.float32)
    d_tau = tl.full((), 0.0, tl.float32)
    d_cut = tl.full((), 0, tl.int32)
    d_w_min = tl.full((), 0.0, tl.float32)
    d_z = tl.full((), 0.0, tl.float32)
    spare = tl.zeros((), tl.int32) + D + 1
    pending = tl.load(fc_b)  # the next node to push: a first child, or the sibling of a deleted leaf
    first = pending >= 0  # whether it is a first child (its q starts its parent's Ms; its parent is described)
    accepted = pending < -1
    steps = tl.full((), 0, tl.int32)
    while (~accepted) & (steps <= N):  # each step deletes a node: N steps at most
        while pending >= 0:  # push `pending` above the top, then first children down to a leaf
            if first:  # the top gets children: Ms starts as its first child's q, Mb = p is described
                q_src = pending
                q_held = tl.full((), 0, tl.int32)
                q_div = tl.full((), 1.0, tl.float32)
                d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, _, _, _ = describe(
                    l_b + node * stride_ln, mk_b + node * stride_mn, b * N + node, V, temperature_ptr, top_k_ptr,
                    top_p_ptr, min_p_ptr, fscratch_row, iscratch_row,
                    HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
            x = tl.load(x_b + pending)
            xc = tl.minimum(tl.maximum(x, 0), V - 1).to(tl.int32)
            mb_x = _current(l_b + node * stride_ln, mk_b + node * stride_mn, scratch + buf * V, held, div, xc, V, d_m,
                            d_inv_t, d_tau, d_cut, d_w_min, d_z, HAS_MASK)
            if WO:
                q_x = _row(q_b + q_src * stride_qn, ms_scratch + top * V, q_held, q_div, xc, xc >= 0)
            else:
                q_x = tl.load(q_b + pending * stride_qn + xc).to(tl.float32)
            num = a_top * mb_x
            ratio = tl.where(num > 0.0, tl.where(num >= q_x, 1.0, tl.div_rn(num, _clamp_divisor(q_x))), 0.0)
            at = slots == top
            stack = tl.where(at, node, stack)
            a = tl.where(at, a_top, a)
            mb_held = tl.where(at, held, mb_held)
            mb_buf = tl.where(at, buf, mb_buf)
            mb_div = tl.where(at, div, mb_div)
            s_m = tl.where(at, d_m, s_m)
            s_inv_t = tl.where(at, d_inv_t, s_inv_t)
            s_tau = tl.where(at, d_tau, s_tau)
            s_cut = tl.where(at, d_cut, s_cut)
            s_w_min = tl.where(at, d_w_min, s_w_min)
            s_z = tl.where(at, d_z, s_z)
            if WO:
                ms_src = tl.where(at, q_src, ms_src)
                ms_held = tl.where(at, q_held, ms_held)
                ms_div = tl.where(at, q_div, ms_div)
            top += 1
            node = pending
            a_top = tl.where((x >= 0) & (x < V), ratio, 0.0)
            held = tl.full((), 0, tl.int32)
            buf = _pick(mb_buf, slots, top)
            div = tl.full((), 1.0, tl.float32)
            pending = tl.load(fc_b + node)
            first = pending >= 0
        accepted = (top == 0) | (uniform(ua_b, seed, offset, node, ACCEPT, PHILOX) < a_top)
        if ~accepted:  # delete the leaf; its parent (the new top): w = max(a Mb - q, 0), Mb = norm(w), a = ...
            leaf = node
            mb_buf = tl.where(slots == top, buf, mb_buf)  # the leaf's slot keeps its scratch row
            top -= 1
            node = _pick(stack, slots, top)
            a_top = _pick(a, slots, top)
            held = _pick(mb_held, slots, top)
            buf = _pick(mb_buf, slots, top)
            div = _pick(mb_div, slots, top)
            d_m = _pick(s_m, slots, top)
            d_inv_t = _pick(s_inv_t, slots, top)
            d_tau = _pick(s_tau, slots, top)
            d_cut = _pick(s_cut, slots, top)
            d_w_min = _pick(s_w_min, slots, top)
            d_z = _pick(s_z, slots, top)
            if WO:
                q_src = _pick(ms_src, slots, top)
                q_held = _pick(ms_held, slots, top)
                q_div = _pick(ms_div, slots, top)
            q_row = q_b + (q_src if WO else leaf) * stride_qn
            out = tl.where(held != 0, spare, buf)
            xc = tl.minimum(tl.maximum(tl.load(x_b + leaf), 0), V - 1)
            mass = tl.full((), 0.0, tl.float32)
            q_mass = tl.full((), 0.0, tl.float32)
            tl.debug_barrier()  # every thread has read Ms(x) of the pushes before Ms is rewritten in place
            for start in range(0, V, BLOCK_V):
                offs = start + cols
                mask = offs < V
                q = _row(q_row, ms_scratch + top * V, q_held, q_div, offs, mask)
                mb = _current(l_b + node * stride_ln, mk_b + node * stride_mn, scratch + buf * V, held, div, offs, V,
                              d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, HAS_MASK)
                d = a_top * mb - q
                w = tl.where(d < 0.0, 0.0, d)
                tl.store(scratch + out * V + offs, w, mask=mask)
                mass += tl.sum(w, 0)
                if WO:
                    q = tl.where(offs == xc, 0.0, q)
                    tl.store(ms_scratch + top * V + offs, q, mask=mask)
                    q_mass += tl.sum(q, 0)
            tl.debug_barrier()
            has_mass = mass > 0.0
            spare = tl.where(has_mass & (held != 0), buf, spare)
            buf = tl.where(has_mass, out, buf)
            held = tl.where(has_mass, 1, held)
            div = tl.where(has_mass, _clamp_divisor(mass), div)
            a_top = tl.where(has_mass, tl.div_rn(mass, tl.where(has_mass, mass + 1.0 - a_top, 1.0)), 0.0)
            if WO:
                q_held = tl.full((), 1, tl.int32)
                q_div = _clamp_divisor(q_mass)
            pending = tl.load(ns_b + leaf)
            first = pending < -1
        steps += 1
    u = uniform(us_b, seed, offset, node, SAMPLE, PHILOX)
    y = tl.full((), 0, tl.int64)
    if held != 0:
        y = _invert(l_b + node * stride_ln, scratch + buf * V, held, div, u, V, BLOCK_V)
    else:  # Mb = p of the last node: its draw (a leaf's row is read here for the first time)
        logits_row = l_b + node * stride_ln
        mask_row = mk_b + node * stride_mn
        m, inv_t, tau, cut, w_min, z, regs, cand_ids, cand_w = describe(
            logits_row, mask_row, b * N + node, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
            iscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
        token, _ = draw(u, m, inv_t, tau, cut, w_min, z, regs, cand_ids, cand_w, logits_row, mask_row, V,
                        fscratch_row, HAS_MASK, CHUNK, NCH_P2)
        y = token.to(tl.int64)
    path = tl.where(slots < top, stack, tl.where(slots == top, node, -1))
    _store_result(path_ptr, n_ptr, y_ptr, b, D, slots, path, top, y)


def verify_tree_from_logits(
    target_logits: Tensor,
    draft_tokens: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    draft_probs: Tensor | None,
    method: str,
    draft_sampling: str,
    max_depth: int,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    vocab_mask: Tensor | None = None,
    seed: Tensor | int | None = None,
    offset: Tensor | int | None = None,
    u_accept: Tensor | None = None,
    u_sample: Tensor | None = None,
    *,
    block_v: int = 1024,
    chunk: int = 64,
    cand: int = 256,
    num_warps: int = 8,
) -> tuple[Tensor, Tensor, Tensor]:
    """Process the target logits of the rows the walk visits and verify one draft tree per request
    (the walks of :func:`specsampler.verify_tree_from_logits`).

    Inputs are taken as validated by the reference's checks (a valid :class:`specsampler.TokenTree`);
    nothing here syncs with the host, and every allocation depends on shapes only.

    Args:
        target_logits: float32/bf16/fp16 ``[B, N, V]``, last dim contiguous (any other strides): row v
            = the target's logits after node v.
        draft_tokens: int64 ``[B, N]``: node v's token (the root's unused); a token outside ``[0, V)``
            is never accepted.
        first_child, next_sibling: int64 ``[B, N]``: the tree's child lists (``TokenTree`` fields),
            ``-1`` = none; siblings are tried in link order.
        draft_probs: float ``[B, N, V]``, last dim contiguous: row c = the distribution node c's token
            was drawn from (``rrs``, ``traversal``; without replacement the first child's row is its
            siblings' shared q); None for ``greedy`` and ``target_only``.
        method: ``"greedy"``, ``"target_only"``, ``"rrs"`` or ``"traversal"``.
        draft_sampling: ``"iid"`` or ``"without_replacement"`` (``rrs``, ``traversal``).
        max_depth: ``D``, the tree's ``max_depth`` (paths have ``D + 1`` entries).
        temperature: float32 ``[B * N]`` (0 = greedy); top_k: int64 ``[B * N]`` (<= 0 or >= V: off);
            top_p: float32 ``[B * N]`` (>= 1: off); min_p: float32 ``[B * N]``: the parameters of each
            row, request-major (row ``b * N + v``), as :meth:`specsampler.SamplingParams.rows` gives
            them. ``greedy`` does not read them.
        vocab_mask: bool ``[B * N, V]`` (request-major) or ``[B, N, V]``, True = allowed; any strides but
            the last dim's (so an ``expand`` of a per-request or per-vocabulary mask needs no copy). None:
            all allowed.
        seed, offset: int64 ``[B]`` (or ints): Philox keys; the uniforms are computed in the kernel at
            the counters of :mod:`specsampler.rng` (offset None = 0). When ``seed`` is None the
            uniforms are given instead:
        u_accept: float32 ``[B, N]``: ``STREAM_ACCEPT`` uniforms by node (``rrs``, ``traversal``).
        u_sample: float32 ``[B, N]``: ``STREAM_SAMPLE`` uniforms by node (all but ``greedy``).
        block_v: vocabulary entries per block of the residual passes at most (a power of 2).
        chunk, cand: tuning of the row descriptors (:func:`specsampler.kernels.rows.row_config`); keep
            those of :func:`specsampler.kernels.sampling.sample_from_logits` for ``target_only`` to
            draw its tokens bit for bit.
        num_warps: warps per program.
    Returns:
        path: int64 ``[B, D+1]``: node ids of the accepted path from the root, ``-1`` after.
        num_accepted: int64 ``[B]``: accepted drafts.
        y: int64 ``[B]``: the correction or bonus token drawn at the last accepted node.
    """
    op = "specsampler.kernels.tree_logits.verify_tree_from_logits"
    stochastic_drafts, philox = check_args(op, method, draft_sampling, draft_probs, seed, u_accept, u_sample)
    B, N, V = target_logits.shape
    D, dev = max_depth, target_logits.device
    outs = outputs(B, D, dev)
    if B == 0:
        return outs
    logits = last_dim_contiguous(target_logits)
    q = last_dim_contiguous(draft_probs) if stochastic_drafts else logits
    mask, stride_mb, stride_mn = mask_strides(vocab_mask, logits)
    links = draft_tokens.long().contiguous(), first_child.long().contiguous(), next_sibling.long().contiguous()
    params = temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous()
    seed, offset, ua, us = randomness(seed, offset, u_accept, u_sample, B, dev, unused=logits)
    cfg = row_config(V, chunk=chunk, cand=cand)
    fscratch, iscratch = row_scratch(B, cfg, dev)
    meta = dict(PHILOX=philox, HAS_MASK=vocab_mask is not None, BLOCK_D=triton.next_power_of_2(D + 2),
                num_warps=num_warps, enable_fp_fusion=False, **cfg)
    strides = logits.stride(0), logits.stride(1), stride_mb, stride_mn
    if not stochastic_drafts:
        _draws_kernel[(B,)](logits, mask, *links, *params, seed, offset, us, fscratch, iscratch, *outs, N, V, D,
                            *strides, GREEDY=method == "greedy", **meta)
        return outs
    wo = draft_sampling == "without_replacement"
    kernel = _rrs_kernel if method == "rrs" else _traversal_kernel
    kernel[(B,)](logits, mask, q, *links, *params, seed, offset, ua, us, scratch(method, wo, B, D, V, dev), fscratch,
                 iscratch, *outs, N, V, D, *strides, q.stride(0), q.stride(1), WO=wo, BLOCK_V=block_size(block_v, V),
                 **meta)
    return outs
