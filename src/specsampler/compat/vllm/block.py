"""vLLM's block-verification helpers (``vllm/v1/sample/rejection_sampler.py``): the PyTorch references of the
blockwise acceptance with its bonus token and of the blockwise recovered-token draw, with vLLM's names,
arguments and in-place outputs.

Block verification (Sun et al. 2024) is :func:`specsampler.verify_chain` with ``method="block"``: the
acceptance here is that op on the caller's uniforms; the recovered tokens are vLLM's exponential race over
the same residual ``max(a_i p_i - q_i, 0)``. Where vLLM's arithmetic differs from ours and the meaning
coincides, ours is used (docs/design.md, "Drop-in compatibility per peer", ``compat.vllm``).

Layout (vLLM's): request b owns the flat draft rows ``[cu[b - 1], cu[b])`` (``cu[-1] = 0``). A request whose
``cu`` value lies below an earlier request's (a decreasing ``cu``) owns no rows and its outputs are not written,
as vLLM's reference leaves them; a row is never read for two requests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specsampler import Uniforms, verify_chain
from specsampler.validation import check_no_bad, check_tensor, fail, values_checkable
from specsampler.verify.chain import block_a

__all__ = [
    "rejection_random_sample_block_verify_kernel",
    "rejection_random_sample_block_verify_pytorch",
    "sample_recovered_tokens_block_verify_kernel",
    "sample_recovered_tokens_blockwise_pytorch",
]

# vLLM's vocabulary tile of its block-verify kernels; the PyTorch path reads whole rows.
_BLOCK_VERIFY_VOCAB_BLOCK = 8192


def _ranges(op: str, cu_num_draft_tokens: Tensor, T: int, max_spec_len: int | None = None) -> tuple[Tensor, Tensor]:
    """Each request's first row and draft count, int64 ``[B]`` each (count -1: the request owns no rows).

    Request b's rows start after every earlier request's (the running maximum of ``cu``), so two requests
    never share a row, and end at ``cu[b]``; on a device out-of-range values are clamped into ``[0, T]``.
    """
    check_tensor(op, "cu_num_draft_tokens", cu_num_draft_tokens, kind="int", ndim=1)
    cu = cu_num_draft_tokens.long()
    if values_checkable(cu, False):
        check_no_bad(op, "cu_num_draft_tokens", (cu < 0) | (cu > T), cu, f"values in [0, T = {T}]")
    cu = cu.clamp(0, T)
    start = torch.nn.functional.pad(cu.cummax(0).values, (1, 0))[:-1]
    count = torch.where(cu >= start, cu - start, -1)
    if max_spec_len is not None:
        if values_checkable(count, False):
            check_no_bad(op, "cu_num_draft_tokens", count > max_spec_len, count,
                         f"at most max_spec_len = {max_spec_len} drafts per request")
        count = count.clamp(max=max_spec_len)
    return start, count


def _positions(start: Tensor, count: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """Flat row int64 ``[B, K]`` of each request's draft positions, and bool ``[B, K]``: the request owns it."""
    pos = torch.arange(K, device=start.device)
    return start[:, None] + pos, pos < count[:, None]


def _own_rows(t: Tensor, rows: Tensor, valid: Tensor, fill: float | int = 0) -> Tensor:
    """``t[rows]`` where ``valid``, ``fill`` elsewhere: rows a request does not own are never read."""
    out = t.new_full((*rows.shape, *t.shape[1:]), fill)
    out[valid] = t[rows[valid]]
    return out


def _at_drafts(probs: Tensor, x: Tensor) -> Tensor:
    """float32 ``[B, K]``: ``probs[b, i, x[b, i]]`` (``probs`` ``[B, K, V]``), 0 for an id outside ``[0, V)``."""
    V = probs.shape[-1]
    inside = (x >= 0) & (x < V)
    return torch.where(inside, probs.gather(2, x.clamp(0, V - 1)[..., None])[..., 0].float(), 0.0)


