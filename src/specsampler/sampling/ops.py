"""Sampling API: logits to processed probabilities, filters on probabilities, categorical draws.

The rules (vocab mask, temperature, top-k, top-p on the top-k-renormalised distribution, min-p; temperature 0
greedy; "order" is logit or probability desc, id asc): docs/design.md, "Sampling"; how rows are processed
without sorting the vocabulary: :mod:`.processing`. Draws: one uniform ``u`` per row (counters:
:mod:`specsampler.rng`), the first id, in id order, whose cumulative probability exceeds ``u * total``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import constants
from ..kernels import runs_kernel, use_triton
from ..params import RowParams, SamplingParams, check_field
from ..rng import STREAM_SAMPLE, Philox, check_rng, kernel_randomness, uniform
from ..tracing import eager_when_traced
from ..validation import (
    check_integer,
    check_logits_values,
    check_mode,
    check_no_bad,
    check_probs_values,
    check_readable,
    check_tensor,
    fail,
    shape_str,
)
from .filters import _clean_top, _scale, _unit_divisor, masked_logits, probability_weights, sample_plain
from .greedy import greedy_ids
from .masses import as_weight, prefix_masses
from .processing import Processed, _kinds, in_vector_body, process, sample_by_inversion


class SampleOutput(NamedTuple):
    """Result of :func:`sample_from_logits`; ``[B, ...]`` is the leading shape of the logits.

    tokens: int64 ``[B, ...]``, in ``[0, V)``.
    logprobs: float32 ``[B, ...]``, log-probability of each token under the processed distribution.
    top_token_ids: int64 ``[B, ..., N]`` (``num_logprobs = N``), the N most likely tokens of the
        processed distribution, most likely first; ``-1`` where it has fewer than N tokens.
        ``None`` when ``N == 0``.
    top_logprobs: float32 ``[B, ..., N]``, their log-probabilities (``-inf`` at ``-1``), or ``None``.
    """

    tokens: Tensor
    logprobs: Tensor
    top_token_ids: Tensor | None
    top_logprobs: Tensor | None


# ----------------------------------------------------------------------------- public API


def _leading(op: str, name: str, t: Tensor) -> tuple[int, int, int]:
    """(B, M, V) of a ``[B, ..., V]`` tensor: M rows per request."""
    check_tensor(op, name, t, kind="float", ndim=(2, 8))
    check_readable(op, name, t)
    B, V = t.shape[0], t.shape[-1]
    if V == 0:
        fail(op, name, "a vocabulary dimension V >= 1", f"shape {shape_str(t.shape)}")
    return B, (t.numel() // (B * V)) if B else 0, V


def logit_inputs(op, logits, params, vocab_mask, full,
                 live: Tensor | None = None) -> tuple[RowParams, Tensor | None, int, int]:
    """Validate the inputs of an op on logits ``[B, ..., V]``.

    Returns the parameters of each of the ``R = B * M`` rows, the vocab mask broadcast to the
    logits' shape (a view, or None), B and M. Reads no logits unless ``full``; then the values of
    the rows where ``live`` (bool ``[B, ...]``, default all) is True: a tree's absent nodes are padding.
    """
    B, M, V = _leading(op, "logits", logits)
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        fail(op, "params", "a SamplingParams or None", type(params).__name__)
    rp = params.rows(op, B, M, logits.device, full)
    mask = None
    if vocab_mask is not None:
        check_tensor(op, "vocab_mask", vocab_mask, kind="bool")
        try:
            mask = vocab_mask.to(logits.device)
        except (RuntimeError, NotImplementedError):  # e.g. a meta tensor: no values to copy
            fail(op, "vocab_mask", f"a tensor whose values can be read on logits' device {logits.device}",
                 f"one on {vocab_mask.device}")
        try:
            mask = mask.expand(logits.shape)
        except RuntimeError:
            fail(op, "vocab_mask", f"a shape broadcastable to logits {shape_str(logits.shape)}",
                 shape_str(vocab_mask.shape))
        if full:
            allowed = mask.sum(-1)  # quoted: a row's count of allowed tokens, 0
            empty = allowed == 0 if live is None else (allowed == 0) & live
            check_no_bad(op, "vocab_mask", empty, allowed, "at least one allowed token per row")
    if full:
        check_logits_values(op, "logits", logits if live is None else torch.where(live[..., None], logits, 0.0))
    return rp, mask, B, M


def logit_rows(op, logits, params, vocab_mask, full, live: Tensor | None = None) -> tuple[Tensor, RowParams, int, int]:
    """Validated, masked float32 rows ``[R, V]`` and their parameters, B and M (``live``: as :func:`logit_inputs`)."""
    rp, mask, B, M = logit_inputs(op, logits, params, vocab_mask, full, live)
    V = logits.shape[-1]
    x = logits.reshape(-1, V).float()
    if mask is not None:
        x = masked_logits(x, mask.reshape(-1, V))
    return x, rp, B, M


@eager_when_traced()
@torch.no_grad()
def logits_to_probs(
    logits: Tensor,
    params: SamplingParams | None = None,
    vocab_mask: Tensor | None = None,
    *,
    validate: str = "structure",
) -> Tensor:
    """The processed target distribution.

    Args:
        logits: float32/bf16/fp16 ``[B, ..., V]``.
        params: per-request :class:`SamplingParams` (scalars or ``[B]``); default: temperature 1.
        vocab_mask: bool, broadcastable to ``[B, ..., V]``; True = allowed. Applied first.
        validate: ``"structure"`` or ``"full"``.
    Returns:
        float32 ``[B, ..., V]``, each row summing to 1 (greedy rows one-hot at the argmax;
        a row with no allowed finite logit is all 0).
    """
    op = "logits_to_probs"
    full = check_mode(op, validate)
    x, rp, _, _ = logit_rows(op, logits, params, vocab_mask, full)
    return process(x, rp, logits=True).dense().reshape(logits.shape)


def _renorm(op: str, probs: Tensor, name: str, value, validate: str) -> Tensor:
    """One filter (``name``: top_k, top_p or min_p, its argument ``value``) over probability rows; errors name the op
    and the argument."""
    params = SamplingParams(**{name: check_field(op, name, name, value)})
    full = check_mode(op, validate)
    B, M, V = _leading(op, "probs", probs)
    if full:
        check_probs_values(op, "probs", probs)
    rp = params.rows(op, B, M, probs.device, full, label="")
    return process(probs.reshape(-1, V).float(), rp, logits=False).dense().reshape(probs.shape)


@eager_when_traced()
@torch.no_grad()
def top_k_renorm(probs: Tensor, top_k: int | Tensor, *, validate: str = "structure") -> Tensor:
    """Keep the ``top_k`` most likely tokens of each row (ties to the lower id) and renormalise.

    probs: float ``[B, ..., V]`` (need not be normalised); top_k: int or int tensor ``[B]``,
    ``<= 0`` or ``>= V`` is off. Returns float32 ``[B, ..., V]``.
    """
    return _renorm("top_k_renorm", probs, "top_k", top_k, validate)


@eager_when_traced()
@torch.no_grad()
def top_p_renorm(probs: Tensor, top_p: float | Tensor, *, validate: str = "structure") -> Tensor:
    """Keep the smallest prefix of the (prob desc, id asc) order whose mass reaches ``top_p``.

    probs: float ``[B, ..., V]``; top_p: float in (0, 1] or float tensor ``[B]``.
    Returns float32 ``[B, ..., V]``, renormalised.
    """
    return _renorm("top_p_renorm", probs, "top_p", top_p, validate)


@eager_when_traced()
@torch.no_grad()
def min_p_renorm(probs: Tensor, min_p: float | Tensor, *, validate: str = "structure") -> Tensor:
    """Keep tokens with probability ``>= min_p * max probability`` of their row, renormalised.

    probs: float ``[B, ..., V]``; min_p: float in [0, 1] or float tensor ``[B]``.
    Returns float32 ``[B, ..., V]``.
    """
    return _renorm("min_p_renorm", probs, "min_p", min_p, validate)


@eager_when_traced(runs_kernel)
@torch.no_grad()
def sample(probs: Tensor, rng: torch.Generator | Philox | None = None, *, validate: str = "structure") -> Tensor:
    """Draw one token from each distribution (categorical over the last dim).

    probs: float ``[B, ..., V]``, non-negative (need not be normalised).
    rng: ``None``, a ``torch.Generator`` or :class:`Philox` (row ``(b, j)`` uses request b's
    stream, index j = flat position inside the request).
    Returns int64 ``[B, ...]`` in ``[0, V)``.
    """
    op = "sample"
    full = check_mode(op, validate)
    check_rng(op, rng)
    B, M, V = _leading(op, "probs", probs)
    if full:
        check_probs_values(op, "probs", probs)
    if use_triton(probs.device):
        from ..kernels import ops

        seed, offset, index, u = _row_randomness(rng, op, B, M, probs.device)
        return ops.sample(probs.reshape(-1, V), seed, offset, index, u).reshape(probs.shape[:-1])
    u = uniform(rng, op, B, M, STREAM_SAMPLE, probs.device).reshape(-1)
    rows = probs.reshape(-1, V).float()
    top = _clean_top(rows)
    z = None if top is None else _unit_divisor(top)
    if z is not None:  # the weights are rows / z: their masses taken from the rows, without the weights' own pass
        return sample_by_inversion(rows, u, z=z).reshape(probs.shape[:-1])
    weights = probability_weights(rows, top)  # in [0, 1]: as the masses need
    return sample_by_inversion(weights, u, unit=True).reshape(probs.shape[:-1])


def _row_randomness(rng, op: str, B: int, M: int, device: torch.device):
    """For the sampling kernels: per row (``B * M``, request-major) the Philox seed, offset and
    draw index, or (with another rng) the uniforms the reference draws."""
    seed, offset, (u,) = kernel_randomness(rng, op, B, M, (STREAM_SAMPLE,), device)
    if seed is None:
        return None, None, None, u.reshape(-1)
    index = constants.index_in_request(B, M, device)
    if M == 1:  # one row a request: the keys as they are (a copy is a launch)
        return seed.contiguous(), offset.contiguous(), index, None
    return seed.repeat_interleave(M), offset.repeat_interleave(M), index, None


def _sample_kernel(*args, **kwargs) -> bool:
    """Whether :func:`sample_from_logits` takes its kernel, given its arguments (top-N log-probabilities: the PyTorch
    path)."""
    num_logprobs = args[4] if len(args) > 4 else kwargs.get("num_logprobs", 0)
    return num_logprobs == 0 and runs_kernel(*args, **kwargs)


@eager_when_traced(_sample_kernel)
@torch.no_grad()
def sample_from_logits(
    logits: Tensor,
    params: SamplingParams | None = None,
    rng: torch.Generator | Philox | None = None,
    vocab_mask: Tensor | None = None,
    num_logprobs: int = 0,
    *,
    validate: str = "structure",
) -> SampleOutput:
    """Process the logits (see :func:`logits_to_probs`) and draw one token per row.

    Draws the same token as ``sample(logits_to_probs(logits, params, vocab_mask), rng)`` for
    the same random stream (up to float rounding at a cumulative-probability boundary),
    without building the dense distribution when the kept set is small. One exception: a greedy row whose largest
    logit is +inf takes that token (log-probability -inf), where ``logits_to_probs`` gives the row no mass (all 0,
    which ``sample`` draws as token 0).

    Args:
        logits: float32/bf16/fp16 ``[B, ..., V]``.
        params: :class:`SamplingParams`, scalars or per request ``[B]``; temperature 0 = greedy.
        rng: ``None``, a ``torch.Generator`` or :class:`Philox`.
        vocab_mask: bool broadcastable to ``[B, ..., V]``, True = allowed.
        num_logprobs: N >= 0; also return the N most likely tokens and their log-probabilities.
    Returns:
        :class:`SampleOutput`.
    """
    op = "sample_from_logits"
    full = check_mode(op, validate)
    check_rng(op, rng)
    num_logprobs = check_integer(op, "num_logprobs", num_logprobs, 0)  # NumPy's integers too, as the other counts
    lead = logits.shape[:-1]
    if num_logprobs == 0 and use_triton(logits.device):  # top-N log-probabilities: the PyTorch path
        from ..kernels import ops

        rp, mask, B, M = logit_inputs(op, logits, params, vocab_mask, full)
        V = logits.shape[-1]
        seed, offset, index, u = _row_randomness(rng, op, B, M, logits.device)
        mask = None if mask is None else mask.reshape(-1, V)  # a view where it can be: the kernel takes row strides
        tokens, logprobs = ops.sample_from_logits(logits.reshape(-1, V), rp.temperature, rp.top_k, rp.top_p,
                                                  rp.min_p, mask, seed, offset, index, u)
        return SampleOutput(tokens.reshape(lead), logprobs.reshape(lead), None, None)
    x, rp, B, M = logit_rows(op, logits, params, vocab_mask, full)
    R, V = x.shape
    on_host = rp.shared if rp.shared is not None else rp  # every row's parameters as numbers, when shared
    greedy, _, _, plain = _kinds(on_host.temperature, on_host.top_k, on_host.top_p, V, True)  # bools, or bool [R]
    if not num_logprobs and (greedy if isinstance(greedy, bool) else bool(greedy.all())):
        return _greedy_output(x, rng, op, B, M, lead)
    u = uniform(rng, op, B, M, STREAM_SAMPLE, logits.device).reshape(-1)
    # rows kept whole (no top-k, no top-p) pass over every value several times: in blocks, from the caches, and
    # where wide drawn without writing their distribution, in a batch of several kinds too (each row's numbers are
    # its own, so its kind's path gives them)
    every = plain if isinstance(plain, bool) else R > 0 and bool(plain.all())
    some = every or not isinstance(plain, bool) and bool(plain.any())
    step = max(1, _BLOCK_VALUES // max(V, 1)) if x.device.type == "cpu" else max(R, 1)
    drawn = not num_logprobs and V >= _DRAWN_IN_BOUNDS  # plain rows drawn without writing their distribution
    top_ids = top_lp = None
    if drawn and every:
        tokens, logprobs = sample_plain(x, rp, u, step)
    elif drawn and some:
        tokens, logprobs = torch.empty(R, dtype=torch.int64, device=x.device), x.new_empty(R)
        for rows, draw in ((plain.nonzero()[:, 0], lambda rows: sample_plain(x, rp.take(rows), u[rows], step, rows)),
                           ((~plain).nonzero()[:, 0], lambda rows: _sample_rows(x, rp.take(rows), u[rows], 0, rows))):
            tokens[rows], logprobs[rows] = draw(rows)[:2]  # each kind's rows read where they lie
    elif every and step < R:
        blocks = [_sample_rows(x[s:s + step], rp.take(torch.arange(s, min(R, s + step), device=x.device)),
                               u[s:s + step], num_logprobs) for s in range(0, R, step)]
        tokens, logprobs, top_ids, top_lp = (torch.cat(parts) if parts[0] is not None else None
                                             for parts in zip(*blocks))
    else:
        tokens, logprobs, top_ids, top_lp = _sample_rows(x, rp, u, num_logprobs)
    if num_logprobs:
        top_ids, top_lp = top_ids.reshape(*lead, num_logprobs), top_lp.reshape(*lead, num_logprobs)
    return SampleOutput(tokens.reshape(lead), logprobs.reshape(lead), top_ids, top_lp)


def _greedy_output(x: Tensor, rng, op: str, B: int, M: int, lead: torch.Size) -> SampleOutput:
    """:func:`sample_from_logits` of greedy rows ``x`` float32 ``[R, V]``: the argmax (NaN never chosen), of
    log-probability 0, or -inf where the row's largest value is not finite (a one-hot of no mass), as the
    processed rows give them, in a pass instead of their processing and draw. A generator (or the global
    one) still gives the uniforms those draws would take, so that its later numbers do not change; a Philox's
    keys are still checked."""
    if isinstance(rng, Philox):
        rng.keys(op, B, x.device)
    else:
        uniform(rng, op, B, M, STREAM_SAMPLE, x.device)
    tokens = greedy_ids(x)
    top = x.gather(1, tokens[:, None])[:, 0]
    logprobs = torch.where(torch.isfinite(top), 0.0, float("-inf")).to(x.dtype)
    return SampleOutput(tokens.reshape(lead), logprobs.reshape(lead), None, None)


_BLOCK_VALUES = 1 << 20  # values per block of dense rows sampled at a time on CPU: 4 MB of float32, in cache
_DRAWN_IN_BOUNDS = 1024  # dense rows this wide are drawn by sample_plain (shorter ones: a few ops of process)


def _sample_rows(x: Tensor, rp: RowParams, u: Tensor, num_logprobs: int,
                 among: Tensor | None = None) -> tuple[Tensor, ...]:
    """Tokens int64 ``[r]``, their log-probabilities and the top ``num_logprobs`` ids and log-probabilities (or
    None) of rows ``x`` float32 ``[r, V]`` (or of its rows ``among``, int64 ``[r]``: :func:`process`). Each row's
    numbers are its own whatever the rows beside it, so :func:`sample_from_logits` takes a batch in blocks whose
    temporaries stay in the CPU's caches."""
    proc = process(x, rp, logits=True, min_candidates=num_logprobs, among=among)
    tokens = proc.sample(u)
    logprobs = in_vector_body(torch.log, proc.prob(tokens))
    return (tokens, logprobs, *(proc.top(num_logprobs) if num_logprobs else (None, None)))


