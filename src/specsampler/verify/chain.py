"""Chain verification: one draft chain per request, checked against the target in one pass.

Methods ``token`` (rejection sampling), ``block`` (block verification), ``target_only`` (sample then
compare) and ``greedy``; formulas: docs/design.md, "Algorithms"; random counters: "Randomness". Every
method emits the accepted drafts and exactly one more token. Only the needed work: the residual or bonus
distribution is built for the one position where each request stops. Plain loop per request:
:mod:`specsampler.verify.reference`; kernel: :mod:`specsampler.kernels.chain`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import constants
from ..kernels import runs_kernel, use_triton
from ..lazy import cached_property
from ..params import RowParams, SamplingParams
from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, Philox, check_rng, kernel_randomness, planned
from ..sampling.greedy import greedy_ids
from ..sampling.masses import as_weight
from ..sampling.ops import _process_prepared, logit_inputs, logit_rows
from ..sampling.processing import Processed, process
from ..sampling.vocab import Vocab
from ..tracing import eager_when_traced
from ..validation import (
    check_device,
    check_logits_values,
    check_method,
    check_mode,
    check_no_bad,
    check_probs_values,
    check_readable,
    check_shape,
    check_tensor,
    check_token_values,
    fail,
    values_checkable,
)
from .drafts import Drafts

METHODS = ("token", "block", "target_only", "greedy")
LOOPED_BATCH = 1  # token and block chains of this many requests are walked by their plain loops on the CPU


@dataclass(frozen=True)
class ChainResult:
    """Outcome of a chain verification.

    tokens: int64 ``[B, K+1]``: the accepted drafts, then exactly one correction or bonus
        token, then ``-1``.
    num_accepted: int64 ``[B]``: accepted drafts (the request emits ``num_accepted + 1``).
    expected_accepted: float32 ``[B]``: the expected number of accepted drafts given these
        drafts (and draft distributions), a headroom meter. For deterministic drafts
        (``target_only``) it is ``sum_i prod_{j<=i} p_j(x_j)``; ``greedy``: the count itself.
    """

    tokens: Tensor
    num_accepted: Tensor
    _expected: Callable[[], Tensor] = field(repr=False, compare=False)

    @cached_property
    def expected_accepted(self) -> Tensor:
        """Computed on first access (where the kernels ran, it reads rows they did not need); in ``[0, K]``
        whatever the inputs' values (rows that are not distributions make the formula's terms leave [0, 1])."""
        with torch.no_grad():
            return self._expected().float().nan_to_num(0.0).clamp_(0.0, self.tokens.shape[1] - 1)

    @property
    def num_emitted(self) -> Tensor:
        """int64 ``[B]``: tokens the request advances by (``num_accepted + 1``)."""
        return self.num_accepted + 1


@dataclass(frozen=True)
class ChainInputs(Drafts):
    """Validated inputs. x_raw: the drafts as given (int64 ``[B, K]``); num_drafts: int64 ``[B]``; q: float32
    ``[B, K, vocab.width]`` or None; columns: the columns the rows hold (None: the whole vocabulary);
    given_usable: :attr:`usable` where the caller has it. ``x`` and ``usable`` are made on first use
    (:class:`~specsampler.verify.drafts.Drafts`)."""

    B: int
    K: int
    V: int
    method: str
    x_raw: Tensor
    num_drafts: Tensor
    q: Tensor | None
    columns: Vocab | None = None
    given_usable: Tensor | None = field(default=None, repr=False)

    def _usable(self) -> Tensor:
        """In range and before ``num_drafts``."""
        pos = torch.arange(self.K, device=self.x_raw.device)
        return (self.x_raw >= 0) & (self.x_raw < self.V) & (pos < self.num_drafts[:, None])

    def q_x(self) -> Tensor:
        """float32 ``[B, K]``: each draft's draft probability."""
        return self.vocab.value(self.q.flatten(0, 1), self.x.reshape(-1)).view(self.B, self.K)


def check_num_drafts(op: str, num_drafts: Tensor | None, B: int, K: int, device: torch.device, full: bool) -> Tensor:
    """``num_drafts`` (integer ``[B]`` in ``[0, K]``, None: all K) checked, as int64 ``[B]``."""
    if num_drafts is None:
        return constants.full(B, K, torch.int64, device)
    check_tensor(op, "num_drafts", num_drafts, kind="int", ndim=1)
    check_shape(op, "num_drafts", num_drafts, (B,), "[B]")
    check_device(op, "num_drafts", num_drafts, device)
    n = num_drafts.long()
    if values_checkable(n, full):
        check_no_bad(op, "num_drafts", (n < 0) | (n > K), n, f"values in [0, K] = [0, {K}]")
    return n


