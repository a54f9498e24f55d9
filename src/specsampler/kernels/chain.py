"""Chain verification from probabilities: one Triton program per request (see :mod:`specsampler.chain`).

The program walks its chain from position 0 and stops reading at the first rejection: rows
after the position where the request stops are never loaded.

- ``token``: per draft, two scalar loads (``p_i(x_i)``, ``q_i(x_i)``); at the stop position one
  pass for the residual's mass and one search pass (which stops at the token found).
- ``block``: per draft position ``i > 0`` one pass over ``p_i`` and ``q_i`` for ``S_i`` (its rule
  needs every ``h_i``); positions after ``a_i`` drops to 0 cannot be taken and are not read; at
  ``tau`` the search pass.
- ``target_only``: per position one pass that both finds the row's mass and decides whether
  the draw equals the draft (so an accepted row is read once); the search pass only at the
  first mismatch.
- ``greedy``: per position one argmax pass.

Categorical draws are by inversion, as :func:`specsampler.processing.sample_by_inversion`: the
first id (in id order) of positive weight whose cumulative weight exceeds ``u * total``, else
the last id of positive weight (0 for a row without mass). Cumulative sums are taken block by
block in float32, so a draw can differ from the reference's only where float rounding decides.
Weights are clamped at 0 (the reference's rows are valid probabilities, so this changes nothing).

``expected_accepted`` of :class:`specsampler.chain.ChainResult` is not computed here: the caller
computes it in PyTorch from the scalars ``p_i(x_i)``, ``q_i(x_i)`` and, for ``block``, ``S_i`` of
every position (which reads the rows this kernel skips).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    ACCEPT,
    SAMPLE,
    argmax,
    block_size,
    check_randomness,
    last_dim_contiguous,
    randomness,
    request_keys,
    uniform,
)
from .rows import STAGES, launch_options

METHODS = {"token": 0, "block": 1, "target_only": 2, "greedy": 3}  # the kernel's METHOD


@triton.jit
def _weights(p_row, q_row, offs, end, a, use_q, HAS_Q: tl.constexpr):
    """``max(a * p - q, 0)`` at ``offs``, 0 from ``end`` on (not read); ``q`` is read only when ``use_q``.
    (Scalar conditions enter masks through ``end``, not ``&``: the interpreter mistypes broadcast scalar bools.)"""
    p = tl.load(p_row + offs, mask=offs < end, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(q_row + offs, mask=offs < tl.where(use_q, end, 0), other=0.0).to(tl.float32)
        return tl.maximum(a * p - q, 0.0)
    else:
        return tl.maximum(a * p, 0.0)


@triton.jit
def _scan(p_row, q_row, a, use_q, x, V, HAS_Q: tl.constexpr, WITH_X: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over the weights of a row (see :func:`_weights`).

    Returns ``(total, last, below_x, cum_x, pos_x)``: ``total`` is their sum, accumulated block by
    block as :func:`_search` accumulates it; ``last`` the last id of positive weight (0 if none).
    With ``WITH_X`` also what decides, once ``t = u * total`` is known, whether :func:`_search`
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
        w = _weights(p_row, q_row, offs, V, a, use_q, HAS_Q)
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
def _search(p_row, q_row, a, use_q, V, t, last, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """The first id of positive weight whose cumulative weight exceeds ``t``, else ``last``.
    Blocks after the one holding the token are not read."""
    total = tl.full((), 0.0, tl.float32)
    found = tl.full((), 0, tl.int1)
    y = last
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = _weights(p_row, q_row, offs, tl.where(found, 0, V), a, use_q, HAS_Q)
        first = tl.min(tl.where((w > 0) & (total + tl.cumsum(w, 0) > t), offs, V), 0)
        y = tl.where(found | (first == V), y, first)
        found = found | (first < V)
        total += tl.sum(w, 0)
    return y


@triton.jit
def _draft(x_row, i, kb, V):
    """Draft ``i`` as an int32 id when ``i < kb`` and it lies in ``[0, V)``, else -1 (never accepted)."""
    x = tl.load(x_row + i, mask=i < kb, other=-1)
    return tl.where((x >= 0) & (x < V), x, -1).to(tl.int32)


@triton.jit
def _ratio(num, den):
    """``min(1, num / den)`` with ``num <= 0 -> 0`` (as :func:`specsampler.chain._ratio`)."""
    return tl.where(num > 0, tl.where(num >= den, 1.0, num / tl.where(num >= den, 1.0, den)), 0.0)


@triton.jit
def _store_result(tokens_ptr, nacc_ptr, x_row, b, K, n, y, BLOCK_K: tl.constexpr):
    """Request ``b``'s outputs: its ``n`` accepted drafts (read from ``x_row``), then ``y``, then -1, and ``n``."""
    pos = tl.arange(0, BLOCK_K)
    drafts = tl.load(x_row + pos, mask=pos < n, other=-1)
    out = tl.where(pos < n, drafts, tl.where(pos == n, y.to(tl.int64), -1))
    tl.store(tokens_ptr + b * (K + 1) + pos, out, mask=pos <= K)
    tl.store(nacc_ptr + b, n.to(tl.int64))