def rejection_random_sample_block_verify_pytorch(
    output_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    bonus_token_ids: Tensor,
    recovered_token_ids: Tensor,
    uniform_probs: Tensor,
    is_greedy: Tensor | None,
    max_spec_len: int,
    vocab_size: int,
) -> None:
    """Block verification of each sampled request's drafts, written in place (vLLM's PyTorch reference).

    :func:`specsampler.verify_chain` with ``method="block"`` on the caller's uniforms decides how many drafts
    each request keeps: ``tau = max{i : u_{i-1} <= h_i}`` (``h_0 = 1``; ``uniform_probs`` of a request's draft
    i - 1 tests ``h_i``, with vLLM's ``<=``, except that ``h_i = 0`` accepts nothing: vLLM accepts there at
    ``u = 0``, a draft of probability 0 included). Request b then gets its first tau drafts, then
    ``recovered_token_ids`` of its row tau if tau is short of its drafts, else its bonus token.

    Args (B requests, T draft rows, V tokens):
        output_token_ids: integer ``[B, max_spec_len + 1]``, **written** at ``[b, 0 .. tau_b]`` for every
            request that is not greedy and owns rows; other entries keep their values.
        cu_num_draft_tokens: integer ``[B]``, inclusive cumulative draft counts.
        draft_token_ids: integer ``[T]``; a draft outside ``[0, V)`` is never accepted.
        draft_probs, target_probs: float ``[T, V]``: the distribution each draft was drawn from, the target's.
        bonus_token_ids: integer ``[B, 1]`` (or ``[B]``).
        recovered_token_ids: integer ``[T]``: the token emitted at each draft row if verification stops there
            (:func:`sample_recovered_tokens_blockwise_pytorch`).
        uniform_probs: float ``[T]`` in [0, 1).
        is_greedy: bool ``[B]`` (greedy requests are left to the greedy path) or None (none greedy).
        max_spec_len: K, the width of ``output_token_ids`` minus one; vocab_size: V (read from the tensors).

    vLLM takes ``min(1, a p / q)`` as ``min(1, a (p / q))`` and sums the residual in float32; here both are
    specsampler's (a decision can differ only where a uniform is within rounding of its threshold).
    """
    del vocab_size  # the tensors' width is V
    op = "rejection_random_sample_block_verify_pytorch"
    K = int(max_spec_len)
    check_tensor(op, "output_token_ids", output_token_ids, kind="int", ndim=2)
    check_tensor(op, "draft_probs", draft_probs, kind="float", ndim=2)
    check_tensor(op, "target_probs", target_probs, kind="float", ndim=2)
    B, (T, V) = output_token_ids.shape[0], target_probs.shape
    if output_token_ids.shape[1] != K + 1:
        fail(op, "output_token_ids", f"shape [B, max_spec_len + 1] = [{B}, {K + 1}]", list(output_token_ids.shape))
    if draft_probs.shape != target_probs.shape:
        fail(op, "draft_probs", f"the shape of target_probs [T, V] = [{T}, {V}]", list(draft_probs.shape))
    for name, t in (("draft_token_ids", draft_token_ids), ("recovered_token_ids", recovered_token_ids),
                    ("uniform_probs", uniform_probs)):
        if t.numel() != T:
            fail(op, name, f"T = {T} values (one per draft row)", list(t.shape))
    for name, t in (("bonus_token_ids", bonus_token_ids), ("cu_num_draft_tokens", cu_num_draft_tokens)):
        if t.numel() != B:
            fail(op, name, f"B = {B} values (one per request)", list(t.shape))
    start, count = _ranges(op, cu_num_draft_tokens, T, K)
    sampled = count >= 0 if is_greedy is None else (count >= 0) & ~is_greedy.reshape(B).to(count.device).bool()
    n = count.clamp(min=0)
    rows, valid = _positions(start, n, K)
    x = _own_rows(draft_token_ids.reshape(-1).long(), rows, valid, fill=-1)  # -1: padding, never accepted
    q, p = _own_rows(draft_probs.float(), rows, valid), _own_rows(target_probs.float(), rows, valid)
    x = torch.where(_at_drafts(q, x) > 0, x, -1)  # vLLM: a draft of draft probability 0 is rejected
    # vLLM's `u <= h` as specsampler's `u' < h`, u' the next float32 below u (0 at u = 0: a threshold of 0
    # accepts nothing, where vLLM accepts at u = 0); index i of `accept` tests h_i
    u = _own_rows(uniform_probs.reshape(-1).float(), rows, valid, fill=1.0)
    accept = torch.nn.functional.pad(torch.nextafter(u, torch.full_like(u, float("-inf"))).clamp(min=0.0), (1, 0))
    bonus_row = p.new_zeros(B, 1, V)  # not read: tau alone is taken from the op
    res = verify_chain(torch.cat([p, bonus_row], 1), x, q, num_drafts=n, method="block",
                       rng=Uniforms(sample=torch.zeros_like(accept), accept=accept))
    tau = res.num_accepted
    stopped = tau < n
    recovered = _own_rows(recovered_token_ids.reshape(-1).long(), start + tau, stopped)  # its row where stopped
    last = torch.where(stopped, recovered, bonus_token_ids.reshape(B).to(tau.device).long())
    pos = torch.arange(K + 1, device=tau.device)
    out = torch.where(pos < tau[:, None], torch.nn.functional.pad(x, (0, 1)), last[:, None])
    written = sampled[:, None] & (pos <= tau[:, None])
    output_token_ids.copy_(torch.where(written, out.to(output_token_ids.dtype), output_token_ids))


