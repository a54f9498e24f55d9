"""Tree verification from logits: one Triton program per request (see :func:`specsampler.verify_tree_from_logits`).

The target at node v of request b is row v of its logits processed by the row's parameters (vocab
mask, temperature (0 = greedy), top-k, top-p, min-p). Each program walks its request's tree along
the ``first_child`` / ``next_sibling`` links as the kernels of :mod:`specsampler.kernels.tree` do,
and describes a row (:func:`specsampler.kernels.rows.describe_row`: no sort of the vocabulary, one
pass over the row in the common cases, the kept tokens then held in registers) only when the walk
needs it, so rows of nodes the walk does not visit are never read (logits, mask or draft rows):

- ``greedy`` (the draws kernel of :mod:`specsampler.kernels.tree` with ``FROM_LOGITS``, as the two
  below): at each node of the path one argmax pass over the masked logits (the parameters are not
  read); the children are matched by their token ids alone.
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
from torch import Tensor

from .common import (
    block_size,
    mask_strides,
)
from .rows import launch_options, row_config, row_scratch
from .tree import (
    _draws_kernel,
    _rrs_kernel,
    _traversal_kernel,
    prepare,
    scratch,
)


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
    outs, run = prepare("specsampler.kernels.tree_logits.verify_tree_from_logits", target_logits, draft_tokens,
                        first_child, next_sibling, draft_probs, method, draft_sampling, max_depth, seed, offset,
                        u_accept, u_sample)
    if run is None:
        return outs
    logits, q, D, dev = run.target, run.q, max_depth, target_logits.device
    B, N, V = logits.shape
    seed, offset, ua, us = run.keys
    mask, stride_mb, stride_mn = mask_strides(vocab_mask, logits)
    params = temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous()
    cfg = row_config(V, chunk=chunk, cand=cand)
    fscratch, iscratch = row_scratch(B, cfg, dev)
    meta = dict(FROM_LOGITS=True, PHILOX=run.philox, HAS_MASK=vocab_mask is not None, BLOCK_V=block_size(block_v, V),
                BLOCK_D=triton.next_power_of_2(D + 2), enable_fp_fusion=False, **launch_options(num_warps), **cfg)
    strides = logits.stride(0), logits.stride(1), stride_mb, stride_mn
    if not run.stochastic_drafts:
        _draws_kernel[(B,)](logits, mask, *run.links, *params, seed, offset, us, fscratch, iscratch, *outs, N, V, D,
                            *strides, GREEDY=method == "greedy", **meta)
        return outs
    wo = draft_sampling == "without_replacement"
    args = (logits, mask, q, *run.links, *params, seed, offset, ua, us, scratch(method, wo, B, D, V, dev), fscratch,
            iscratch, *outs, N, V, D, *strides, q.stride(0), q.stride(1))
    kernel = _rrs_kernel if method == "rrs" else _traversal_kernel
    kernel[(B,)](*args, WO=wo, **meta)
    return outs
