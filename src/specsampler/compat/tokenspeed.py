"""tokenspeed's chain verification ops (``tokenspeed_kernel``) on specsampler.

    from specsampler.compat.tokenspeed import (chain_speculative_sampling_target_only, verify_chain_greedy,
                                               verify_chain_target_sampled)

One draft chain per request, every output written in place where tokenspeed's kernels write. The op each
function maps to and the differences: docs/design.md, "Drop-in compatibility per peer", ``compat.tokenspeed``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import Uniforms, verify_chain
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
    enable_pdl: bool | None = None,
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
    _verify_given(op, predicts, accept_index, accept_token_num, candidates, target_predict)


@torch.no_grad()
def verify_chain_target_sampled(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    target_sampled: Tensor,
    *,
    enable_pdl: bool | None = None,
) -> None:
    """Chain verification against target tokens sampled beforehand, in place (as :func:`verify_chain_greedy`).

    ``target_sampled``: int32 or int64, ``B * N`` elements (flat): the target's token after each
    position. Lossless when those tokens were drawn from the target: the sample-then-compare rule of
    ``specsampler.verify_chain(method="target_only")``. Checks and messages are tokenspeed's ValueErrors.
    ``enable_pdl`` (keyword only; None, tokenspeed 0.1.4's default): accepted, no effect.
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


def _flag(op: str, name: str, value: object) -> bool:
    """A bool argument (or the int 0 / 1); anything else raises, naming it."""
    ok = isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))
    check(op, ok, name, "a bool", repr(value))
    return bool(value)


def _sentinel_threshold(op: str, value: object, use_draft_prob: bool) -> Tensor | None:
    """``reject_draft_prob_threshold`` as the kernel's float32 scalar, checked as tokenspeed's binding checks it
    (>= 1.0, in both modes). None (not given, as in the releases before it) only without ``use_draft_prob``."""
    if value is None:
        check(op, not use_draft_prob, "reject_draft_prob_threshold", "a number >= 1.0 with use_draft_prob=True",
              None)
        return None
    try:  # a number (or a one-element tensor), as tokenspeed's float(); not a string or a bool
        t = None if isinstance(value, (str, bytes, bool)) else float(value)
    except (TypeError, ValueError, RuntimeError):
        t = None
    check(op, t is not None and t >= 1.0, "reject_draft_prob_threshold",  # NaN fails, as tokenspeed's >= check
          "a number >= 1.0 (a recorded draft probability never exceeds 1)", repr(value))
    return torch.tensor(t, dtype=torch.float32)


def _target_only_stop(candidates: Tensor, uniform_samples: Tensor, target_probs: Tensor, draft_probs: Tensor | None,
                      threshold_single: float, threshold_acc: float) -> tuple[Tensor, Tensor]:
    """``use_draft_prob=False``: SGLang's target-only rule on the caller's coins. Returns the accepted drafts
    int64 ``[B]`` and the stop row's weights float32 ``[B, V]`` (the rejected draft zeroed); writes tokenspeed's
    ``draft_probs[b, n_b, x] = target_probs[b, n_b, x]`` at the rejected draft."""
    B, N, V = target_probs.shape
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
    return n, w


