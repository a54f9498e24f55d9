"""Tree verification: one Triton program per request walks its draft tree along ``first_child`` / ``next_sibling``.

One kernel, each method's walk a helper beside its reference, serves :func:`specsampler.verify.tree.verify_tree`
(target rows are probabilities) and :func:`specsampler.verify.tree.verify_tree_from_logits` (``FROM_LOGITS``: a row
of logits is processed when the walk first needs it, through its descriptor, :mod:`specsampler.kernels.describe`); a
walk reads only the rows it visits. Rows that change (residuals, ``Mb``, ``Ms``) live unnormalised in a per-request
scratch buffer with their divisor kept aside (``w / divisor`` is the reference's normalised row, the same float32
division); a residual without mass leaves its row as it was. Draws are by inversion as
:func:`specsampler.sampling.masses.sample_by_inversion`, sums taken block by block in float32 (a result can
differ from the reference's only where rounding decides), without fused multiply-add. Randomness: the acceptance
test of node c is ``STREAM_ACCEPT`` index c, the draw at node v ``STREAM_SAMPLE`` index v (:mod:`specsampler.rng`).
"""

from __future__ import annotations

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
    describe,
    draw_from,
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
from .rows import STAGES, invert, kept_weights, launch_options, load_logits, row_config, row_stride, scan_row

METHODS = {"greedy": 0, "target_only": 1, "rrs": 2, "traversal": 3}  # the kernel's METHOD
DRAFT_SAMPLING = ("iid", "without_replacement")
_TINY_MASS = tl.constexpr(1e-30)  # the reference's clamp of divisors


@triton.jit
def _row(src, held_row, held, div, offs, mask):
    """A row at ``offs`` (0 outside ``mask``): read in place at ``src`` while ``held`` is 0, else
    ``held_row / div`` from the scratch buffer. Only the source in use is loaded."""
    a = tl.load(src + offs, mask=tl.where(held == 0, mask, False), other=0.0).to(tl.float32)
    w = tl.load(held_row + offs, mask=tl.where(held != 0, mask, False), other=0.0).to(tl.float32)
    return tl.where(held != 0, tl.div_rn(w, div), a)


@triton.jit
def _target(row, mask_row, held_row, held, div, offs, V, m, inv_t, tau, id_cut, w_min, z,
            FROM_LOGITS: tl.constexpr, HAS_MASK: tl.constexpr):
    """A target row at ``offs`` (any shape; 0 from V on) that starts as the node's target: while
    ``held`` is 0 the input row (probabilities; from logits the processed probability
    ``kept weight / z`` through the row's descriptor), else ``held_row / div`` (the scratch row).
    Only the source in use is loaded; the descriptor is unused for probabilities."""
    if FROM_LOGITS:
        x = load_logits(row, mask_row, offs, tl.where(held == 0, V, 0), HAS_MASK)
        p = tl.div_rn(kept_weights(x, offs, m, inv_t, tau, id_cut, w_min), tl.maximum(z, TINY))
        w = tl.load(held_row + offs, mask=tl.where(held != 0, offs < V, False), other=0.0)
        p = tl.where(held != 0, tl.div_rn(w, div), p)
    else:
        p = _row(row, held_row, held, div, offs, offs < V)
    return p