# ------------------------------------------------------------------- small rows, for callers that built the inputs

_SMALL_V = 1024  # process() orders top-p rows this short whole, and so does _process_small


def _small_constants(rp: RowParams, V: int) -> tuple[Tensor, ...] | None:
    """The per-row constants :func:`_process_small` takes for rows ``rp`` over ``V`` tokens
    (``log2(e) / T`` float32 ``[R, 1]``, top-p float64 ``[R, 1]``), or None where it does not
    apply: rows not sharing scalar parameters, top-k, greedy, no top-p, min-p, or V not a
    multiple of 64 up to 1024."""
    s = rp.shared
    if s is None or V > _SMALL_V or V % 64 or s.temperature == 0 or 0 < s.top_k < V or s.top_p >= 1 or s.min_p:
        return None
    return _scale(rp.temperature), rp.top_p.double()[:, None]


def _process_small(x: Tensor, small: tuple[Tensor, ...]) -> Processed | None:
    """``process(x, rp, logits=True)`` for top-p rows over a short vocabulary, in a fraction of its ops.

    x: float32 ``[R, V]``; small: :func:`_small_constants`. The same arithmetic as
    :func:`process` takes for such rows (``exp2`` of ``(x - top) * c``, the top-p cut in the
    (weight desc, id asc) order and the normalisation on exact masses), so the same numbers;
    returned dense, which samples and reads as the candidates in id order do. None where a row's
    maximum is not finite (use :func:`process`).
    """
    c, top_p = small
    top = x.amax(-1, keepdim=True)
    # a NaN logit makes its row's maximum NaN: past this check the rows hold numbers, and weights in [0, 1]
    if not all(math.isfinite(v) for (v,) in top.tolist()):
        return None  # process() handles rows without mass (see filters._weights)
    # bit for bit process()'s weights (elementwise, every value in the vectorised body: in_vector_body),
    # here in id order, so that a stable sort puts them in the top-p order (weight desc, id asc) at once
    xc = torch.sub(x, top).mul_(c)
    w, order = torch.sort(in_vector_body(torch.exp2, xc), dim=-1, descending=True, stable=True)
    cum = prefix_masses(w, xc)  # of masses.masses(): weights in [0, 1] (xc, the exponents, is free now)
    # a token is kept where the mass before it is below masses.top_p_target, ceil(top_p * Z) (at most Z already:
    # top_p < 1 and Z an integer): the first n + 1, n the count of prefix masses below it (cum ends at Z: n < V)
    n = torch.searchsorted(cum, torch.ceil(top_p * cum[:, -1:]))
    # process()'s normalisation: the kept weights over their exact mass (at least the top's, 2**32: no zero)
    kept = torch.where(constants.index_in_request(1, x.shape[1], x.device) <= n, w, 0.0)
    kept.div_(as_weight(cum.gather(1, n)))
    # every row keeps its top weight, 1: a positive mass, and quotients in [0, 1]
    return Processed.from_dense(xc.scatter_(1, order, kept), positive=True)  # xc's masses are summed: free


def _process_prepared(x: Tensor, rp: RowParams, constants: tuple[Tensor, ...] | None) -> Processed:
    """``process(x, rp, logits=True)``, by :func:`_process_small` where its ``constants`` are given and it applies."""
    out = _process_small(x, constants) if constants is not None else None
    return out if out is not None else process(x, rp, logits=True)
