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
- ``rrs`` (the kernel of :mod:`specsampler.kernels.tree` with ``FROM_LOGITS``): at each node of
  the path the row's descriptor; children are tested with ``r(x_c)`` (from the registers, or one
  logit) and ``q(x_c)``. When the kept tokens are in registers the residual ``r`` stays there
  (it is 0 wherever ``p`` is): a rejection gathers ``q`` at the kept tokens only (without
  replacement also one pass over the shared ``q``, for its new mass). Otherwise a rejection is
  one pass over the logits (the first time) or the residual, and ``q``.
- ``traversal``: the kernel of :mod:`specsampler.kernels.tree` with ``FROM_LOGITS``: the current
  leftmost path's slots hold ``Mb``, ``Ms`` (without replacement) and ``a``, and each slot the
  descriptor of its node's row, found when its first child is pushed; ``Mb = p`` is read through
  it (one logit per push, one pass per deletion) until a deletion changes it. A leaf's row is
  described only when it is the accepted last node.

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
    SAMPLE,
    block_size,
    describe,
    last_dim_contiguous,
    mask_strides,
    randomness,
    request_keys,
    uniform,
)
from .rows import draw, row_config, row_scratch, scan_row
from .tree import (
    _child_with,
    _rrs_kernel,
    _store_result,
    _traversal_kernel,
    check_args,
    outputs,
    scratch,
)


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
    args = (logits, mask, q, *links, *params, seed, offset, ua, us, scratch(method, wo, B, D, V, dev), fscratch,
            iscratch, *outs, N, V, D, *strides, q.stride(0), q.stride(1))
    kernel = _rrs_kernel if method == "rrs" else _traversal_kernel
    kernel[(B,)](*args, FROM_LOGITS=True, WO=wo, BLOCK_V=block_size(block_v, V), **meta)
    return outs