def _check_chain(op, target, target_name, draft_tokens, draft_probs, num_drafts, method, full, logits) -> ChainInputs:
    check_tensor(op, target_name, target, kind="float", ndim=3)
    check_readable(op, target_name, target)
    B, K1, V = target.shape
    if K1 < 1 or V < 1:
        fail(op, target_name, "shape [B, K+1, V] with K+1 >= 1 and V >= 1", list(target.shape))
    K, dev = K1 - 1, target.device
    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=2)
    check_shape(op, "draft_tokens", draft_tokens, (B, K), f"[B, K] (K+1 = {K1} rows of {target_name})")
    check_device(op, "draft_tokens", draft_tokens, dev)
    method, q = check_method(op, method, METHODS, ("token", "block"), draft_probs, (B, K, V), "[B, K, V]", dev)
    n = check_num_drafts(op, num_drafts, B, K, dev, full)
    x_raw = draft_tokens.long()
    if full:  # the rows and ids each request uses: those past its drafts (and past its bonus row) are padding
        used, live = drafted(n, K), drafted(n, K1, bonus=True)[..., None]
        check_token_values(op, "draft_tokens", torch.where(used, x_raw, 0), V)
        if logits:
            check_logits_values(op, target_name, torch.where(live, target.float(), 0.0))
        else:
            check_probs_values(op, target_name, torch.where(live, target.float(), 1.0))
        if q is not None:
            check_probs_values(op, "draft_probs", torch.where(used[..., None], q.float(), 1.0))
    return ChainInputs(B, K, V, method, x_raw, n, q)


def _live(c: ChainInputs, full: bool) -> Tensor | None:
    """The target rows ``validate="full"`` reads (bool ``[B, K+1]``, up to each bonus row), or None unless full."""
    return drafted(c.num_drafts, c.K + 1, bonus=True) if full else None


def drafted(num_drafts: Tensor, width: int, bonus: bool = False) -> Tensor:
    """bool ``[B, width]``: the positions each request uses, ``i < num_drafts[b]`` (``<=`` with its ``bonus``
    row): what ``validate="full"`` reads; the rest is padding."""
    i = torch.arange(width, device=num_drafts.device)
    return i <= num_drafts[:, None] if bonus else i < num_drafts[:, None]


def _leading_run(ok: Tensor) -> Tensor:
    """int64 ``[B]``: length of the leading run of True in ``[B, K]``."""
    return ok.long().cumprod(1).sum(1)


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``min(1, num / den)`` with ``num == 0 -> 0`` and ``den == 0 < num -> 1``."""
    return torch.where(num > 0, torch.where(num >= den, 1.0, num / den), 0.0)


def _p_x(c: ChainInputs, target: Processed) -> Tensor:
    """float32 ``[B, K]``: the target probability of each draft at its position."""
    return target.prob(torch.nn.functional.pad(c.x, (0, 1)).view(-1)).view(c.B, c.K + 1)[:, : c.K]


def _block_terms(c: ChainInputs, target: Processed, p_x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Block verification's ``a`` ``[B, K+1]``, dense ``p`` ``[B, K+1, V]``, ``w = max(a p - q, 0)``
    ``[B, K, V]`` and ``h`` ``[B, K+1]`` (0 past ``num_drafts``, ``a`` at it, ``h_0 = 1``)."""
    a = block_a(c.usable, p_x, c.q_x())
    p = target.dense().unflatten(0, (c.B, c.K + 1))
    w = (a[:, :c.K, None] * p[:, :c.K] - c.q).clamp_(min=0.0)
    return a, p, w, block_h(c, a, as_weight(c.vocab.mass(w)))