def _draft_prob_stop(candidates: Tensor, uniform_samples: Tensor, target_probs: Tensor, draft_probs: Tensor,
                     sentinel: Tensor) -> tuple[Tensor, Tensor]:
    """``use_draft_prob=True``: rejection sampling against the recorded draft rows, on the caller's coins.

    :func:`specsampler.verify_chain` (``method="token"``: accept iff ``u * q(x) < p(x)``) with the coins as
    :class:`specsampler.Uniforms` (draft i's test is ``uniform_samples[b, i - 1]``) and each request's chain cut
    before its first draft whose recorded ``q(x)`` exceeds ``sentinel`` (that draft is rejected). Returns the
    accepted drafts int64 ``[B]`` and the stop row's weights float32 ``[B, V]``: ``max(p - q, 0)`` after a
    rejection, with q's entries above ``sentinel`` read as 0 (a row of sentinels leaves p itself); ``p`` of the
    bonus row after all N - 1 drafts. ``draft_probs`` is not written.
    """
    B, N, V = target_probs.shape
    K = N - 1
    dev = target_probs.device
    q = draft_probs.float()
    drafts = candidates[:, 1:]
    at_draft = q[:, :K].gather(2, drafts.long().clamp(0, V - 1)[..., None])[..., 0]
    num_drafts = (~(at_draft > sentinel)).long().cumprod(1).sum(1)  # the drafts before the first sentinel
    q = torch.where(q > sentinel, 0.0, q)
    coins = Uniforms(sample=torch.zeros(B, N, device=dev),
                     accept=torch.nn.functional.pad(uniform_samples[:, :K].float(), (1, 0)))
    n = verify_chain(target_probs, drafts, q[:, :K], num_drafts=num_drafts, method="token", rng=coins).num_accepted
    batch = torch.arange(B, device=dev)
    w = target_probs[batch, n].float()
    w = torch.where((n < K)[:, None], (w - q[batch, n]).clamp(min=0.0), w)
    return n, w


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
    enable_pdl: bool | None = None,
    *,
    use_draft_prob: bool = False,
    reject_draft_prob_threshold: float | None = None,
) -> None:
    """Verify a draft chain per request on the caller's coins, in place, by one of tokenspeed's two rules.

    Args (B requests, N positions: the verified token and N - 1 drafts, V tokens):
        predicts: integer, ``B * N`` elements (flat), **written** at ``b*N + i - 1`` with each
            accepted draft ``candidates[b, i]``, and at ``b*N + n_b`` with the correction (or bonus).
        accept_index: integer ``[B, N]``, **written** at ``[b, i]`` for ``i <= n_b``: ``b*N + i``.
        accept_token_num: integer ``[B]``, **written**: ``n_b``, the accepted drafts.
        candidates: integer ``[B, N]``.
        uniform_samples: float ``[B, N]``: the coin of each position (draft i: ``uniform_samples[b, i - 1]``).
        uniform_samples_for_final_sampling: float ``[B]``: the coin of the correction draw.
        target_probs: float ``[B, N, V]``: row i, the target after position i (row N - 1: the bonus).
        draft_probs: float ``[B, N, V]`` or None. Without ``use_draft_prob``: None (all zeros) or a row
            subtracted from the stop row (not after all N - 1 drafts are accepted), **written** at the rejected
            draft: ``draft_probs[b, n_b, x] = target_probs[b, n_b, x]``. With ``use_draft_prob``: required, row
            i the distribution draft ``candidates[b, i + 1]`` was drawn from; read only.
        threshold_single, threshold_acc: in [0, 1] (checked in both modes, used without ``use_draft_prob``);
            draft ``x = candidates[b, i]`` with ``p = target_probs[b, i - 1, x]`` is accepted iff
            ``p >= threshold_single`` or ``coin <= p / max(threshold_acc, 1e-9)`` (float32).
        deterministic, enable_pdl: accepted, no effect (``enable_pdl=None``: the newest release's default).
        use_draft_prob: keyword only, default False (the releases before it). True: standard rejection
            sampling, ``specsampler.verify_chain(method="token")`` on the caller's coins: draft x is accepted
            iff ``coin * q(x) < p(x)`` (q: ``draft_probs[b, i - 1]``, float32, strict); after a rejection the
            correction is drawn from ``max(p - q, 0)`` at the stop row, after all N - 1 drafts from the bonus row.
        reject_draft_prob_threshold: keyword only, a number >= 1.0 (checked in both modes; None, i.e. not
            given, only without ``use_draft_prob``). With ``use_draft_prob``, a draft whose recorded ``q(x)``
            exceeds it (float32 ``>``) marks a row with no recorded proposal: the draft is rejected, and the
            correction's residual reads q's entries above it as 0 (tokenspeed fills such a row with threshold + 1:
            the correction is then drawn from the full target row).

    The chain stops at the first rejection; the correction is drawn from the stop row's weights by inversion
    at ``coin * mass`` (id ``V - 1`` where rounding or an empty residual finds none, as tokenspeed).

    Lossless: without ``use_draft_prob`` at the default thresholds 1.0 with ``draft_probs`` zero (or None) and
    coins in (0, 1): accepting x with probability p(x) and otherwise drawing from p without x is a draw from p,
    so the output is distributed as ``specsampler.verify_chain(method="target_only")``'s; **lossy** below 1
    (SGLang's speculative_accept_threshold_single / _acc), and a coin of exactly 0 accepts a draft of
    probability 0, as in tokenspeed. With ``use_draft_prob``: lossless whenever each draft was drawn from its
    recorded row (the thresholds play no part); a sentinel row only wastes its draft (its correction is a draw
    from p), and ``reject_draft_prob_threshold >= 1`` never takes a real probability for a sentinel.
    """
    op = "chain_speculative_sampling_target_only"
    use_draft_prob = _flag(op, "use_draft_prob", use_draft_prob)
    if use_draft_prob and draft_probs is None:  # tokenspeed's Python check, its words first
        raise ValidationError(f"{op}: use_draft_prob requires the recorded draft_probs: draft_probs: expected a "
                              "float tensor [B, N, V] (the distribution each draft was drawn from), got None")
    sentinel = _sentinel_threshold(op, reject_draft_prob_threshold, use_draft_prob)
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
    if use_draft_prob:
        n, w = _draft_prob_stop(candidates, uniform_samples, target_probs, draft_probs, sentinel)
    else:
        n, w = _target_only_stop(candidates, uniform_samples, target_probs, draft_probs, threshold_single,
                                 threshold_acc)
    y = draw_with_coins(w, uniform_samples_for_final_sampling)
    drafts = torch.nn.functional.pad(candidates[:, 1:].long().clamp(0, V - 1), (0, 1))
    values = torch.where(torch.arange(N, device=n.device) == n[:, None], y[:, None], drafts)
    _write_prefix(predicts, accept_index, accept_token_num, n, values, op)