@triton.jit(noinline=True)
def _residual_pass(row, mask_row, held_row, held, div, m, inv_t, tau, cut, w_min, z, a, residual, out_row, q_row,
                   q_held_row, q_held, q_div, xc, V, FROM_LOGITS: tl.constexpr, WO: tl.constexpr,
                   HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over a node's target row t (:func:`_target`, through its descriptor from logits) and a draft row
    q (:func:`_row`): with ``residual``, ``w = max(a * t - q, 0)`` into ``out_row``; without replacement (``WO``),
    q with token ``xc`` zeroed into ``q_held_row`` (in place when q is held there). Returns the masses of w and of
    the new q. rrs's rejection of a child (a = 1: ``1 * t`` is t exactly) and traversal's deletion of a leaf.
    Call it between barriers: it rewrites rows other threads read."""
    cols = tl.arange(0, BLOCK_V)
    mass = tl.full((), 0.0, tl.float32)
    q_mass = tl.full((), 0.0, tl.float32)
    end = V if WO else tl.where(residual != 0, V, 0)
    for start in tl.range(0, end, BLOCK_V, num_stages=STAGES):
        offs = start + cols
        mask = offs < V
        q = _row(q_row, q_held_row, q_held, q_div, offs, mask)
        if residual != 0:
            d = a * _target(row, mask_row, held_row, held, div, offs, V, m, inv_t, tau, cut, w_min, z, FROM_LOGITS,
                            HAS_MASK) - q
            w = tl.where(d < 0.0, 0.0, d)
            tl.store(out_row + offs, w, mask=mask)
            mass += tl.sum(w, 0)
        if WO:
            q = tl.where(offs == xc, 0.0, q)
            tl.store(q_held_row + offs, q, mask=mask)
            q_mass += tl.sum(q, 0)
    return mass, q_mass


@triton.jit
def _clamp_divisor(s):
    """``s.clamp(min=1e-30)`` (NaN stays NaN)."""
    return tl.where(s < _TINY_MASS, _TINY_MASS, s)


@triton.jit(noinline=True)
def _invert(src, held_row, held, div, u, V, BLOCK_V: tl.constexpr):
    """Categorical draw by inversion of ``u`` from the weights of a row (see :func:`_row`):
    the first id of positive weight whose cumulative weight exceeds ``u * total``, else the
    last id of positive weight, 0 for a row without mass. int64. The search stops reading at
    the block holding the token."""
    cols = tl.arange(0, BLOCK_V)
    total = tl.full((), 0.0, tl.float32)
    for start in tl.range(0, V, BLOCK_V, num_stages=STAGES):
        offs = start + cols
        total += tl.sum(_row(src, held_row, held, div, offs, offs < V), 0)
    t = u * tl.where(total < 0.0, 0.0, total)
    carry = tl.full((), 0.0, tl.float32)
    found = tl.zeros((), tl.int32) + V
    last = tl.full((), 0, tl.int32)
    start = tl.full((), 0, tl.int32)
    while (start < V) & (found == V):
        offs = start + cols
        w = _row(src, held_row, held, div, offs, offs < V)
        positive = (w > 0) & (offs < V)
        cum = carry + tl.cumsum(w, 0)
        found = tl.minimum(found, tl.min(tl.where(positive & (cum > t), offs, V), 0))
        last = tl.maximum(last, tl.max(tl.where(positive, offs, 0), 0))
        carry += tl.sum(w, 0)
        start += BLOCK_V
    return tl.where(found < V, found, last).to(tl.int64)


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
def _pick(vec, slots, j):
    """``vec[j]`` of a small per-slot vector."""
    return tl.sum(tl.where(slots == j, vec, 0), 0)


@triton.jit
def _child_with(x_b, ns_b, kid, y):
    """The first of the siblings from ``kid`` on whose token is ``y`` (in ``[0, V)``, so only a usable
    child can carry it), -1 if none (int64)."""
    found = tl.full((), -1, tl.int64)
    while (kid >= 0) & (found < 0):
        found = tl.where(tl.load(x_b + kid) == y, kid, found)
        kid = tl.load(ns_b + kid)
    return found


@triton.jit
def _store_result(path_ptr, n_ptr, y_ptr, tokens_ptr, last_ptr, x_b, b, D, slots, path, n, y):
    """Request ``b``'s outputs: the path's first ``D + 1`` slots, the accepted count ``n``, the token ``y``, and
    what :class:`specsampler.TreeResult` gives from them (as ``verify.tree._assemble`` does for the PyTorch
    walks; here, because at a small batch each of its ~10 small ops would be a launch): the emitted tokens (the
    drafts of the accepted nodes after the root, then ``y``, then -1) and the last accepted node."""
    out = path_ptr + b * (D + 1)
    tl.store(out + slots, path, mask=slots <= D)
    tl.store(n_ptr + b, n.to(tl.int64))
    tl.store(y_ptr + b, y)
    tl.debug_barrier()  # the path is stored before it is read back one slot on, by other threads
    node = tl.load(out + slots + 1, mask=slots < n, other=0)  # slot i < n <= D: the (i+1)-th accepted node
    draft = tl.load(x_b + node, mask=slots < n, other=-1)
    tl.store(tokens_ptr + b * (D + 1) + slots, tl.where(slots < n, draft, tl.where(slots == n, y, -1)),
             mask=slots <= D)
    tl.store(last_ptr + b, tl.sum(tl.where(slots == n, path, 0), axis=0).to(tl.int64))


@triton.jit
def _node_rows(target, rows, b, v, FROM_LOGITS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Node ``v`` of request ``b``: its target row and vocabulary mask row (the target row where there is none,
    never read as a mask)."""
    target_row = row_ptr(target, b, v)
    vocab_mask_row = mask_row(rows, target_row, b, v, HAS_MASK) if FROM_LOGITS else target_row
    return target_row, vocab_mask_row


@triton.jit
def _draws_walk(target, rows, randomness, keys, b, x_b, fc_b, ns_b, slots, N, V, GREEDY: tl.constexpr,
                FROM_LOGITS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
                ROWS: tl.constexpr):
    """greedy / target_only (:func:`specsampler.verify.walks.walk_draws`; plain loop
    :func:`specsampler.verify.reference.tree_draws`): y at the current node (the argmax, or the draw: from logits
    that of :func:`specsampler.kernels.describe.draw`, as ``sample_from_logits`` draws), then move to its first child
    carrying y (children are matched by their token ids alone). Returns ``(path, n, y)``."""
    path = tl.where(slots == 0, 0, -1).to(tl.int64)
    v = tl.full((), 0, tl.int64)
    n = tl.full((), 0, tl.int32)
    y = tl.full((), 0, tl.int64)
    walking = n == 0
    while walking:
        row, vocab_mask_row = _node_rows(target, rows, b, v, FROM_LOGITS, HAS_MASK)
        has_mass = walking  # a row without mass draws 0, of target probability 0: no child carrying it is accepted
        if not FROM_LOGITS:
            if GREEDY:
                y = argmax(row, V, BLOCK_V).to(tl.int64)
            else:
                y = _invert(row, row, 0, 1.0, uniform(randomness, keys, v, SAMPLE), V, BLOCK_V)
                has_mass = tl.load(row + y).to(tl.float32) > 0.0
        else:
            fscratch_row, iscratch_row = scratch_rows(rows, b, ROWS)
            if GREEDY:
                _, arg = scan_row(row, vocab_mask_row, V, 1.0, False, fscratch_row, HAS_MASK, ROWS.CHUNK,
                                  ROWS.BLOCK_CHUNKS, ROWS.NCH_P2)
                y = arg.to(tl.int64)
            else:
                d = describe(rows, b * N + v, row, vocab_mask_row, V, fscratch_row, iscratch_row, HAS_MASK, ROWS)
                token, w_y = draw_from(uniform(randomness, keys, v, SAMPLE), d, row, vocab_mask_row, V,
                                       fscratch_row, HAS_MASK, ROWS)
                y = token.to(tl.int64)
                has_mass = w_y > 0.0
        found = tl.where(has_mass, _child_with(x_b, ns_b, tl.load(fc_b + v), y), -1)
        walking = found >= 0
        if walking:
            n += 1
            path = tl.where(slots == n, found, path)
            v = found
    return path, n, y


@triton.jit
def _rrs_walk(target, draft_probs, rows, randomness, keys, b, x_b, fc_b, ns_b, scratch_ptr, slots, N, V,
              FROM_LOGITS: tl.constexpr, WO: tl.constexpr, HAS_MASK: tl.constexpr,
              BLOCK_V: tl.constexpr, ROWS: tl.constexpr):
    """Recursive rejection sampling down the tree (:func:`specsampler.verify.walks.walk_rrs`; plain loop
    :func:`specsampler.verify.reference.tree_rrs`).

    At each node the children are tested with ``r(x_c)`` and ``q(x_c)``; a rejection sets
    ``r = norm(max(r - q, 0))`` (one pass over r and q, unchanged without mass) and, without replacement,
    removes ``x_c`` from the shared q; the correction is drawn from r at the last node. The residual r starts
    as the target row: from logits in registers at the kept tokens (``r_vec``, when the descriptor holds them,
    a rejection then gathers q there only), else read in place (through the descriptor) until a rejection
    writes it to scratch rows 0 and 1 (one current, one to write the next into). Scratch row 2 holds the
    shared q (without replacement). Returns ``(path, n, y)``.
    """
    scratch = scratch_ptr + b * (3 if WO else 2) * V
    q_held_row = scratch + 2 * V
    path = tl.where(slots == 0, 0, -1).to(tl.int64)
    v = tl.full((), 0, tl.int64)
    n = tl.full((), 0, tl.int32)
    y = tl.full((), 0, tl.int64)
    walking = n == 0
    while walking:
        target_row, vocab_mask_row = _node_rows(target, rows, b, v, FROM_LOGITS, HAS_MASK)
        if FROM_LOGITS:
            fscratch_row, iscratch_row = scratch_rows(rows, b, ROWS)
            m, inv_t, tau, cut, w_min, z, regs, cand_ids, cand_w = describe(
                rows, b * N + v, target_row, vocab_mask_row, V, fscratch_row, iscratch_row, HAS_MASK, ROWS)
        else:  # probabilities: no descriptor, nothing in registers
            m = tl.full((), 0.0, tl.float32)
            inv_t, tau, w_min, z = m, m, m, m
            regs = tl.full((), 0, tl.int32)
            cut = regs
            cand_ids = tl.zeros((1,), tl.int32) + V
            cand_w = tl.zeros((1,), tl.float32)
        cand_in = cand_ids < V
        r_vec = tl.div_rn(cand_w, tl.maximum(z, TINY))  # r = p_v at the kept tokens (regs != 0)
        r_held = tl.full((), 0, tl.int32)  # otherwise r = p_v until a rejection changes it
        r_buf = tl.full((), 0, tl.int32)
        r_div = tl.full((), 1.0, tl.float32)
        kid = tl.load(fc_b + v)
        q_shared = row_ptr(draft_probs, b, tl.maximum(kid, 0))  # the first child's q, shared by its siblings
        q_held = tl.full((), 0, tl.int32)
        q_div = tl.full((), 1.0, tl.float32)
        chosen = tl.full((), -1, tl.int64)
        while (kid >= 0) & (chosen < 0):
            x = tl.load(x_b + kid)
            inside = (x >= 0) & (x < V)
            xc = tl.minimum(tl.maximum(x, 0), V - 1).to(tl.int32)
            q_row = q_shared if WO else row_ptr(draft_probs, b, kid)
            q_x = _row(q_row, q_held_row, q_held, q_div, xc, xc >= 0)
            r_x = tl.full((), 0.0, tl.float32)
            if regs != 0:
                r_x = tl.sum(tl.where(cand_ids == xc, r_vec, 0.0), 0)
            else:
                r_x = _target(target_row, vocab_mask_row, scratch + r_buf * V, r_held, r_div, xc, V, m, inv_t, tau,
                              cut, w_min, z, FROM_LOGITS, HAS_MASK)
            u = uniform(randomness, keys, kid, ACCEPT)
            if inside & (u * q_x < r_x) & (r_x > 0.0):  # r(x) = 0: never, whatever q(x) says
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
                # a pass over the row: for a residual not in registers, and for the new mass of the shared q
                r_mass, q_mass = _residual_pass(target_row, vocab_mask_row, scratch + r_buf * V, r_held, r_div, m,
                                                inv_t, tau, cut, w_min, z, 1.0, regs == 0, scratch + out * V, q_row,
                                                q_held_row, q_held, q_div, xc, V, FROM_LOGITS, WO, HAS_MASK, BLOCK_V)
                mass = tl.where(regs == 0, r_mass, mass)
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
            u = uniform(randomness, keys, v, SAMPLE)
            if regs != 0:
                y = _draw_in_regs(u, cand_ids, r_vec)
            elif r_held != 0:
                y = _invert(target_row, scratch + r_buf * V, r_held, r_div, u, V, BLOCK_V)
            else:  # r = p_v
                if FROM_LOGITS:  # the draw of the descriptor (the chunk masses are still in fscratch)
                    fscratch_row, _ = scratch_rows(rows, b, ROWS)
                    token, _ = draw_from(u, (m, inv_t, tau, cut, w_min, z, regs, cand_ids, cand_w), target_row,
                                         vocab_mask_row, V, fscratch_row, HAS_MASK, ROWS)
                    y = token.to(tl.int64)
                else:
                    y = _invert(target_row, scratch + r_buf * V, r_held, r_div, u, V, BLOCK_V)
    return path, n, y


@triton.jit
def _traversal_walk(target, draft_probs, rows, randomness, keys, b, x_b, fc_b, ns_b, scratch_ptr, slots, N, V, D,
                    FROM_LOGITS: tl.constexpr, WO: tl.constexpr, HAS_MASK: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Traversal verification (:func:`specsampler.verify.walks.walk_traversal`, its ``push`` and ``descend``;
    plain loop :func:`specsampler.verify.reference.tree_traversal`): the first leaf in depth-first order is
    tested; a rejected leaf is deleted and its parent updated, ``Mb = norm(max(a Mb - q, 0))``, ``a = ...``.

    The current leftmost path fills slots 0..top. The top slot's state is in scalars: ``node``,
    ``a_top``, its ``Mb`` (``held``: 0 while it is the node's target row, else scratch row
    ``buf`` over ``div``) and its ``Ms`` (without replacement: the draft row ``q_src`` it starts
    from, ``q_held``, ``q_div``; scratch row D+2+slot). The slots below are in small per-slot
    vectors, written when a child is pushed above them and read back when they are the top
    again. Scratch rows 0..D+1 hold ``Mb``: one per slot (``mb_buf``) and a ``spare``, which a
    held ``Mb``'s update is written to and then swapped in (without mass the old one stays).
    From logits each slot also holds its row's descriptor (``d_*``): the top's row is described
    when its first child is pushed, and its ``Mb`` read through it while ``held`` is 0; a leaf's row is
    described only when it is the accepted last node. Pushing a node is two scalar loads, deleting a leaf one
    pass over its parent's ``Mb`` and q; nodes after the accepted node's subtree are never touched.
    Returns ``(path, n, y)``.
    """
    scratch = scratch_ptr + b * ((2 * D + 3) if WO else (D + 2)) * V
    ms_scratch = scratch + (D + 2) * V
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
            target_row, vocab_mask_row = _node_rows(target, rows, b, node, FROM_LOGITS, HAS_MASK)
            if first:  # the top gets children: Ms starts as its first child's q, Mb = p is described
                q_src = pending
                q_held = tl.full((), 0, tl.int32)
                q_div = tl.full((), 1.0, tl.float32)
                if FROM_LOGITS:
                    fscratch_row, iscratch_row = scratch_rows(rows, b, ROWS)
                    d_m, d_inv_t, d_tau, d_cut, d_w_min, d_z, _, _, _ = describe(
                        rows, b * N + node, target_row, vocab_mask_row, V, fscratch_row, iscratch_row, HAS_MASK,
                        ROWS)
            x = tl.load(x_b + pending)
            xc = tl.minimum(tl.maximum(x, 0), V - 1).to(tl.int32)
            mb_x = _target(target_row, vocab_mask_row, scratch + buf * V, held, div, xc, V, d_m, d_inv_t, d_tau,
                           d_cut, d_w_min, d_z, FROM_LOGITS, HAS_MASK)
            if WO:
                q_x = _row(row_ptr(draft_probs, b, q_src), ms_scratch + top * V, q_held, q_div, xc, xc >= 0)
            else:
                q_x = tl.load(row_ptr(draft_probs, b, pending) + xc).to(tl.float32)
            num = a_top * mb_x
            ratio = tl.where(num > 0.0, tl.where(num >= q_x, 1.0, tl.div_rn(num, _clamp_divisor(q_x))), 0.0)
            at = slots == top
            stack = tl.where(at, node, stack)
            a = tl.where(at, a_top, a)
            mb_held = tl.where(at, held, mb_held)
            mb_buf = tl.where(at, buf, mb_buf)
            mb_div = tl.where(at, div, mb_div)
            if FROM_LOGITS:
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
        accepted = (top == 0) | (uniform(randomness, keys, node, ACCEPT) < a_top)
        if ~accepted:  # delete the leaf; its parent (the new top): w = max(a Mb - q, 0), Mb = norm(w), a = ...
            leaf = node
            mb_buf = tl.where(slots == top, buf, mb_buf)  # the leaf's slot keeps its scratch row
            top -= 1
            node = _pick(stack, slots, top)
            a_top = _pick(a, slots, top)
            held = _pick(mb_held, slots, top)
            buf = _pick(mb_buf, slots, top)
            div = _pick(mb_div, slots, top)
            if FROM_LOGITS:
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
            target_row, vocab_mask_row = _node_rows(target, rows, b, node, FROM_LOGITS, HAS_MASK)
            q_row = row_ptr(draft_probs, b, q_src if WO else leaf)
            out = tl.where(held != 0, spare, buf)
            xc = tl.minimum(tl.maximum(tl.load(x_b + leaf), 0), V - 1)
            tl.debug_barrier()  # every thread has read Ms(x) of the pushes before Ms is rewritten in place
            mass, q_mass = _residual_pass(target_row, vocab_mask_row, scratch + buf * V, held, div, d_m, d_inv_t,
                                          d_tau, d_cut, d_w_min, d_z, a_top, 1, scratch + out * V, q_row,
                                          ms_scratch + top * V, q_held, q_div, xc, V, FROM_LOGITS, WO, HAS_MASK,
                                          BLOCK_V)
            tl.debug_barrier()
            has_mass = mass > 0.0
            spare = tl.where(has_mass & (held != 0), buf, spare)
            buf = tl.where(has_mass, out, buf)
            held = tl.where(has_mass, 1, held)
            div = tl.where(has_mass, _clamp_divisor(mass), div)
            # a = 0 (never accepted: an out-of-range token, or p(x) = 0) stays 0, as in the reference
            keep = has_mass & (a_top > 0.0)
            a_top = tl.where(keep, tl.div_rn(mass, tl.where(keep, mass + 1.0 - a_top, 1.0)), 0.0)
            if WO:
                q_held = tl.full((), 1, tl.int32)
                q_div = _clamp_divisor(q_mass)
            pending = tl.load(ns_b + leaf)
            first = pending < -1
        steps += 1
    target_row, vocab_mask_row = _node_rows(target, rows, b, node, FROM_LOGITS, HAS_MASK)
    u = uniform(randomness, keys, node, SAMPLE)
    y = tl.full((), 0, tl.int64)
    if FROM_LOGITS:
        if held != 0:
            y = _invert(target_row, scratch + buf * V, held, div, u, V, BLOCK_V)
        else:  # Mb = p of the last node: its draw (a leaf's row is read here for the first time)
            fscratch_row, iscratch_row = scratch_rows(rows, b, ROWS)
            d = describe(rows, b * N + node, target_row, vocab_mask_row, V, fscratch_row, iscratch_row, HAS_MASK,
                         ROWS)
            token, _ = draw_from(u, d, target_row, vocab_mask_row, V, fscratch_row, HAS_MASK, ROWS)
            y = token.to(tl.int64)
    else:
        y = _invert(target_row, scratch + buf * V, held, div, u, V, BLOCK_V)
    path = tl.where(slots < top, stack, tl.where(slots == top, node, -1))
    return path, top, y


@triton.jit(do_not_specialize=["target_stride_b", "target_stride_row", "draft_probs_stride_b", "draft_probs_stride_row",
                               "u_accept_stride", "u_sample_stride", "philox", "vocab_mask_stride_b",
                               "vocab_mask_stride_row", "N", "D"],
            do_not_specialize_on_alignment=["draft_tokens_ptr", "first_child_ptr", "next_sibling_ptr", "seed_ptr",
                                            "offset_ptr", "u_accept_ptr", "u_sample_ptr", "temperature_ptr",
                                            "top_k_ptr", "top_p_ptr", "min_p_ptr", "path_ptr", "num_accepted_ptr",
                                            "y_ptr", "tokens_ptr", "last_ptr"])
def _tree_kernel(
    target_ptr,  # float32/bf16/fp16 [B, N, V], last dim contiguous: probabilities, or logits (FROM_LOGITS)
    target_stride_b,
    target_stride_row,
    draft_probs_ptr,  # float [B, N, V], last dim contiguous (rrs, traversal), else None: row c = q of node c
    draft_probs_stride_b,
    draft_probs_stride_row,
    draft_tokens_ptr,  # int64 [B, N], contiguous: node v's token
    first_child_ptr,  # int64 [B, N], contiguous: -1 = none
    next_sibling_ptr,  # int64 [B, N], contiguous: -1 = none
    seed_ptr,  # int64 [B] (philox; else a stand-in, not read)
    offset_ptr,  # int64 [B] (philox; else a stand-in)
    u_accept_ptr,  # float32 [B, N] (rrs, traversal without philox), else a stand-in
    u_accept_stride,
    u_sample_ptr,  # float32 [B, N] (without philox, but greedy), else a stand-in
    u_sample_stride,
    philox,  # 1: the uniforms come from Philox keys; 0: from u_accept / u_sample
    vocab_mask_ptr,  # uint8 [B * N, V] or [B, N, V], last dim contiguous (HAS_MASK), else None
    vocab_mask_stride_b,
    vocab_mask_stride_row,
    temperature_ptr,  # float32 [B * N], request-major (FROM_LOGITS), else None
    top_k_ptr,  # int64 [B * N] (FROM_LOGITS), else None
    top_p_ptr,  # float32 [B * N] (FROM_LOGITS), else None
    min_p_ptr,  # float32 [B * N] (FROM_LOGITS), else None
    fscratch_ptr,  # float32 [B, 3 * NCH_P2]: rows.row_scratch (FROM_LOGITS), else None
    iscratch_ptr,  # int64 [B, 3 * CAND] (FROM_LOGITS), else None
    scratch_ptr,  # float32 [B, rows, V] (rrs, traversal: scratch()), else None
    path_ptr,  # out int64 [B, D+1]
    num_accepted_ptr,  # out int64 [B]
    y_ptr,  # out int64 [B]
    tokens_ptr,  # out int64 [B, D+1]: the emitted tokens
    last_ptr,  # out int64 [B]: the last accepted node
    N,  # nodes per tree
    V,  # vocabulary size
    D,  # the tree's max_depth
    METHOD: tl.constexpr,  # METHODS[method]
    FROM_LOGITS: tl.constexpr,  # target rows are logits processed by their row's parameters
    WO: tl.constexpr,  # drafts drawn without replacement (rrs, traversal)
    HAS_MASK: tl.constexpr,  # vocab_mask_ptr is given
    ALIGNED: tl.constexpr,  # the row strides are multiples of 16 (rows.aligned_strides)
    BLOCK_V: tl.constexpr,  # vocabulary entries per block of the passes over probabilities and residuals
    BLOCK_D: tl.constexpr,  # slots of the path (depth_slots: D + 2 at least)
    ROWS: tl.constexpr,  # RowConfig (FROM_LOGITS), else None
):
    """One program per request: the walk of ``METHOD`` (the kernel of :func:`specsampler.verify.tree.verify_tree`
    and of :func:`specsampler.verify.tree.verify_tree_from_logits`; reference: their walks in
    :mod:`specsampler.verify.walks`, plain loops in :mod:`specsampler.verify.reference`)."""
    target = Strided(target_ptr, row_stride(target_stride_b, ALIGNED), row_stride(target_stride_row, ALIGNED))
    draft_probs = Strided(draft_probs_ptr, row_stride(draft_probs_stride_b, ALIGNED),
                          row_stride(draft_probs_stride_row, ALIGNED))
    randomness = Randomness(seed_ptr, offset_ptr, u_accept_ptr, u_accept_stride, u_sample_ptr, u_sample_stride,
                            philox)
    mask = Strided(vocab_mask_ptr, row_stride(vocab_mask_stride_b, ALIGNED), row_stride(vocab_mask_stride_row, ALIGNED))
    rows = LogitRows(mask, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_ptr, iscratch_ptr)
    b = tl.program_id(0).to(tl.int64)
    keys = request_keys(randomness, b)
    x_b = draft_tokens_ptr + b * N
    fc_b = first_child_ptr + b * N
    ns_b = next_sibling_ptr + b * N
    slots = tl.arange(0, BLOCK_D)
    if METHOD <= 1:
        path, n, y = _draws_walk(target, rows, randomness, keys, b, x_b, fc_b, ns_b, slots, N, V, METHOD == 0,
                                 FROM_LOGITS, HAS_MASK, BLOCK_V, ROWS)
    elif METHOD == 2:
        path, n, y = _rrs_walk(target, draft_probs, rows, randomness, keys, b, x_b, fc_b, ns_b, scratch_ptr, slots, N,
                               V, FROM_LOGITS, WO, HAS_MASK, BLOCK_V, ROWS)
    else:
        path, n, y = _traversal_walk(target, draft_probs, rows, randomness, keys, b, x_b, fc_b, ns_b, scratch_ptr,
                                     slots, N, V, D, FROM_LOGITS, WO, HAS_MASK, BLOCK_V, BLOCK_D, ROWS)
    _store_result(path_ptr, num_accepted_ptr, y_ptr, tokens_ptr, last_ptr, x_b, b, D, slots, path, n, y)


def _launch(op: str, target: Tensor, draft_tokens: Tensor, first_child: Tensor, next_sibling: Tensor,
            draft_probs: Tensor | None, method: str, draft_sampling: str, max_depth: int, seed, offset,
            u_accept: Tensor | None, u_sample: Tensor | None, block_v: int | None,
            logits: dict | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Both launchers: ``logits`` holds :func:`verify_tree_from_logits`' own arguments (None: probabilities).
    Raises ``ValueError`` (prefixed by ``op``) on an unknown method or draft sampling, or on missing inputs."""
    if method not in METHODS:
        raise ValueError(f"{op}: method must be one of {tuple(METHODS)}, got {method!r}")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"{op}: draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    stochastic_drafts = method in ("rrs", "traversal")
    if stochastic_drafts and draft_probs is None:
        raise ValueError(f"{op}: method {method!r} needs draft_probs")
    check_randomness(op, method, seed, u_accept, u_sample, stochastic_drafts, " for rrs and traversal")
    B, N, V = target.shape
    D, dev = max_depth, target.device
    outs = tuple(torch.empty(shape, dtype=torch.int64, device=dev) for shape in ((B, D + 1), (B,), (B,), (B, D + 1),
                                                                                  (B,)))
    path, num_accepted, y, tokens, last = outs
    if B == 0:
        return outs
    target = last_dim_contiguous(target)
    kernel_args = dict(
        target_ptr=target, target_stride_b=target.stride(0), target_stride_row=target.stride(1),
        draft_tokens_ptr=draft_tokens.long().contiguous(), first_child_ptr=first_child.long().contiguous(),
        next_sibling_ptr=next_sibling.long().contiguous(), **randomness(seed, offset, u_accept, u_sample, B, dev),
        path_ptr=path, num_accepted_ptr=num_accepted, y_ptr=y, tokens_ptr=tokens, last_ptr=last, N=N, V=V, D=D,
        BLOCK_V=block_v or block_size(1024, V), BLOCK_D=depth_slots(D),
        enable_fp_fusion=False,  # a * Mb - q rounded as torch rounds it
    )
    wo = draft_sampling == "without_replacement"
    draft_probs = last_dim_contiguous(draft_probs) if stochastic_drafts else None
    mask = None if logits is None or logits["vocab_mask"] is None else last_dim_contiguous(logits["vocab_mask"])
    if logits is None:
        kernel_args.update(**NO_LOGIT_ROWS, FROM_LOGITS=False, HAS_MASK=False, ROWS=None)
    else:
        cfg = row_config(V, chunk=logits["chunk"], cand=logits["cand"])
        params = logits["temperature"], logits["top_k"], logits["top_p"], logits["min_p"]
        kernel_args.update(**logit_rows(target, mask, *params, B, cfg), FROM_LOGITS=True, HAS_MASK=mask is not None,
                           ROWS=RowConfig(**cfg), **launch_options(logits["num_warps"]))
    _tree_kernel[(B,)](draft_probs_ptr=draft_probs, draft_probs_stride_b=strides(draft_probs)[0],
                       draft_probs_stride_row=strides(draft_probs)[1],
                       scratch_ptr=scratch(method, wo, B, D, V, dev) if stochastic_drafts else None,
                       METHOD=METHODS[method], WO=wo and stochastic_drafts,
                       ALIGNED=aligned_rows(target, draft_probs, mask), **kernel_args)
    return outs


def depth_slots(D: int) -> int:
    """The kernel's ``BLOCK_D`` for trees of depth ``D``: slots for the path and the traversal's per-depth
    state (``D + 2``), in two buckets, 32 (depth up to 30) and 256 (up to 254: a tree of 255 nodes), so that
    the depths a server sees compile one kernel; deeper trees take the next power of 2."""
    return 32 if D + 2 <= 32 else max(256, triton.next_power_of_2(D + 2))


def scratch(method: str, wo: bool, B: int, D: int, V: int, device) -> Tensor:
    """The per-request float32 scratch rows of ``rrs`` (r twice, q without replacement) or ``traversal``
    (Mb per slot and a spare, Ms per slot without replacement): ``[B, rows, V]``."""
    rows = (3 if wo else 2) if method == "rrs" else (2 * D + 3 if wo else D + 2)
    return torch.empty(B, rows, V, dtype=torch.float32, device=device)


def verify_tree(
    target_probs: Tensor,
    draft_tokens: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    draft_probs: Tensor | None,
    method: str,
    draft_sampling: str,
    max_depth: int,
    seed: Tensor | int | None = None,
    offset: Tensor | int | None = None,
    u_accept: Tensor | None = None,
    u_sample: Tensor | None = None,
    *,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Verify one draft tree per request (the walks of :func:`specsampler.verify.tree.verify_tree`).

    Inputs are taken as validated by the reference's checks (a valid :class:`specsampler.TokenTree`);
    nothing here syncs with the host, and every allocation depends on shapes only.

    Args:
        target_probs: float ``[B, N, V]`` (float32, or fp16/bf16 read as float32), last dim contiguous (any other
            strides): row v = the target distribution after node v.
        draft_tokens: int64 ``[B, N]``: node v's token (the root's unused); a token outside
            ``[0, V)`` is never accepted.
        first_child, next_sibling: int64 ``[B, N]``: the tree's child lists (``TokenTree``
            fields), ``-1`` = none; siblings are tried in link order.
        draft_probs: float ``[B, N, V]``: row c = the distribution node c's token was drawn from
            (``rrs``, ``traversal``; without replacement the first child's row is its siblings'
            shared q); None for ``greedy`` and ``target_only``.
        method: ``"greedy"``, ``"target_only"``, ``"rrs"`` or ``"traversal"``.
        draft_sampling: ``"iid"`` or ``"without_replacement"`` (``rrs``, ``traversal``).
        max_depth: ``D``, the tree's ``max_depth`` (paths have ``D + 1`` entries).
        seed, offset: int64 ``[B]`` (or ints): Philox keys; the uniforms are computed in the
            kernel at the counters of :mod:`specsampler.rng` (offset None = 0). When ``seed``
            is None the uniforms are given instead:
        u_accept: float32 ``[B, N]``: ``STREAM_ACCEPT`` uniforms by node (``rrs``, ``traversal``).
        u_sample: float32 ``[B, N]``: ``STREAM_SAMPLE`` uniforms by node (all but ``greedy``).
        block_v: vocabulary entries per block (a power of 2; default ``min(1024, V)`` rounded up).
    Returns:
        path: int64 ``[B, D+1]``: node ids of the accepted path from the root, ``-1`` after.
        num_accepted: int64 ``[B]``: accepted drafts.
        y: int64 ``[B]``: the correction or bonus token drawn at the last accepted node.
        tokens: int64 ``[B, D+1]``: the emitted tokens (:attr:`specsampler.TreeResult.tokens`).
        last_node: int64 ``[B]``: the last accepted node (:attr:`specsampler.TreeResult.last_node`).
    """
    return _launch("specsampler.kernels.tree.verify_tree", target_probs, draft_tokens, first_child, next_sibling,
                   draft_probs, method, draft_sampling, max_depth, seed, offset, u_accept, u_sample, block_v, None)


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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Process the target logits of the rows the walk visits and verify one draft tree per request
    (the walks of :func:`specsampler.verify.tree.verify_tree_from_logits`).

    The arguments :func:`verify_tree` shares mean the same here (``target_logits`` for ``target_probs``:
    float32/bf16/fp16, row v = the target's logits after node v), and:

    Args:
        temperature: float32 ``[B * N]`` (0 = greedy); top_k: int64 ``[B * N]`` (<= 0 or >= V: off);
            top_p: float32 ``[B * N]`` (>= 1: off); min_p: float32 ``[B * N]``: the parameters of each
            row, request-major (row ``b * N + v``), as :meth:`specsampler.SamplingParams.rows` gives
            them. ``greedy`` does not read them.
        vocab_mask: bool ``[B * N, V]`` (request-major) or ``[B, N, V]``, True = allowed; any strides but
            the last dim's (so an ``expand`` of a per-request or per-vocabulary mask needs no copy). None:
            all allowed.
        block_v: vocabulary entries per block of the residual passes at most (a power of 2).
        chunk, cand: tuning of the row descriptors (:func:`specsampler.kernels.rows.row_config`); keep
            those of :func:`specsampler.kernels.sampling.sample_from_logits` for ``target_only`` to
            draw its tokens bit for bit.
        num_warps: warps per program.
    """
    logits = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, vocab_mask=vocab_mask, chunk=chunk,
                  cand=cand, num_warps=num_warps)
    return _launch("specsampler.kernels.tree.verify_tree_from_logits", target_logits, draft_tokens, first_child,
                   next_sibling, draft_probs, method, draft_sampling, max_depth, seed, offset, u_accept, u_sample,
                   block_size(block_v, target_logits.shape[-1]), logits)