@triton.jit
def _chain_kernel(
    p_ptr, q_ptr, x_ptr, nd_ptr, seed_ptr, offset_ptr, ua_ptr, us_ptr, tokens_ptr, nacc_ptr,
    K, V, stride_pb, stride_pk, stride_qb, stride_qk, stride_ua, stride_us,
    METHOD: tl.constexpr, HAS_Q: tl.constexpr, PHILOX: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kb = tl.minimum(tl.maximum(tl.load(nd_ptr + b), 0), K).to(tl.int32)
    seed, offset = request_keys(seed_ptr, offset_ptr, b, PHILOX)
    p_b = p_ptr + b * stride_pb
    q_b = q_ptr + b * stride_qb
    x_row = x_ptr + b * K
    ua_row = ua_ptr + b * stride_ua
    us_row = us_ptr + b * stride_us

    n = tl.full((), 0, tl.int32)  # accepted drafts
    y = tl.full((), 0, tl.int32)  # the correction or bonus token
    if METHOD == 0:  # token: scalar tests until the first rejection, then the residual (or p) at n
        go = n < kb
        while go:
            x = _draft(x_row, n, kb, V)
            ok = x >= 0
            p_x = tl.load(p_b + n * stride_pk + x, mask=ok, other=0.0).to(tl.float32)
            q_x = tl.load(q_b + n * stride_qk + x, mask=ok, other=0.0).to(tl.float32)
            accept = ok & (uniform(ua_row, seed, offset, n + 1, ACCEPT, PHILOX) * q_x < p_x)
            n += accept.to(tl.int32)
            go = accept & (n < kb)
        p_row = p_b + n * stride_pk
        q_row = q_b + n * stride_qk
        use_q = n < kb
        total, last, _, _, _ = _scan(p_row, q_row, 1.0, use_q, -1, V, HAS_Q, False, BLOCK_V)
        if use_q & (total <= 0.0):  # a residual without mass: draw from p itself
            use_q = n < 0
            total, last, _, _, _ = _scan(p_row, q_row, 1.0, use_q, -1, V, HAS_Q, False, BLOCK_V)
        t = uniform(us_row, seed, offset, n, SAMPLE, PHILOX) * total
        y = _search(p_row, q_row, 1.0, use_q, V, t, last, HAS_Q, BLOCK_V)
    elif METHOD == 1:  # block: a_i and h_i forward while a_i > 0; tau = the last i with eta_i < h_i
        a = tl.full((), 1.0, tl.float32)  # a_i at the loop's position i
        a_tau = tl.full((), 1.0, tl.float32)
        s_tau = tl.full((), 0.0, tl.float32)  # S_tau and the last id of w_tau's support, for tau > 0
        last_tau = tl.full((), 0, tl.int32)
        tau = tl.full((), 0, tl.int32)
        i = tl.full((), 0, tl.int32)
        go = i < kb
        while go:
            if i > 0:
                s, last, _, _, _ = _scan(p_b + i * stride_pk, q_b + i * stride_qk, a, i >= 0, -1, V, HAS_Q, False,
                                         BLOCK_V)
                h = tl.where(s > 0, s / tl.where(s > 0, s + 1 - a, 1.0), 0.0)
                take = uniform(ua_row, seed, offset, i, ACCEPT, PHILOX) < h
                tau = tl.where(take, i, tau)
                a_tau = tl.where(take, a, a_tau)
                s_tau = tl.where(take, s, s_tau)
                last_tau = tl.where(take, last, last_tau)
            x = _draft(x_row, i, kb, V)
            ok = x >= 0
            p_x = tl.load(p_b + i * stride_pk + x, mask=ok, other=0.0).to(tl.float32)
            q_x = tl.load(q_b + i * stride_qk + x, mask=ok, other=0.0).to(tl.float32)
            a = tl.where(ok, _ratio(a * p_x, q_x), 0.0)
            i += 1
            go = (i < kb) & (a > 0)
        # h at position kb is a_kb (h_0 = 1 when kb = 0); a stop before kb left a = 0 there
        at_end = (i == kb) & ((uniform(ua_row, seed, offset, kb, ACCEPT, PHILOX) < a) | (kb == 0))
        tau = tl.where(at_end, kb, tau)
        p_row = p_b + tau * stride_pk
        q_row = q_b + tau * stride_qk
        use_q = tau < kb
        if use_q & (tau == 0):  # S_0 is not needed for h_0 = 1: found only now
            s_tau, last_tau, _, _, _ = _scan(p_row, q_row, 1.0, use_q, -1, V, HAS_Q, False, BLOCK_V)
        use_q = use_q & (s_tau > 0)
        a_w = tl.where(use_q, a_tau, 1.0)
        if ~use_q:  # the bonus row, or a residual without mass: draw from p_tau
            s_tau, last_tau, _, _, _ = _scan(p_row, q_row, 1.0, use_q, -1, V, HAS_Q, False, BLOCK_V)
        t = uniform(us_row, seed, offset, tau, SAMPLE, PHILOX) * s_tau
        y = _search(p_row, q_row, a_w, use_q, V, t, last_tau, HAS_Q, BLOCK_V)
        n = tau
    elif METHOD == 2:  # target_only: draw y_i ~ p_i while it equals x_i; one pass per accepted row
        go = n >= 0
        t = tl.full((), 0.0, tl.float32)
        last = tl.full((), 0, tl.int32)
        while go:
            x = _draft(x_row, n, kb, V)
            total, last, below_x, cum_x, pos_x = _scan(p_b + n * stride_pk, q_b, 1.0, n < 0, x, V, HAS_Q, True,
                                                       BLOCK_V)
            t = uniform(us_row, seed, offset, n, SAMPLE, PHILOX) * total
            # _search at t gives the first positive id past t, else `last`: it is x when x is positive,
            # no earlier positive id is past t, and x is past t or the last; x = 0 for a row without mass
            drawn_x = (below_x <= t) & ((pos_x & ((cum_x > t) | (x == last))) | ((total <= 0.0) & (x == 0)))
            accept = (x >= 0) & drawn_x
            n += accept.to(tl.int32)
            go = accept
        y = _search(p_b + n * stride_pk, q_b, 1.0, n < 0, V, t, last, HAS_Q, BLOCK_V)
    else:  # greedy: y_i = argmax p_i while it equals x_i
        go = n >= 0
        while go:
            y = argmax(p_b + n * stride_pk, V, BLOCK_V)
            accept = (n < kb) & (y == _draft(x_row, n, kb, V))
            n += accept.to(tl.int32)
            go = accept

    _store_result(tokens_ptr, nacc_ptr, x_row, b, K, n, y, BLOCK_K)


def draft_counts(num_drafts: Tensor | None, B: int, K: int, device) -> Tensor:
    """The drafts of each request as the kernels read them: ``num_drafts`` contiguous, or int64 ``[B]`` of K."""
    return torch.full((B,), K, dtype=torch.int64, device=device) if num_drafts is None else num_drafts.contiguous()


def verify_chain(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    num_drafts: Tensor | None,
    method: str,
    seed: Tensor | None = None,
    offset: Tensor | None = None,
    u_accept: Tensor | None = None,
    u_sample: Tensor | None = None,
    *,
    block_v: int = 4096,
) -> tuple[Tensor, Tensor]:
    """Verify one draft chain per request (the kernel of :func:`specsampler.chain.verify_chain`).

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
    if method not in METHODS:
        raise ValueError(f"verify_chain kernel: method must be one of {tuple(METHODS)}, got {method!r}")
    B, K1, V = target_probs.shape
    K, dev = K1 - 1, target_probs.device
    tokens = torch.empty(B, K1, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return tokens, num_accepted
    philox = check_randomness("verify_chain kernel", method, seed, u_accept, u_sample, method in ("token", "block"), "")
    target = last_dim_contiguous(target_probs)
    q = target if draft_probs is None else last_dim_contiguous(draft_probs)
    n = draft_counts(num_drafts, B, K, dev)
    seed, offset, ua, us = randomness(seed, offset, u_accept, u_sample, B, dev, unused=target)
    block = block_size(block_v, V)
    _chain_kernel[(B,)](
        target, q, draft_tokens.contiguous(), n, seed, offset, ua, us, tokens, num_accepted,
        K, V, target.stride(0), target.stride(1), q.stride(0), q.stride(1),
        ua.stride(0), us.stride(0),
        METHOD=METHODS[method], HAS_Q=method in ("token", "block"), PHILOX=philox, BLOCK_V=block,
        BLOCK_K=triton.next_power_of_2(K1), **launch_options(8 if block >= 2048 else 4),
        enable_fp_fusion=False,  # a * p - q rounded as torch rounds it (no fused multiply-add)
    )
    return tokens, num_accepted