def sample_recovered_tokens_blockwise_pytorch(
    output_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    q: Tensor,
    vocab_size: int,
) -> None:
    """The token block verification emits if it stops at each draft row, written in place (vLLM's reference).

    At draft i of request b it is the argmax over tokens v of ``max(a_i p_i(v) - q_i(v), 0) / e_b(v)``, with
    ``a`` block verification's prefix (``a_0 = 1``, ``a_{i+1} = min(1, a_i p_i(x_i) / q_i(x_i))``, 0 after a
    draft of draft probability 0) and ``e = q`` the caller's exponentials: a draw from the normalised residual
    of ``verify_chain(method="block")`` (an exponential race). ``e_b(v)`` equal to 0 or inf scores -1e10, as
    vLLM's; a residual without mass gives token 0.

    Args (B requests, T draft rows, V tokens):
        output_token_ids: integer ``[T]``, **written** at every row a request owns (other rows keep theirs).
        cu_num_draft_tokens: integer ``[B]``; draft_token_ids: integer ``[T]``.
        draft_probs, target_probs: float ``[T, V]``.
        q: float ``[B, V]``: each request's exponentials (vLLM draws them once per request and step).
        vocab_size: V (read from the tensors).
    """
    del vocab_size
    op = "sample_recovered_tokens_blockwise_pytorch"
    check_tensor(op, "draft_probs", draft_probs, kind="float", ndim=2)
    check_tensor(op, "target_probs", target_probs, kind="float", ndim=2)
    check_tensor(op, "q", q, kind="float", ndim=2)
    T, V = target_probs.shape
    B = cu_num_draft_tokens.numel()
    if draft_probs.shape != target_probs.shape:
        fail(op, "draft_probs", f"the shape of target_probs [T, V] = [{T}, {V}]", list(draft_probs.shape))
    for name, t in (("output_token_ids", output_token_ids), ("draft_token_ids", draft_token_ids)):
        if t.numel() != T:
            fail(op, name, f"T = {T} values (one per draft row)", list(t.shape))
    if tuple(q.shape) != (B, V):
        fail(op, "q", f"shape [B, V] = [{B}, {V}]", list(q.shape))
    start, count = _ranges(op, cu_num_draft_tokens, T)
    K = int(count.max()) if B else 0
    if K <= 0:
        return
    n = count.clamp(min=0)
    rows, valid = _positions(start, n, K)
    x = _own_rows(draft_token_ids.reshape(-1).long(), rows, valid, fill=-1)
    p, d = _own_rows(target_probs.float(), rows, valid), _own_rows(draft_probs.float(), rows, valid)
    p_x, q_x = _at_drafts(p, x), _at_drafts(d, x)
    a = block_a(valid & (q_x > 0), p_x, q_x)  # vLLM: a draft of draft probability 0 ends the prefix (a = 0)
    residual = (a[:, :K, None] * p - d).clamp_(min=0.0)
    e = q.float()[:, None, :]
    score = torch.where((e == 0) | e.isinf(), -1e10, residual / torch.where(e == 0, 1.0, e))
    output_token_ids.view(-1)[rows[valid]] = score.argmax(-1)[valid].to(output_token_ids.dtype)


class _Launch:
    """vLLM's Triton launch syntax, ``kernel[grid](*args, BLOCK_SIZE=...)``, over one of the references above:
    the grid and the tile are not needed (the computation is the reference's, on any device)."""

    def __init__(self, reference):
        self.reference = reference

    def __getitem__(self, grid):
        def launch(*args, BLOCK_SIZE: int = _BLOCK_VERIFY_VOCAB_BLOCK):
            self.reference(*args)

        return launch


rejection_random_sample_block_verify_kernel = _Launch(rejection_random_sample_block_verify_pytorch)
sample_recovered_tokens_block_verify_kernel = _Launch(sample_recovered_tokens_blockwise_pytorch)