def block_a(usable: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """Block verification's ``a`` float32 ``[B, K+1]`` from the drafts' target and draft probabilities ``[B, K]``:
    ``a_0 = 1``, ``a_{i+1} = min(1, a_i p_i(x_i) / q_i(x_i))`` where draft i is ``usable`` (bool ``[B, K]``), else 0."""
    B, K = usable.shape
    a = torch.ones(B, K + 1, device=usable.device)
    for i in range(K):
        a[:, i + 1] = torch.where(usable[:, i], _ratio(a[:, i] * p_x[:, i], q_x[:, i]), 0.0)
    return a


def block_h(c: ChainInputs, a: Tensor, s: Tensor) -> Tensor:
    """Block verification's ``h`` float32 ``[B, K+1]`` from ``a`` and the residuals' masses as weights ``s``
    ``[B, K]``."""
    K = c.K
    pos = torch.arange(K + 1, device=a.device)
    # a_i = 0 (draft x_{i-1} never accepted) keeps h_i = 0 even where bad values (q < 0) give w_i mass
    h = torch.nn.functional.pad(torch.where((s > 0) & (a[:, :K] > 0), s / (s + 1 - a[:, :K]), 0.0), (0, 1))
    h = torch.where(pos == c.num_drafts[:, None], a, torch.where(pos > c.num_drafts[:, None], 0.0, h))
    h[:, 0] = 1.0
    return h


def accepts(u: Tensor, q_x: Tensor, p_x: Tensor) -> Tensor:
    """The acceptance test of rejection sampling, elementwise: ``u q(x) < p(x)`` (strict), and never where
    ``p(x) = 0``, whatever ``q(x)`` says (a negative one passes the comparison)."""
    return (u * q_x < p_x) & (p_x > 0)


def token_accepted(c: ChainInputs, u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """token's accepted counts int64 ``[B]``: the leading drafts that pass :func:`accepts`, from the acceptance
    uniforms ``u`` and the drafts' probabilities float32 ``[B, K]``."""
    return _leading_run(accepts(u, q_x, p_x) & c.usable)


def block_tau(h: Tensor, eta: Tensor) -> Tensor:
    """Block verification's accepted count int64 ``[B]``: the last position ``i`` with ``eta_i < h_i`` (0 if none),
    from ``h`` and the acceptance uniforms ``eta`` float32 ``[B, K+1]``."""
    pos = torch.arange(h.shape[1], device=h.device)
    return torch.where((eta < h) | (pos == 0), pos, 0).amax(1)


def _expected(c: ChainInputs, target: Processed | None, n: Tensor) -> Tensor:
    """:attr:`ChainResult.expected_accepted` given the drafts (``n``: the accepted counts, for greedy)."""
    if c.method == "greedy":
        return n.float()
    p_x = _p_x(c, target)
    if c.method == "block":
        return _block_expected(_block_terms(c, target, p_x)[3])
    return expected_of(c, p_x, c.q_x() if c.method == "token" else None)


def expected_of(c: ChainInputs, p_x: Tensor, q_x: Tensor | None) -> Tensor:
    """token's (``q_x`` given) or target_only's expected accepted drafts from the drafts' target (and draft)
    probabilities float32 ``[B, K]``."""
    return torch.where(c.usable, p_x if q_x is None else _ratio(p_x, q_x), 0.0).cumprod(1).sum(1)


def _block_expected(h: Tensor) -> Tensor:
    """Block verification's expected accepted drafts from its ``h`` ``[B, K+1]``: sum of i P(tau = i)."""
    later = torch.flip(torch.cumprod(torch.flip(1 - h, (1,)), 1), (1,))  # prod_{j >= i} (1 - h_j)
    p_tau = h * torch.nn.functional.pad(later[:, 1:], (0, 1), value=1.0)
    return (p_tau * torch.arange(h.shape[1], device=h.device)).sum(1)


def verify_greedy(c: ChainInputs, draws: Tensor) -> ChainResult:
    """Greedy verification given the target's choices ``draws`` (int64 ``[B, K+1]``): the drafts equal to
    them, up to the first that is not, then the choice there."""
    n = _leading_run((draws[:, :c.K] == c.x) & c.usable)
    return _result(c, n, draws.gather(1, n[:, None])[:, 0], lambda: n.float())


def _verify(c: ChainInputs, target: Processed | None, greedy_draws: Tensor | None, rng, op: str,
            draw: Callable[[int, int], Tensor] | None = None) -> ChainResult:
    """Run method ``c.method`` on the target distributions (rows ``b * (K+1) + i``). ``draw(stream,
    count)``: the uniforms ``[B, count]`` of a stream (default: drawn from ``rng``)."""
    B, K, dev = c.B, c.K, c.x.device
    if c.method == "greedy":  # draws nothing (as a greedy tree); a Philox of another batch is still a mistake
        if draw is None and isinstance(rng, Philox):
            rng.keys(op, B, dev)
        return verify_greedy(c, greedy_draws)
    batch = torch.arange(B, device=dev)
    draws = ((STREAM_SAMPLE, K + 1), (STREAM_ACCEPT, K + 1)) if c.method in ("token", "block") else ()
    draw = draw or planned(rng, op, B, draws, dev)
    u_draw = draw(STREAM_SAMPLE, K + 1)
    p_x = _p_x(c, target)
    if c.method == "target_only":
        draws = target.sample(u_draw.view(-1)).view(B, K + 1)
        # a row without mass draws 0: a draft 0 there has target probability 0, not accepted
        n = _leading_run((draws[:, :K] == c.x) & (p_x > 0) & c.usable)
        return _result(c, n, draws.gather(1, n[:, None])[:, 0], lambda: _expected(c, target, n))
    q_x = c.q_x()
    if c.method == "token":
        u = draw(STREAM_ACCEPT, K + 1)[:, 1:]  # draft i is node i+1 of the chain
        n = token_accepted(c, u, p_x, q_x)
        stop_rows = batch * (K + 1) + n
        stop = target.select(stop_rows).dense()  # a new tensor: the residual is built in it
        u = u_draw.gather(1, n[:, None])[:, 0]
        if not K:
            return _result(c, n, c.vocab.draw(stop, u), lambda: _expected(c, target, n))
        rejected = n < c.num_drafts
        q_rows = c.q.flatten(0, 1).index_select(0, batch * K + n.clamp(max=K - 1))
        if not bool(rejected.all()):  # a request that accepted every draft draws its bonus from p itself: its q row
            q_rows.masked_fill_(~rejected[:, None], 0.0)  # there lies past its drafts (padding: NaN * 0 is NaN)
        stop.sub_(q_rows)
        # clamped to [0, 1], not only at 0: the draw's masses clamp so anyway, and need no pass of their own
        stop.clamp_(0.0, 1.0)
        y, mass = c.vocab.draw_with_mass(stop, u, unit=True)
        empty = rejected & ~mass
        if bool(empty.any()):  # a residual without mass: draw from p itself
            y[empty] = c.vocab.draw(target.select(stop_rows[empty]).dense(), u[empty])
        return _result(c, n, y, lambda: _expected(c, target, n))
    # block
    a, p, w, h = _block_terms(c, target, p_x)
    tau = block_tau(h, draw(STREAM_ACCEPT, K + 1))
    bonus = p[batch, tau]
    stop = bonus
    if K:
        residual = w[batch, tau.clamp(max=K - 1)]
        stop = torch.where((tau < c.num_drafts)[:, None] & c.vocab.has_mass(residual, keepdim=True), residual, bonus)
    y = c.vocab.draw(stop, u_draw.gather(1, tau[:, None])[:, 0])
    return _result(c, tau, y, lambda: _block_expected(h))


_STREAMS = {"token": (STREAM_SAMPLE, STREAM_ACCEPT), "block": (STREAM_SAMPLE, STREAM_ACCEPT),
            "target_only": (STREAM_SAMPLE,), "greedy": ()}  # the uniforms each method draws, in its order


def _verify_kernel(c: ChainInputs, target_probs: Tensor, rng, op: str) -> ChainResult:
    """:func:`verify_chain` by its Triton kernel (the same draws as :func:`_verify`)."""
    from ..kernels import ops

    seed, offset, u = kernel_randomness(rng, op, c.B, c.K + 1, _STREAMS[c.method], c.x_raw.device)
    u_sample, u_accept = (u + [None, None])[:2]
    tokens, n = ops.verify_chain(target_probs, c.x_raw, c.q, c.num_drafts, c.method, seed, offset, u_accept, u_sample)

    def expected() -> Tensor:
        rows = target_probs.reshape(-1, c.V).float()
        return _expected(c, Processed.from_dense(rows), n)

    return ChainResult(tokens, n, expected)


def _verify_from_logits_kernel(c: ChainInputs, logits: Tensor, params, vocab_mask, full: bool, rng,
                               op: str) -> ChainResult:
    """:func:`verify_chain_from_logits` by its Triton kernel (the same draws as the reference)."""
    from ..kernels import ops

    rp, mask, _, _ = logit_inputs(op, logits, params, vocab_mask, full, _live(c, full))
    seed, offset, u = kernel_randomness(rng, op, c.B, c.K + 1, _STREAMS[c.method], c.x_raw.device)
    u_sample, u_accept = (u + [None, None])[:2]
    tokens, n = ops.verify_chain_from_logits(logits, c.x_raw, c.q, c.num_drafts, c.method, rp.temperature, rp.top_k,
                                             rp.top_p, rp.min_p, mask, seed, offset, u_accept, u_sample)

    def expected() -> Tensor:
        x, rp_rows, _, _ = logit_rows(op, logits, params, vocab_mask, False)
        if c.method == "greedy":
            return _expected(c, None, n)
        return _expected(c, process(x, rp_rows, logits=True), n)

    return ChainResult(tokens, n, expected)


def _result(c: ChainInputs, n: Tensor, y: Tensor, expected: Callable[[], Tensor]) -> ChainResult:
    pos = torch.arange(c.K + 1, device=n.device)
    drafts = torch.nn.functional.pad(c.x_raw, (0, 1), value=-1)
    tokens = torch.where(pos < n[:, None], drafts, torch.where(pos == n[:, None], y[:, None], -1))
    return ChainResult(tokens, n, expected)


@eager_when_traced(runs_kernel)
@torch.no_grad()
def verify_chain(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None = None,
    *,
    num_drafts: Tensor | None = None,
    method: str = "auto",
    rng: torch.Generator | Philox | None = None,
    validate: str = "structure",
) -> ChainResult:
    """Verify one draft chain per request against target probabilities.

    Args:
        target_probs: float ``[B, K+1, V]``: the target distribution at each draft position;
            row ``num_drafts[b]`` (default K) is the bonus position.
        draft_tokens: integer ``[B, K]``.
        draft_probs: float ``[B, K, V]``: the distribution each draft token was drawn from
            (``token``, ``block``); None for deterministic drafts.
        num_drafts: integer ``[B]`` in ``[0, K]``: request b uses its first ``num_drafts[b]``
            drafts (ragged chains). Default: all K.
        method: ``"token"``, ``"block"``, ``"target_only"``, ``"greedy"`` or ``"auto"``
            (token with draft_probs, else target_only).
        rng: ``None``, a ``torch.Generator`` or :class:`Philox`.
        validate: ``"structure"`` or ``"full"``.
    Returns:
        :class:`ChainResult`; tokens always in ``[0, V)`` or ``-1``, whatever the values.

    Example:
        >>> import torch, specsampler as ss
        >>> p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])  # the target says 1, 2, 0
        >>> q = torch.full((1, 2, 3), 1 / 3)  # the drafts were drawn uniformly
        >>> res = ss.verify_chain(p, torch.tensor([[1, 0]]), q, method="token", rng=ss.Philox(seed=7))
        >>> res.tokens.tolist(), res.num_accepted.tolist()  # draft 1 accepted, 0 rejected, 2 emitted
        ([[1, 2, -1]], [1])
    """
    op = "verify_chain"
    full = check_mode(op, validate)
    check_rng(op, rng)
    c = _check_chain(op, target_probs, "target_probs", draft_tokens, draft_probs, num_drafts, method, full, False)
    if use_triton(target_probs.device):
        return _verify_kernel(c, target_probs, rng, op)
    rows = target_probs.reshape(-1, c.V).float()
    if c.method == "greedy":
        return _verify(c, None, greedy_ids(rows).view(c.B, c.K + 1), rng, op)
    return _verify(c, Processed.from_dense(rows), None, rng, op)


@eager_when_traced(runs_kernel)
@torch.no_grad()
def verify_chain_from_logits(
    target_logits: Tensor,
    draft_tokens: Tensor,
    params: SamplingParams | None = None,
    *,
    draft_probs: Tensor | None = None,
    num_drafts: Tensor | None = None,
    method: str = "auto",
    rng: torch.Generator | Philox | None = None,
    vocab_mask: Tensor | None = None,
    validate: str = "structure",
) -> ChainResult:
    """Process the target logits per request, then verify (see :func:`verify_chain`).

    Each request's :class:`SamplingParams` (temperature 0 = greedy, top-k, top-p, min-p) and
    ``vocab_mask`` apply at all its positions; greedy and sampled requests mix in one batch.
    Deterministic drafts (``target_only``) take tokenspeed's fast chain path: one draw per position from
    the processed target, compared with the draft; the draws are those of
    :func:`specsampler.sample_from_logits` on the same ``rng``. Sampled drafts
    (``token``, ``block``) are verified against the processed target; ``draft_probs`` must be
    the distributions the drafts were drawn from.

    Args:
        target_logits: float32/bf16/fp16 ``[B, K+1, V]``.
        draft_tokens: integer ``[B, K]``.
        params: per-request :class:`SamplingParams` (scalars or ``[B]``).
        draft_probs: float ``[B, K, V]`` or None.
        num_drafts: integer ``[B]`` in ``[0, K]``.
        method: as for :func:`verify_chain`; ``greedy`` takes the argmax of the masked logits.
        rng: ``None``, a ``torch.Generator`` or :class:`Philox`.
        vocab_mask: bool, broadcastable to ``[B, K+1, V]`` (e.g. per position), True = allowed.
        validate: ``"structure"`` or ``"full"``.
    Returns:
        :class:`ChainResult`.

    Example:
        >>> import torch, specsampler as ss
        >>> logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]])
        >>> res = ss.verify_chain_from_logits(logits, torch.tensor([[1, 0]]), ss.SamplingParams(temperature=0.0))
        >>> res.tokens.tolist(), res.num_accepted.tolist()  # both drafts are the argmax; then the bonus token
        ([[1, 0, 2]], [2])
    """
    op = "verify_chain_from_logits"
    full = check_mode(op, validate)
    check_rng(op, rng)
    c = _check_chain(op, target_logits, "target_logits", draft_tokens, draft_probs, num_drafts, method, full, True)
    if use_triton(target_logits.device):
        return _verify_from_logits_kernel(c, target_logits, params, vocab_mask, full, rng, op)
    x, rp, _, _ = logit_rows(op, target_logits, params, vocab_mask, full, _live(c, full))
    if c.method == "greedy":
        return _verify(c, None, greedy_ids(x).view(c.B, c.K + 1), rng, op)
    return _verify(c, process(x, rp, logits=True), None, rng, op)


# ------------------------------------------------------------------- inputs a caller built (speculative_generate)


def _verify_chain_prepared(logits: Tensor, drafts: Tensor, draft_probs: Tensor | None, num_drafts: Tensor,
                           usable: Tensor, method: str, params: SamplingParams | None, rp: RowParams, rng,
                           draw: Callable[[int, int], Tensor], small=None) -> ChainResult:
    """:func:`verify_chain_from_logits` without its checks, for inputs the caller built and knows valid.

    logits: float32 ``[B, K+1, V]``; drafts: int64 ``[B, K]`` in ``[0, V)``; draft_probs:
    float32 ``[B, K, V]`` (token, block) or None; num_drafts: int64 ``[B]``; usable: bool
    ``[B, K]``, position < num_drafts; method: a resolved method; rp: the parameters of the
    ``B * (K+1)`` rows, and ``small`` their :func:`_small_constants` (or None); ``draw(stream,
    count)``: the uniforms the public op would draw from ``rng`` (kernels draw from ``rng``
    themselves). The same tokens as the public op. On the CPU, a lone request's ``token`` or ``block`` chain is
    walked by its plain loop (:func:`_walk_each`).
    """
    B, K1, V = logits.shape
    c = ChainInputs(B, K1 - 1, V, method, drafts, num_drafts, draft_probs, given_usable=usable)
    op = "speculative_generate"
    if use_triton(logits.device):
        return _verify_from_logits_kernel(c, logits, params, None, False, rng, op)
    x = logits.view(-1, V)
    if method == "greedy":
        return _verify(c, None, greedy_ids(x).view(B, K1), rng, op, draw)
    target = _process_prepared(x, rp, small)
    if method in ("token", "block") and B <= LOOPED_BATCH and x.device.type == "cpu":
        return _walk_each(c, target, draw)
    return _verify(c, target, None, rng, op, draw)


def _walk_each(c: ChainInputs, target: Processed, draw: Callable[[int, int], Tensor]) -> ChainResult:
    """``token`` or ``block`` for each request by its plain loop (:mod:`.reference`, tested equal to :func:`_verify`),
    on the dense target rows and the same uniforms: a lone request's loop, its scalars on the host, takes fewer
    operations than the batched walk's gathers over every position."""
    from . import reference

    u_draw, u_accept = draw(STREAM_SAMPLE, c.K + 1).tolist(), draw(STREAM_ACCEPT, c.K + 1).tolist()
    walk = reference.chain_token if c.method == "token" else reference.chain_block
    p = target.dense().view(c.B, c.K + 1, c.V)
    walks = [walk(p[b], c.q[b], x[:k], u_accept[b], u_draw[b])
             for b, (x, k) in enumerate(zip(c.x_raw.tolist(), c.num_drafts.tolist()))]
    n = torch.tensor([a for _, a in walks])
    tokens = torch.tensor([out + [-1] * (c.K + 1 - len(out)) for out, _ in walks])  # as _result() lays them out
    return ChainResult(tokens, n, lambda: _expected(c, target, n))
