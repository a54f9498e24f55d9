"""tokenspeed's chain verification ops (``tokenspeed_kernel``) on specsampler.

    from specsampler.compat.tokenspeed import (chain_speculative_sampling_target_only, verify_chain_greedy,
                                               verify_chain_target_sampled)

One draft chain per request, every output written in place where tokenspeed's kernels write. The op each
function maps to and the differences: docs/design.md, "Drop-in compatibility per peer", ``compat.tokenspeed``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import verify_chain
from ..validation import ValidationError
from .sglang import check, check_dims, local_ids
from .sglang.sampling import draw_with_coins

__all__ = ["chain_speculative_sampling_target_only", "verify_chain_greedy", "verify_chain_target_sampled"]


def _check_int32(op: str, **named: Tensor) -> None:
    for name, t in named.items():
        check(op, t.dtype == torch.int32, name, "dtype int32", t.dtype)


def _flat(op: str, name: str, t: Tensor, B: int, N: int) -> Tensor:
    """A flat view of a tensor the kernels index as ``b * N + i``: writes through it land in ``t``. A tensor of
    rows must have rows of N (with longer rows, ``b * N + i`` would reach into another request's row)."""
    check(op, t.numel() >= B * N, name, f"at least {B * N} elements (B * N)", t.numel())
    check(op, t.dim() < 2 or t.shape[-1] == N, name, f"rows of N = {N} positions (one row per request)",
          list(t.shape))
    try:
        return t.view(-1)
    except RuntimeError:
        check(op, False, name, "a tensor that can be viewed flat (contiguous)", f"strides {t.stride()}")
        raise


def _write_prefix(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, n: Tensor, values: Tensor,
                  op: str) -> None:
    """tokenspeed's writes for n accepted drafts: ``accept_index[b*N + i] = b*N + i`` and
    ``predicts[b*N + i] = values[b, i]`` for ``i <= n_b``, ``accept_token_num[b] = n_b``."""
    B, N = values.shape
    pos = torch.arange(N, device=values.device)
    slots = torch.arange(B, device=values.device)[:, None] * N + pos
    within = pos <= n[:, None]
    flat_index = _flat(op, "accept_index", accept_index, B, N)
    flat_index[: B * N] = torch.where(within, slots, flat_index[: B * N].view(B, N)).reshape(-1).to(flat_index.dtype)
    flat_predicts = _flat(op, "predicts", predicts, B, N)
    flat_predicts.index_put_((slots[within],), values[within].to(flat_predicts.dtype))
    accept_token_num[:B] = n.to(accept_token_num.dtype)


def _greedy_prefix(candidates: Tensor, targets: Tensor) -> Tensor:
    """Accepted drafts when the target's token at position i is ``targets[:, i]``: int64 ``[B]``.

    :func:`specsampler.verify_chain` (``greedy``) on one-hot rows over the request's own token ids
    (:func:`~specsampler.compat.sglang.local_ids`): no row of the real vocabulary is built.
    """
    B, N = candidates.shape
    local = local_ids(torch.cat([candidates[:, 1:].long(), targets.long()], 1))
    rows = torch.zeros(B, N, 2 * N - 1, device=candidates.device).scatter_(2, local[:, N - 1:, None], 1.0)
    return verify_chain(rows, local[:, : N - 1], method="greedy").num_accepted


def _verify_given(op: str, predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, candidates: Tensor,
                  targets: Tensor) -> None:
    if candidates.shape[0] == 0:
        return
    n = _greedy_prefix(candidates, targets)
    _write_prefix(predicts, accept_index, accept_token_num, n, targets, op)


@torch.no_grad()
def verify_chain_greedy(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    target_predict: Tensor,
    batch_size: int,
    num_draft_tokens: int,
    enable_pdl: bool = False,
) -> None:
    """Greedy chain verification in place (:func:`specsampler.verify_chain`, ``method="greedy"``).

    Args (B = batch_size requests, N = num_draft_tokens):
        predicts: int32, ``B * N`` elements (flat), **written** at ``b*N + i`` for ``i <= n_b``:
            ``target_predict[b, i]`` (the accepted drafts, then the target's next token).
        accept_index: int32 ``[B, N]``, **written** at ``[b, i]`` for ``i <= n_b``: ``b*N + i``.
        accept_token_num: int32 ``[B]``, **written**: ``n_b``, the drafts ``candidates[b, i]``
            (``i >= 1``) accepted while they equal ``target_predict[b, i - 1]``.
        candidates: int32 ``[B, N]``: the verified token, then N - 1 drafts.
        target_predict: int64 ``[B, N]``: the target's argmax after each position.
    """
    op = "verify_chain_greedy"
    bs, N = int(batch_size), int(num_draft_tokens)
    check_dims(op, {"accept_index": (accept_index, (bs, N)), "accept_token_num": (accept_token_num, (bs,)),
                    "candidates": (candidates, (bs, N)), "target_predict": (target_predict, (bs, N))},
               candidates.device)
    _check_int32(op, predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
                 candidates=candidates)
    check(op, target_predict.dtype == torch.int64, "target_predict", "dtype int64", target_predict.dtype)
    targets = target_predict
    _verify_given(op, predicts, accept_index, accept_token_num, candidates, targets)


@torch.no_grad()
def verify_chain_target_sampled(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    target_sampled: Tensor,
    *,
    enable_pdl: bool = False,
) -> None:
    """Chain verification against target tokens sampled beforehand, in place (as :func:`verify_chain_greedy`).

    ``target_sampled``: int32 or int64, ``B * N`` elements (flat): the target's token after each
    position. Lossless when those tokens were drawn from the target: the sample-then-compare rule of
    ``specsampler.verify_chain(method="target_only")``. Checks and messages are tokenspeed's ValueErrors.
    """
    if candidates.ndim != 2:
        raise ValidationError(f"candidates must be 2D, got {candidates.ndim}D")
    if accept_index.shape != candidates.shape:
        raise ValidationError(f"accept_index shape {accept_index.shape} must match candidates {candidates.shape}")
    bs, N = candidates.shape
    total = bs * N
    if predicts.shape[0] < total:
        raise ValidationError(f"predicts is too small: {predicts.shape[0]} < {total}")
    if accept_token_num.shape[0] < bs:
        raise ValidationError(f"accept_token_num is too small: {accept_token_num.shape[0]} < {bs}")
    if target_sampled.numel() < total:
        raise ValidationError(f"target_sampled is too small: {target_sampled.numel()} < {total}")
    if target_sampled.dim() > 1 and target_sampled.shape[-1] != N:  # b * N + i would cross into another row
        raise ValidationError(f"target_sampled rows must hold {N} tokens, got shape {tuple(target_sampled.shape)}")
    for name, t in (("candidates", candidates), ("predicts", predicts), ("accept_index", accept_index),
                    ("accept_token_num", accept_token_num)):
        if t.dtype != torch.int32:
            raise ValidationError(f"{name} must be int32, got {t.dtype}")
    if target_sampled.dtype not in (torch.int32, torch.int64):
        raise ValidationError(f"target_sampled must be int32 or int64, got {target_sampled.dtype}")
    if bs == 0:
        return
    targets = target_sampled.reshape(-1)[:total].view(bs, N)
    _verify_given("verify_chain_target_sampled", predicts, accept_index, accept_token_num, candidates, targets)


@torch.no_grad()
def chain_speculative_sampling_target_only(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    uniform_samples: Tensor,
    uniform_samples_for_final_sampling: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
    enable_pdl: bool = False,
) -> None:
    """Verify a draft chain per request with the target-only rule on the caller's coins, in place.

    Args (B requests, N positions: the verified token and N - 1 drafts, V tokens):
        predicts: integer, ``B * N`` elements (flat), **written** at ``b*N + i - 1`` with each
            accepted draft ``candidates[b, i]``, and at ``b*N + n_b`` with the correction (or bonus).
        accept_index: integer ``[B, N]``, **written** at ``[b, i]`` for ``i <= n_b``: ``b*N + i``.
        accept_token_num: integer ``[B]``, **written**: ``n_b``, the accepted drafts.
        candidates: integer ``[B, N]``.
        uniform_samples: float ``[B, N]``: the coin of each position.
        uniform_samples_for_final_sampling: float ``[B]``: the coin of the correction draw.
        target_probs: float ``[B, N, V]``: row i, the target after position i (row N - 1: the bonus).
        draft_probs: float ``[B, N, V]`` or None (all zeros): subtracted from the stop row (not after
            all N - 1 drafts are accepted); **written** at the rejected draft: ``draft_probs[b, n_b, x]
            = target_probs[b, n_b, x]``.
        threshold_single, threshold_acc: in [0, 1]; draft ``x = candidates[b, i]`` with ``p =
            target_probs[b, i - 1, x]`` is accepted iff ``p >= threshold_single`` or ``coin <= p /
            max(threshold_acc, 1e-9)`` (coin ``uniform_samples[b, i - 1]``, float32), the chain stopping
            at the first rejection. The correction is drawn from the stop row without the rejected
            token by inversion at ``coin * mass`` (id ``V - 1`` where rounding finds none, as tokenspeed).

    Lossless at the default thresholds 1.0 with ``draft_probs`` zero (or None) and coins in (0, 1):
    accepting x with probability p(x) and otherwise drawing from p without x is a draw from p, so the
    output is distributed as ``specsampler.verify_chain(method="target_only")``'s. **Lossy** below 1
    (SGLang's speculative_accept_threshold_single / _acc); a coin of exactly 0 accepts a draft of
    probability 0, as in tokenspeed.
    """
    op = "chain_speculative_sampling_target_only"
    check(op, isinstance(target_probs, Tensor) and target_probs.dim() == 3 and target_probs.dtype.is_floating_point,
          "target_probs", "a float tensor [B, N, V]", getattr(target_probs, "shape", type(target_probs).__name__))
    B, N, V = target_probs.shape
    check_dims(op, {"predicts": (predicts, (None,)), "accept_index": (accept_index, (B, None)),
                    "accept_token_num": (accept_token_num, (B,)), "candidates": (candidates, (B, N)),
                    "uniform_samples": (uniform_samples, (B, N)),
                    "uniform_samples_for_final_sampling": (uniform_samples_for_final_sampling, (B,)),
                    "draft_probs": (draft_probs, (B, N, V))}, target_probs.device)
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        check(op, 0 <= value <= 1, name, "a value in [0, 1]", value)
    check(op, N >= 1 and V >= 1, "candidates, target_probs", "N >= 1 positions and V >= 1 tokens", (N, V))
    if B == 0:
        return
    K = N - 1
    drafts = candidates[:, 1:].long()
    in_vocab = (drafts >= 0) & (drafts < V)
    drafts = drafts.clamp(0, V - 1)
    p = target_probs[:, :K].gather(2, drafts[..., None])[..., 0].float()
    t_acc = torch.tensor(threshold_acc, dtype=torch.float32).clamp(min=1e-9)
    coins = uniform_samples[:, :K].float()
    ok = in_vocab & ((p >= torch.tensor(threshold_single, dtype=torch.float32)) | (coins <= p / t_acc))

    # The accepted prefix: specsampler's greedy chain over one-hot rows "position i's draft passes"
    # (draft i's token is i + 1; 0 marks a rejection and the bonus row).
    passes = torch.nn.functional.pad(torch.where(ok, torch.arange(1, N, device=ok.device), 0), (0, 1))
    rows = torch.zeros(B, N, N, device=ok.device).scatter_(2, passes[..., None], 1.0)
    n = verify_chain(rows, torch.arange(1, N, device=ok.device).expand(B, K), method="greedy").num_accepted

    batch = torch.arange(B, device=ok.device)
    rejected = n < K
    banned = torch.nn.functional.pad(drafts, (0, 1))[batch, n]  # the rejected draft (none after K acceptances)
    banned_ok = rejected & torch.nn.functional.pad(in_vocab, (0, 1))[batch, n]
    w = target_probs[batch, n].float()
    if draft_probs is not None:
        w = torch.where(rejected[:, None], (w - draft_probs[batch, n].float()).clamp(min=0.0), w)
        hit = banned_ok.nonzero()[:, 0]
        draft_probs[hit, n[hit], banned[hit]] = target_probs[hit, n[hit], banned[hit]]
    w[batch[banned_ok], banned[banned_ok]] = 0.0
    y = draw_with_coins(w, uniform_samples_for_final_sampling, "last_id")

    values = torch.where(torch.arange(N, device=ok.device) == n[:, None], y[:, None],
                         torch.nn.functional.pad(drafts, (0, 1)))
    _write_prefix(predicts, accept_index, accept_token_num, n, values, op)
