"""MLC-LLM entry points: the interfaces of seeds 000 (``batch_spec_verify``) and 001 (the Sampler).

These keep MLC-LLM's signatures (in snake_case) and documented behaviour, including its in-place
buffers, so an engine written against MLC-LLM can call them unchanged. Where that behaviour is
lossy for some inputs the docstring says so and names the lossless specsampler function.

What the module holds:

- :func:`batch_spec_verify`: seed 000's tree verification kernel (global node indices, in place).
- :class:`Sampler`: seed 001's sampler (``create_cpu_sampler``, ``create_gpu_sampler``,
  ``supports_gpu_sampler`` and the four ``batch_*`` methods), built on :func:`specsampler.top_k_renorm`,
  :func:`specsampler.top_p_renorm`, :func:`specsampler.min_p_renorm`, :func:`specsampler.sample`,
  :func:`specsampler.verify_tree` and :class:`specsampler.Philox`.
- :class:`GenerationConfig`: MLC's per-request sampling configuration (plus ``top_k`` and ``min_p``).
- :class:`RandomGenerator`: one per request; a seed and a step offset (a :class:`~specsampler.Philox` stream).
- :class:`SampleResult`: a sampled token with its probability and the most likely tokens, and
  its logprobs in OpenAI's layout.
- :class:`SpecDecodeMetrics`: acceptance statistics of speculative decoding, in MLC's JSON layout.
- :class:`EventTraceRecorder`: per-request events of the sampler's calls, as a Chrome trace (Perfetto).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels import use_triton
from ..sampling.processing import ordered_prefix, row_sum
from ..rng import Philox
from ..sampling.ops import min_p_renorm, sample, top_k_renorm, top_p_renorm
from ..verify.token_tree import TokenTree
from ..verify.tree import DRAFT_SAMPLING, METHODS, verify_tree
from ..validation import (
    check_device,
    check_mode,
    check_no_bad,
    check_shape,
    check_tensor,
    fail,
    shape_str,
    values_checkable,
)

_DEGENERATE_SUM = 1e-7  # a residual with a smaller mass is not renormalised: the child is accepted (seed 000)


def _check_node_values(op: str, name: str, bad: Tensor, values: Tensor, expected: str) -> None:
    """Fail on the first True of ``bad`` (indexed by node, then token), naming that entry."""
    hit = torch.nonzero(bad)
    if hit.numel():
        idx = tuple(int(i) for i in hit[0])
        fail(op, f"{name}[{', '.join(map(str, idx))}]", expected, values[idx].item())


def _check_contiguous(op: str, name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        fail(op, name, "a contiguous tensor (it is written in place)", f"strides {t.stride()}")


def _check_inputs(
    op: str,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    model_probs: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    uniform_samples: Tensor,
    parent_ptr: Tensor,
    full: bool,
) -> None:
    check_tensor(op, "draft_probs", draft_probs, kind="float", ndim=2)
    num_nodes, V = draft_probs.shape
    if num_nodes == 0 or V == 0:
        fail(op, "draft_probs", "shape [num_nodes, V] with num_nodes >= 1 and V >= 1", list(draft_probs.shape))
    dev = draft_probs.device

    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=1)
    check_shape(op, "draft_tokens", draft_tokens, (num_nodes,), "[num_nodes]")
    check_device(op, "draft_tokens", draft_tokens, dev)

    check_tensor(op, "model_probs", model_probs, kind="float", ndim=2)
    check_shape(op, "model_probs", model_probs, (num_nodes, V), "[num_nodes, V]")
    check_device(op, "model_probs", model_probs, dev)
    if model_probs.dtype != torch.float32:
        fail(op, "model_probs", "dtype torch.float32 (it is written in place)", model_probs.dtype)
    _check_contiguous(op, "model_probs", model_probs)

    for name, t in (("token_tree_first_child", first_child), ("token_tree_next_sibling", next_sibling)):
        check_tensor(op, name, t, kind="int", ndim=1)
        check_shape(op, name, t, (num_nodes,), "[num_nodes]")
        check_device(op, name, t, dev)
        if values_checkable(t, full):
            _check_node_values(op, name, (t < -1) | (t >= num_nodes), t, f"node indices in [-1, {num_nodes})")

    check_tensor(op, "uniform_samples", uniform_samples, kind="float", ndim=1)
    check_shape(op, "uniform_samples", uniform_samples, (num_nodes,), "[num_nodes]")
    check_device(op, "uniform_samples", uniform_samples, dev)

    check_tensor(op, "token_tree_parent_ptr", parent_ptr, kind="int", ndim=1)
    check_device(op, "token_tree_parent_ptr", parent_ptr, dev)
    _check_contiguous(op, "token_tree_parent_ptr", parent_ptr)
    if values_checkable(parent_ptr, full):
        bad = (parent_ptr < 0) | (parent_ptr >= num_nodes)
        check_no_bad(op, "token_tree_parent_ptr", bad, parent_ptr, f"root node indices in [0, {num_nodes})")

    if full:
        # Draft tokens, draft rows and uniforms are read only for nodes that are some node's child.
        linked = torch.zeros(num_nodes, dtype=torch.bool, device=dev)
        for links in (first_child, next_sibling):
            linked[links[links >= 0].long()] = True
        tok = draft_tokens
        _check_node_values(op, "draft_tokens", linked & ((tok < 0) | (tok >= V)), tok, f"token ids in [0, {V})")
        for name, probs, rows in (("draft_probs", draft_probs, linked[:, None]), ("model_probs", model_probs, True)):
            bad = ~(torch.isfinite(probs) & (probs >= 0)) & rows
            _check_node_values(op, name, bad, probs, "finite probabilities >= 0")
        u = uniform_samples
        _check_node_values(op, "uniform_samples", linked & ~((u >= 0) & (u <= 1)), u, "values in [0, 1]")


@torch.no_grad()
def batch_spec_verify(
    draft_probs: Tensor,
    draft_tokens: Tensor,
    model_probs: Tensor,
    token_tree_first_child: Tensor,
    token_tree_next_sibling: Tensor,
    uniform_samples: Tensor,
    token_tree_parent_ptr: Tensor,
    *,
    validate: str = "structure",
) -> None:
    """Verify a batch of draft token trees as MLC-LLM's ``batch_spec_verify`` kernel does (seed 000).

    All node indices are global: the trees of all requests live in one array of
    ``num_nodes`` nodes, every request's tree in its own (disjoint) set of nodes.

    Args:
        draft_probs: float ``[num_nodes, V]``; row c is the draft distribution node c's token
            was drawn from (rows of roots are not read).
        draft_tokens: int ``[num_nodes]``; the token of each node. A token outside ``[0, V)`` is
            never accepted: it goes through the rejection branch with its draft row.
        model_probs: float32 ``[num_nodes, V]``, contiguous; row v is the target distribution at
            node v, used to verify v's children. **Modified in place**: when a child of v is
            rejected, row v is replaced by the normalised residual ``max(p_v - q_child, 0)``.
        token_tree_first_child: int ``[num_nodes]``; first child of each node, -1 = none.
        token_tree_next_sibling: int ``[num_nodes]``; next sibling of each node, -1 = none.
        uniform_samples: float ``[num_nodes]``; uniform in [0, 1) for the acceptance test of each node.
        token_tree_parent_ptr: int ``[nbatch]``, contiguous. **In/out**: on input the root node of
            each request; on output the last accepted node of each request.
        validate: ``"structure"`` (default) or ``"full"``, see :mod:`specsampler.validation`. Node
            indices are checked on CPU tensors or in full mode; full mode also checks token ids
            and probability values of the nodes read.

    For each request, starting at ``parent = root`` and ``child = first_child[parent]``, while
    ``child != -1``: with ``x = draft_tokens[child]``, accept iff
    ``model_probs[parent, x] >= uniform_samples[child] * draft_probs[child, x]`` and move to
    ``parent = child``, ``child = first_child[child]``. Otherwise compute
    ``r = max(model_probs[parent] - draft_probs[child], 0)``: if ``sum(r) < 1e-7`` accept
    anyway, else set ``model_probs[parent] = r / sum(r)`` and try ``next_sibling[child]``. At
    the end ``token_tree_parent_ptr[b] = parent``; the caller then samples the next token from
    ``model_probs[token_tree_parent_ptr[b]]``. Computed in float32.

    Lossless only when sibling drafts were drawn i.i.d. from the same distribution. For
    children chosen deterministically (top-k, beam) this rule is off the target distribution;
    use ``specsampler.verify_tree(..., method="target_only")``. For siblings drawn without
    replacement use ``specsampler.verify_tree(..., method="rrs", draft_sampling="without_replacement")``.

    Whatever the values, nothing is read out of bounds and the output pointers are node indices:
    links outside ``[-1, num_nodes)`` end the walk like -1, a root outside ``[0, num_nodes)``
    is clamped into range and not walked, and a walk stops after ``num_nodes + 1`` steps
    (a cycle in the links).
    """
    op = "mlc.batch_spec_verify"
    full = check_mode(op, validate)
    _check_inputs(
        op,
        draft_probs,
        draft_tokens,
        model_probs,
        token_tree_first_child,
        token_tree_next_sibling,
        uniform_samples,
        token_tree_parent_ptr,
        full,
    )
    num_nodes, V = draft_probs.shape
    if use_triton(model_probs.device):
        from ..kernels import ops

        ops.mlc_batch_spec_verify(draft_probs, draft_tokens, model_probs, token_tree_first_child,
                                  token_tree_next_sibling, uniform_samples, token_tree_parent_ptr)
        return

    def links(t: Tensor) -> Tensor:
        """int64 copy with every value outside [-1, num_nodes) read as -1."""
        t = t.long()
        return torch.where((t >= 0) & (t < num_nodes), t, -1)

    first_child, next_sibling = links(token_tree_first_child), links(token_tree_next_sibling)
    roots = token_tree_parent_ptr.long()
    parent = roots.clamp(0, num_nodes - 1)
    child = torch.where(roots == parent, first_child[parent], -1)
    walking = torch.nonzero(child >= 0).squeeze(1)  # requests still walking

    with torch.no_grad():
        for _ in range(num_nodes + 1):
            if walking.numel() == 0:
                break
            par, chi = parent[walking], child[walking]
            tok = draft_tokens[chi].long()
            in_vocab = (tok >= 0) & (tok < V)
            tok = tok.clamp(0, V - 1)
            p = model_probs[par, tok]
            q = draft_probs[chi, tok].float()
            accept = in_vocab & (p >= uniform_samples[chi].float() * q)

            rejected = torch.nonzero(~accept).squeeze(1)
            if rejected.numel():
                rows = par[rejected]
                residual = (model_probs[rows] - draft_probs[chi[rejected]].float()).clamp_min(0.0)
                mass = row_sum(residual)
                degenerate = mass < _DEGENERATE_SUM
                write = ~degenerate
                model_probs[rows[write]] = residual[write] / mass[write, None]
                accept[rejected[degenerate & in_vocab[rejected]]] = True

            parent[walking] = torch.where(accept, chi, par)
            child[walking] = torch.where(accept, first_child[chi], next_sibling[chi])
            walking = walking[child[walking] >= 0]
        token_tree_parent_ptr.copy_(parent)


# ============================================================================ seed 001: the Sampler

_GREEDY_TEMPERATURE = 1e-5  # MLC: a temperature below this samples the argmax
_MIN_PROB = 1e-10  # MLC: logprob = log(max(prob, 1e-10))
_MAX_TOP_LOGPROBS = 20  # OpenAI's limit
_TRACE_PID = 1


def _is_int(v: object) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _is_greedy(cfg: GenerationConfig) -> bool:
    return cfg.temperature < _GREEDY_TEMPERATURE


@dataclass(frozen=True)
class GenerationConfig:
    """A request's generation configuration: MLC-LLM's fields, plus ``top_k`` and ``min_p``.

    The :class:`Sampler` reads ``temperature`` (only to tell greedy requests apart: below
    ``1e-5`` it samples the argmax, as MLC does), ``top_k``, ``top_p``, ``min_p``, ``logprobs``
    and ``top_logprobs``. Temperature scaling itself, the penalties and ``logit_bias`` are
    applied to the logits by MLC's LogitProcessor *before* the sampler, which takes
    probabilities: the sampler does not apply them, and this library has no logit processor.
    ``n``, ``seed``, ``max_tokens`` and ``stop_token_ids`` are the engine's (a
    :class:`RandomGenerator` is made from ``seed``).

    Args:
        n: completions per prompt, ``>= 1``.
        temperature: ``>= 0``; below ``1e-5`` greedy (argmax, ties to the lower id).
        top_p: in ``(0, 1]``; ``1`` is off.
        top_k: keep the k most likely tokens; ``<= 0`` is off.
        min_p: in ``[0, 1]``; keep the tokens with probability ``>= min_p * max probability``.
        frequency_penalty, presence_penalty: in ``[-2, 2]`` (OpenAI's range).
        repetition_penalty: ``> 0``; ``1`` is off.
        logprobs: return log-probabilities (:meth:`SampleResult.get_logprob_json`).
        top_logprobs: in ``[0, 20]``: how many of the most likely tokens to return at each
            position; ``> 0`` requires ``logprobs`` (as OpenAI).
        logit_bias: ``None`` or ``{token id >= 0: bias in [-100, 100]}``.
        seed: ``None`` or an int.
        max_tokens: ``None`` (no limit) or an int ``>= 1``.
        stop_token_ids: token ids ``>= 0``, any sequence (stored as a tuple).

    Raises :class:`~specsampler.ValidationError` naming the field when a value is out of range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        def check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                fail("GenerationConfig", f"GenerationConfig.{name}", expected, repr(getattr(self, name)))

        check("n", _is_int(self.n) and self.n >= 1, "an int >= 1")
        check("temperature", _is_real(self.temperature) and self.temperature >= 0, "a finite number >= 0")
        check("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]")
        check("top_k", _is_int(self.top_k), "an int (<= 0: off)")
        check("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            check(name, _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]")
        check("repetition_penalty", _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
              "a finite number > 0")
        check("logprobs", isinstance(self.logprobs, bool), "a bool")
        check("top_logprobs", _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS,
              f"an int in [0, {_MAX_TOP_LOGPROBS}]")
        check("top_logprobs", self.logprobs or self.top_logprobs == 0, "0 unless logprobs is True")
        bias = self.logit_bias
        check("logit_bias", bias is None or (isinstance(bias, dict) and all(
            _is_int(k) and k >= 0 and _is_real(v) and -100 <= v <= 100 for k, v in bias.items())),
            "None or a dict {token id >= 0: bias in [-100, 100]}")
        check("seed", self.seed is None or _is_int(self.seed), "None or an int")
        check("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "None or an int >= 1")
        stop = self.stop_token_ids
        check("stop_token_ids", isinstance(stop, Sequence) and not isinstance(stop, str)
              and all(_is_int(t) and t >= 0 for t in stop), "a sequence of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))


class RandomGenerator:
    """A request's random stream: the :class:`~specsampler.Philox` stream ``(seed, offset)``.

    One per request. Each :class:`Sampler` call that draws for a request reads its generator's
    stream at ``offset`` and then advances ``offset`` by 1; a generator that serves k samples of
    one call reads offsets ``offset, ..., offset + k - 1`` in sample order and advances by k.
    So consecutive calls draw new numbers, and a new generator with the same seed replays the
    same draws, whatever the rest of the batch.

    Args:
        seed: an int (its value modulo 2**64, as two's complement int64, is the Philox key), or
            None for a random 63-bit seed from :mod:`secrets`.
    Attributes:
        seed: int, as given (or drawn).
        offset: int, the step counter; starts at 0.
    """

    def __init__(self, seed: int | None = None):
        if seed is None:
            seed = secrets.randbits(63)
        elif not _is_int(seed):
            fail("RandomGenerator", "seed", "None or an int", repr(seed))
        self.seed = int(seed)
        self.offset = 0

    def __repr__(self) -> str:
        return f"RandomGenerator(seed={self.seed}, offset={self.offset})"


def _philox(rngs: list[RandomGenerator], device: torch.device) -> Philox:
    """The streams of one call (rng i at its offset, int64 tensors ``[n]`` on ``device``); advances each rng."""
    seeds, offsets = [], []
    for r in rngs:
        seeds.append((r.seed + 2**63) % 2**64 - 2**63)
        offsets.append(r.offset)
        r.offset += 1
    return Philox(torch.tensor(seeds, dtype=torch.int64, device=device),
                  torch.tensor(offsets, dtype=torch.int64, device=device))


def _token_string(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return str(token_id)
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return str(tokenizer.convert_ids_to_tokens(token_id))
    return str(tokenizer.decode([token_id]))


def _logprob_entry(tokenizer, token_id: int, prob: float) -> dict:
    text = _token_string(tokenizer, token_id)
    logprob = math.log(prob if prob > _MIN_PROB else _MIN_PROB)  # NaN too becomes 1e-10
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


@dataclass
class SampleResult:
    """A sampled token (MLC's ``SampleResult``).

    sampled_token_id: ``(token id, probability)``: the token and its probability in the row it
        was drawn from (each :class:`Sampler` method says which row).
    top_prob_tokens: ``[(token id, probability), ...]``: the ``top_logprobs`` most likely tokens
        of that row, most likely first (ties: lower id first); empty unless the request's
        config has ``logprobs``.
    """

    sampled_token_id: tuple[int, float]
    top_prob_tokens: list[tuple[int, float]] = field(default_factory=list)

    def get_token_id(self) -> int:
        """The sampled token id."""
        return self.sampled_token_id[0]

    def get_logprob_json(self, tokenizer=None, logprob: bool = True) -> str:
        """The token's logprobs as a JSON object in OpenAI's layout, or ``""`` when ``logprob`` is False.

        Whether logprobs are on is the caller's to say, as in MLC's ``GetLogProbJSON(tokenizer,
        logprob)``: pass the request's ``GenerationConfig.logprobs``.

        Returns ``{"token": str, "logprob": float, "bytes": [int, ...], "top_logprobs": [{"token",
        "logprob", "bytes"}, ...]}`` (``top_logprobs`` from :attr:`top_prob_tokens`, in order), with
        ``logprob = log(max(prob, 1e-10))`` and ``bytes`` the UTF-8 bytes of the token string.
        The token string is ``str(token_id)`` without a tokenizer, else
        ``tokenizer.convert_ids_to_tokens(token_id)`` if it has that method, else
        ``tokenizer.decode([token_id])``.
        """
        if not logprob:
            return ""
        top = [_logprob_entry(tokenizer, t, p) for t, p in self.top_prob_tokens]
        return json.dumps({**_logprob_entry(tokenizer, *self.sampled_token_id), "top_logprobs": top})


@dataclass
class SpecDecodeMetrics:
    """Acceptance statistics of speculative decoding (MLC's ``SpecDecodeMetrics``).

    draft_count[j]: verification steps that had a token at position j; accept_count[j]: steps
    that accepted position j. Positions count the draft tokens and the base model's own last
    prediction (the correction or bonus token), so position 0 is always accepted.
    """

    draft_count: list[int] = field(default_factory=list)
    accept_count: list[int] = field(default_factory=list)

    def update(self, draft_length: int, accept_length: int) -> None:
        """Count one verification step.

        draft_length: the tokens of the step, drafts plus the base model's last prediction.
        accept_length: the tokens it emitted (accepted drafts plus one), in ``[1, draft_length]``.
        Raises ``ValueError`` (:class:`~specsampler.ValidationError`) otherwise.
        """
        op = "SpecDecodeMetrics.update"
        if not _is_int(accept_length) or accept_length < 1:
            fail(op, "accept_length", "an int >= 1", repr(accept_length))
        if not _is_int(draft_length) or draft_length < accept_length:
            fail(op, "draft_length", f"an int >= accept_length = {accept_length}", repr(draft_length))
        grow = draft_length - len(self.draft_count)
        if grow > 0:
            self.draft_count += [0] * grow
            self.accept_count += [0] * grow
        for j in range(draft_length):
            self.draft_count[j] += 1
            if j < accept_length:
                self.accept_count[j] += 1

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not self.draft_count

    def reset(self) -> None:
        """Forget all counts."""
        self.draft_count.clear()
        self.accept_count.clear()

    def as_json(self) -> dict:
        """The metrics in MLC's layout (Prometheus-style labels).

        ``{"draft_count": [...], "accept_count": [...], "accept_prob": {"accept_prob{step=i}":
        accept_count[i] / draft_count[i]}, "accept_rate": {"accept_rate{step=i}": accept_count[i] /
        accept_count[i-1] for i >= 1 (0.0 when accept_count[i-1] == 0)}, "accept_len":
        {"accept_len{step=i}": the sum of accept_prob over steps 0..i}}``.
        """
        accept_prob, accept_rate, accept_len = {}, {}, {}
        total = 0.0
        for i, (drafted, accepted) in enumerate(zip(self.draft_count, self.accept_count)):
            prob = accepted / drafted
            total += prob
            accept_prob[f"accept_prob{{step={i}}}"] = prob
            accept_len[f"accept_len{{step={i}}}"] = total
            if i:
                before = self.accept_count[i - 1]
                accept_rate[f"accept_rate{{step={i}}}"] = accepted / before if before else 0.0
        return {"draft_count": list(self.draft_count), "accept_count": list(self.accept_count),
                "accept_prob": accept_prob, "accept_rate": accept_rate, "accept_len": accept_len}


class EventTraceRecorder:
    """Per-request events, written as a Chrome trace JSON (opens in Perfetto or chrome://tracing).

    An event ``"start X"`` opens a duration named ``X`` on the request's track and
    ``"finish X"`` closes it (trace phases ``"B"`` / ``"E"``); any other event is an instant
    (``"i"``). Each request id has its own track: a thread id, named after the request with a
    ``thread_name`` metadata event. Timestamps are microseconds of :func:`time.perf_counter`
    since the recorder was created. Thread-safe.
    """

    _START, _FINISH = "start ", "finish "

    def __init__(self):
        self._origin = time.perf_counter()
        self._events: list[tuple[str, str, float]] = []  # (request id, event, microseconds)
        self._lock = threading.Lock()

    def add_event(self, request_id: str, event: str) -> None:
        """Record ``event`` for one request now."""
        self.add_event_batch([request_id], event)

    def add_event_batch(self, request_ids: Sequence[str], event: str) -> None:
        """Record ``event`` for each of ``request_ids``, at one timestamp."""
        if not isinstance(event, str):
            fail("EventTraceRecorder.add_event", "event", "a str", type(event).__name__)
        ts = (time.perf_counter() - self._origin) * 1e6
        with self._lock:
            self._events.extend((str(r), event, ts) for r in request_ids)

    def dump_json(self) -> str:
        """The trace: a JSON object ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
        with self._lock:
            events = list(self._events)
        tids: dict[str, int] = {}
        trace = []
        for request_id, event, ts in events:
            if request_id not in tids:
                tids[request_id] = len(tids) + 1
                trace.append({"name": "thread_name", "ph": "M", "pid": _TRACE_PID, "tid": tids[request_id],
                              "args": {"name": request_id}})
            if event.startswith(self._START):
                name, phase = event[len(self._START):], "B"
            elif event.startswith(self._FINISH):
                name, phase = event[len(self._FINISH):], "E"
            else:
                name, phase = event, "i"
            entry = {"name": name, "ph": phase, "ts": round(ts, 3), "pid": _TRACE_PID, "tid": tids[request_id]}
            if phase == "i":
                entry["s"] = "t"  # an instant on the request's track
            trace.append(entry)
        return json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"})

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`dump_json` to ``path`` (UTF-8)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.dump_json())


# ----------------------------------------------------------------------------- Sampler helpers


def _checked_list(op: str, name: str, values: object, n: int | None, what: str, kind: type) -> list:
    """``values`` as a list of ``n`` (when given) instances of ``kind``."""
    if isinstance(values, (str, bytes, Tensor)) or not isinstance(values, Iterable):
        fail(op, name, f"a sequence of {kind.__name__}", type(values).__name__)
    values = list(values)
    if n is not None and len(values) != n:
        fail(op, name, f"{n} entries ({what})", f"{len(values)} entries")
    for i, v in enumerate(values):
        if not isinstance(v, kind):
            fail(op, f"{name}[{i}]", f"a {kind.__name__}", type(v).__name__, request=i)
    return values


def _host_ints(op: str, name: str, values: object) -> Tensor:
    """A sequence of ints (or a 1-D integer tensor) as a CPU int64 tensor."""
    if isinstance(values, Tensor):
        check_tensor(op, name, values, kind="int", ndim=1)
        return values.to("cpu", torch.int64)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        fail(op, name, "a sequence of ints or a 1-D integer tensor", type(values).__name__)
    values = list(values)
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    try:
        t = torch.tensor(values)  # ints give an integer dtype; a float or a bool among them does not
    except (TypeError, ValueError, RuntimeError, OverflowError):
        t = None
    if t is None or t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        bad = next((i for i, v in enumerate(values) if not _is_int(v)), None)
        if bad is not None:
            fail(op, f"{name}[{bad}]", "an int", repr(values[bad]))
        fail(op, name, "a sequence of ints that fit in int64", "other values")
    return t.to(torch.int64)


def _num_top(cfg: GenerationConfig) -> int:
    return cfg.top_logprobs if cfg.logprobs else 0


def _filter(rows: Tensor, cfgs: list[GenerationConfig], validate: str) -> Tensor:
    """Each config's top-k (1 for greedy configs), top-p and min-p on its row, renormalised.

    DESIGN.md's order, one call of each renorm op for the batch. rows: float32 ``[n, V]``.
    Returns float32 ``[n, V]`` (greedy rows one-hot at the argmax, ties to the lower id).
    """
    dev, V = rows.device, rows.shape[1]
    top_k = [1 if _is_greedy(c) else max(0, min(c.top_k, V)) for c in cfgs]
    out = top_k_renorm(rows, torch.tensor(top_k, dtype=torch.int64, device=dev), validate=validate)
    out = top_p_renorm(out, torch.tensor([c.top_p for c in cfgs], dtype=torch.float32, device=dev),
                       validate=validate)
    return min_p_renorm(out, torch.tensor([c.min_p for c in cfgs], dtype=torch.float32, device=dev),
                        validate=validate)


def _top_tokens(probs: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens of ``probs[rows]`` (prob desc, id asc).

    probs: float ``[R, V]``; rows: int64 ``[n]``. Returns ids int64 and probabilities float32,
    ``[n, min(k, V)]``.
    """
    if k == 0:
        return rows.new_zeros(rows.shape[0], 0), probs.new_zeros(rows.shape[0], 0, dtype=torch.float32)
    values, ids = ordered_prefix(probs[rows].float(), k)
    return ids, values


def _to_host(*parts: Tensor) -> list[Tensor]:
    """2-D tensors ``[n, w_i]`` on the host, in ONE transfer: packed as float64 (token ids below
    2**53 and float32 probabilities exactly), split again on the host."""
    host = torch.cat([p.double() for p in parts], 1).cpu()
    return list(host.split([p.shape[1] for p in parts], 1))


def _top_list(ids: list[int], probs: list[float], count: int) -> list[tuple[int, float]]:
    return [(int(t), p) for t, p in zip(ids[:count], probs[:count])]


class Sampler:
    """Seed 001's sampler: draws tokens from probabilities and verifies draft trees, a batch per call.

    Make one with :meth:`create_cpu_sampler` or :meth:`create_gpu_sampler`. Both run the same
    code with the same semantics, on specsampler's ops (top-k/top-p/min-p renorm, ``sample``,
    ``verify_tree``; the vectorized PyTorch path, whose ops dispatch to Triton kernels on CUDA):

    - the CPU sampler moves its inputs to the CPU and returns CPU tensors;
    - the GPU sampler keeps everything on its device (inputs must be there) and checks its
      capacity, ``max_num_sample`` and ``vocab_size``.

    Every method works on the whole batch at once: one call of each op for all samples, with
    the per-sample parameters as tensors, and the results (token ids, probabilities, top
    tokens, accepted counts) move to the host in one transfer, from which the Python lists of
    :class:`SampleResult` are built.

    Inputs are probabilities after MLC's LogitProcessor (temperature, penalties, logit bias
    applied); of a :class:`GenerationConfig` the sampler applies only top-k, top-p, min-p and
    greedy (``temperature < 1e-5``), and reads ``logprobs`` / ``top_logprobs``.

    Randomness: sample i draws from ``rngs[i]`` (a :class:`RandomGenerator`: its Philox stream
    at its offset, advanced after the call). A sample's result depends only on its own row,
    config and generator state: not on batch size, position or neighbours.

    With a ``trace_recorder`` (:class:`EventTraceRecorder`), every call records
    ``"start <method name>"`` and ``"finish <method name>"`` for each of its request ids.

    Every ``batch_*`` method also takes ``validate="structure"`` (default) or ``"full"``
    (also checks the probability values; :mod:`specsampler.validation`).

    Attributes:
        device: ``torch.device`` where the work runs and tensor outputs live (the CPU for the
            CPU sampler).
        on_device: False for the CPU sampler (inputs are moved to the CPU), True for the GPU
            sampler (inputs must already be on ``device``).
        max_num_sample, vocab_size: the GPU sampler's capacity (None for the CPU sampler).
        trace_recorder: the :class:`EventTraceRecorder` or None.
    """

    def __init__(self, device: torch.device, on_device: bool, max_num_sample: int | None, vocab_size: int | None,
                 trace_recorder: EventTraceRecorder | None):
        """Use :meth:`create_cpu_sampler` or :meth:`create_gpu_sampler`."""
        if trace_recorder is not None and not isinstance(trace_recorder, EventTraceRecorder):
            fail("Sampler", "trace_recorder", "None or an EventTraceRecorder", type(trace_recorder).__name__)
        self.device = device
        self.on_device = on_device
        self.max_num_sample = max_num_sample
        self.vocab_size = vocab_size
        self.trace_recorder = trace_recorder

    def __repr__(self) -> str:
        if not self.on_device:
            return "Sampler(cpu)"
        return f"Sampler({self.device}, max_num_sample={self.max_num_sample}, vocab_size={self.vocab_size})"

    # ------------------------------------------------------------------------- factories

    @staticmethod
    def create_cpu_sampler(trace_recorder: EventTraceRecorder | None = None) -> Sampler:
        """A sampler that moves its inputs to the CPU (any device in) and returns CPU tensors."""
        return Sampler(torch.device("cpu"), False, None, None, trace_recorder)

    @staticmethod
    def create_gpu_sampler(max_num_sample: int, vocab_size: int, device: str | torch.device,
                           trace_recorder: EventTraceRecorder | None = None) -> Sampler:
        """A sampler whose inputs, work and tensor outputs stay on ``device``.

        Args:
            max_num_sample: ``>= 1``: the most samples of a call (``len(sample_indices)``), or
                draft-tree nodes of a verification call (``cum_verify_lengths[-1]``).
            vocab_size: ``>= 1``: the most columns ``V`` of the probabilities.
            device: a ``torch.device`` or a device string. Any device is accepted, so the GPU
                path can be tested on the CPU (``"cpu"``); an engine creates it where
                :meth:`supports_gpu_sampler` says so.
            trace_recorder: ``None`` or an :class:`EventTraceRecorder`.
        Calls with more samples or columns raise ``ValueError`` (:class:`~specsampler.ValidationError`).
        """
        op = "Sampler.create_gpu_sampler"
        for name, v in (("max_num_sample", max_num_sample), ("vocab_size", vocab_size)):
            if not _is_int(v) or v < 1:
                fail(op, name, "an int >= 1", repr(v))
        if not isinstance(device, (str, torch.device)):
            fail(op, "device", "a torch.device or a device string", type(device).__name__)
        try:
            device = torch.empty(0, device=device).device  # with its index ("cuda" -> "cuda:0")
        except (RuntimeError, AssertionError, NotImplementedError) as err:  # what torch raises for each case
            fail(op, "device", "a device torch can allocate on", f"{device!r} ({err})")
        return Sampler(device, True, int(max_num_sample), int(vocab_size), trace_recorder)

    @staticmethod
    def supports_gpu_sampler(device: str | torch.device) -> bool:
        """Whether the engine should use the GPU sampler on ``device``: True for CUDA devices
        (ROCm builds of torch name theirs ``"cuda"`` too; ``"hip"`` is accepted as well), False
        for the CPU, MPS, meta and the rest (MLC's Vulkan and Metal sampler kernels have no
        counterpart here)."""
        if isinstance(device, torch.device):
            kind = device.type
        elif isinstance(device, str):
            kind = device.split(":")[0].strip().lower()
        else:
            fail("Sampler.supports_gpu_sampler", "device", "a torch.device or a device string", type(device).__name__)
        return kind in ("cuda", "hip")

    # ------------------------------------------------------------------------- checks

    def _probs(self, op: str, name: str, probs: object) -> Tensor:
        """A float ``[rows, V]`` tensor on the sampler's device (the CPU sampler moves it there)."""
        check_tensor(op, name, probs, kind="float", ndim=2)
        if probs.shape[1] == 0:
            fail(op, name, "shape [rows, V] with V >= 1", shape_str(probs.shape))
        if not self.on_device:
            return probs.cpu()
        if probs.device != self.device:
            fail(op, name, f"a tensor on the sampler's device {self.device}", f"one on {probs.device}")
        if probs.shape[1] > self.vocab_size:
            fail(op, name, f"at most vocab_size = {self.vocab_size} columns", shape_str(probs.shape))
        return probs

    def _check_capacity(self, op: str, name: str, count: int, what: str) -> None:
        if self.max_num_sample is not None and count > self.max_num_sample:
            fail(op, name, f"at most max_num_sample = {self.max_num_sample} {what}", f"{count} {what}")

    def _samples(self, op: str, probs: Tensor, sample_indices, request_ids,
                 generation_cfg) -> tuple[Tensor, list[str], list[GenerationConfig]]:
        """Validated sample indices (CPU int64 ``[n]``), request ids and configs, one per sample."""
        idx = _host_ints(op, "sample_indices", sample_indices)
        n, rows = idx.numel(), probs.shape[0]
        bad = ((idx < 0) | (idx >= rows)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            fail(op, f"sample_indices[{i}]", f"a row index of probs in [0, {rows})", int(idx[i]), request=i)
        self._check_capacity(op, "sample_indices", n, "samples")
        request_ids = _checked_list(op, "request_ids", request_ids, n, "one per sample", str)
        cfgs = _checked_list(op, "generation_cfg", generation_cfg, n, "one per sample", GenerationConfig)
        return idx, request_ids, cfgs

    @contextmanager
    def _traced(self, method: str, request_ids: list[str]) -> Iterator[None]:
        """Record ``start <method>`` / ``finish <method>`` for every request around the block."""
        recorder = self.trace_recorder
        if recorder is not None:
            recorder.add_event_batch(request_ids, f"start {method}")
        try:
            yield
        finally:
            if recorder is not None:
                recorder.add_event_batch(request_ids, f"finish {method}")

    # ------------------------------------------------------------------------- sampling

    def batch_renormalize_probs_by_top_p(self, probs: Tensor, sample_indices: Sequence[int],
                                         request_ids: Sequence[str], generation_cfg: Sequence[GenerationConfig],
                                         *, validate: str = "structure") -> Tensor:
        """The filtered distributions: row i is row ``sample_indices[i]`` of ``probs`` under ``generation_cfg[i]``.

        Each config's top-k, top-p and min-p are applied in DESIGN.md's order (top-p on the
        top-k-renormalised distribution, then min-p) and the row renormalised; greedy configs
        (``temperature < 1e-5``) give a one-hot row at the argmax (ties to the lower id).
        MLC's engine calls this with ``sample_indices = [0, 1, ..., n-1]``; in general output
        row i corresponds to input row ``sample_indices[i]`` (rows may repeat or be left out).

        Args:
            probs: float ``[R, V]``, the distributions (after the logit processor).
            sample_indices: n ints in ``[0, R)`` (a sequence or a 1-D integer tensor).
            request_ids: n strs, the request of each sample (for the trace).
            generation_cfg: n :class:`GenerationConfig`.
        Returns:
            float32 ``[n, V]``, a new tensor on the sampler's device (the CPU for the CPU sampler).
        """
        name = "batch_renormalize_probs_by_top_p"
        op = f"Sampler.{name}"
        check_mode(op, validate)
        probs = self._probs(op, "probs", probs)
        idx, request_ids, cfgs = self._samples(op, probs, sample_indices, request_ids, generation_cfg)
        with self._traced(name, request_ids):
            return _filter(probs[idx.to(probs.device)].float(), cfgs, validate)

    def batch_sample_tokens_with_prob_before_top_p(
        self, probs: Tensor, sample_indices: Sequence[int], request_ids: Sequence[str],
        generation_cfg: Sequence[GenerationConfig], rngs: Sequence[RandomGenerator], *, validate: str = "structure",
    ) -> list[SampleResult]:
        """Sample i: filter row ``sample_indices[i]`` by ``generation_cfg[i]`` and draw from it with ``rngs[i]``.

        The filters are those of :meth:`batch_renormalize_probs_by_top_p` (top-k, top-p,
        min-p; greedy for ``temperature < 1e-5``), applied here before sampling.

        Args:
            probs: float ``[R, V]``, unfiltered distributions (after the logit processor).
            sample_indices: n ints in ``[0, R)``; rows may repeat (e.g. parallel samples).
            request_ids: n strs. generation_cfg: n :class:`GenerationConfig`.
            rngs: n :class:`RandomGenerator`; each is advanced by 1 per use.
        Returns:
            n :class:`SampleResult`: ``sampled_token_id = (token, p)`` with ``p`` the token's
            probability in the input row (before filtering); ``top_prob_tokens``: the
            ``top_logprobs`` most likely tokens of the input row when ``logprobs`` is on.
        """
        return self._sample("batch_sample_tokens_with_prob_before_top_p", probs, sample_indices, request_ids,
                            generation_cfg, rngs, False, validate)

    def batch_sample_tokens_with_prob_after_top_p(
        self, probs: Tensor, sample_indices: Sequence[int], request_ids: Sequence[str],
        generation_cfg: Sequence[GenerationConfig], rngs: Sequence[RandomGenerator], *, validate: str = "structure",
    ) -> list[SampleResult]:
        """Sample i: draw from row ``sample_indices[i]`` as it is (already filtered) with ``rngs[i]``.

        ``probs`` are distributions already filtered, typically by
        :meth:`batch_renormalize_probs_by_top_p` (which makes greedy rows one-hot); no filter
        is applied here. Rows need not be normalised.

        Args, returns: as :meth:`batch_sample_tokens_with_prob_before_top_p`; the probability
        in ``sampled_token_id`` and ``top_prob_tokens`` are those of the given (filtered) row.
        """
        return self._sample("batch_sample_tokens_with_prob_after_top_p", probs, sample_indices, request_ids,
                            generation_cfg, rngs, True, validate)

    def _sample(self, name: str, probs, sample_indices, request_ids, generation_cfg, rngs, filtered: bool,
                validate: str) -> list[SampleResult]:
        op = f"Sampler.{name}"
        check_mode(op, validate)
        probs = self._probs(op, "probs", probs)
        idx, request_ids, cfgs = self._samples(op, probs, sample_indices, request_ids, generation_cfg)
        rngs = _checked_list(op, "rngs", rngs, idx.numel(), "one per sample", RandomGenerator)
        counts = [_num_top(c) for c in cfgs]
        with self._traced(name, request_ids):
            idx = idx.to(probs.device)
            rows = probs[idx].float()
            dist = rows if filtered else _filter(rows, cfgs, validate)
            tokens = sample(dist, _philox(rngs, probs.device), validate=validate)[:, None]
            top_ids, top_probs = _top_tokens(probs, idx, max(counts, default=0))
            tok, prob, ids, tps = _to_host(tokens, rows.gather(1, tokens), top_ids, top_probs)
            tok, prob, ids, tps = tok[:, 0].long().tolist(), prob[:, 0].tolist(), ids.long().tolist(), tps.tolist()
            return [SampleResult((tok[i], prob[i]), _top_list(ids[i], tps[i], c)) for i, c in enumerate(counts)]

    # ------------------------------------------------------------------------- verification

    def batch_verify_draft_tokens_with_prob_after_top_p(
        self, probs: Tensor, request_ids: Sequence[str], cum_verify_lengths: Sequence[int],
        generation_cfg: Sequence[GenerationConfig], rngs: Sequence[RandomGenerator],
        draft_output_tokens: Sequence[Sequence[SampleResult]], token_tree_parent_ptr: Sequence[int],
        draft_probs: Tensor | None, *, method: str = "rrs", draft_sampling: str = "iid", validate: str = "structure",
    ) -> tuple[list[list[SampleResult]], list[int]]:
        """Verify one draft tree (or chain) per request against the target's filtered probabilities.

        Request i has ``n_i = cum_verify_lengths[i+1] - cum_verify_lengths[i]`` nodes, node 0
        its root (the last committed token); its node j is global row
        ``g = cum_verify_lengths[i] + j`` of every per-node input. Trees of any shapes and sizes,
        chains included, mix in one call. All requests are verified by ONE
        :func:`specsampler.verify_tree` call on trees padded to the largest ``n_i``.

        Args:
            probs: float ``[num_nodes, V]``, ``num_nodes = cum_verify_lengths[-1]``: row g = the
                target distribution after node j (for its children, or the correction/bonus
                token), already filtered (top-p etc.; greedy requests' rows one-hot, as
                :meth:`batch_renormalize_probs_by_top_p` makes them). Used as it is.
            request_ids: B strs.
            cum_verify_lengths: B + 1 ints, ``0 = c_0 < c_1 < ... < c_B = num_nodes``.
            generation_cfg: B :class:`GenerationConfig` (``logprobs`` / ``top_logprobs``).
            rngs: B :class:`RandomGenerator`, each advanced by 1.
            draft_output_tokens: B lists; ``draft_output_tokens[i][j]`` is the
                :class:`SampleResult` of node j+1 (its token id is read; ``n_i - 1`` entries).
            token_tree_parent_ptr: num_nodes ints (a sequence or 1-D integer tensor); entry g =
                node j's request-local parent: -1 for the root (j = 0), else in ``[0, j)``.
                Siblings are tried in increasing node index.
            draft_probs: float ``[num_nodes, V]``: row g = the distribution node j's token was
                drawn from (roots' rows unused); required by ``rrs`` and ``traversal``, ignored
                (may be None) by ``target_only`` and ``greedy``.
            method: ``"rrs"`` (default; SpecInfer's recursive rejection sampling), ``"traversal"``,
                ``"target_only"`` or ``"greedy"`` (see :func:`specsampler.verify_tree`).
            draft_sampling: ``"iid"`` (default) or ``"without_replacement"``: how sibling drafts
                were drawn from draft_probs (rrs, traversal).

        Losslessness: the default (``rrs``, ``iid``) emits tokens distributed exactly as the target
        when every node's token was drawn independently from its draft_probs row. For siblings
        drawn without replacement pass ``draft_sampling="without_replacement"``. A caller whose
        children are chosen deterministically (top-k, beam search, n-gram) gets the only
        lossless rule for them, target-only verification (draw from the target, descend to the
        child carrying the draw), with ``method="target_only"`` (draft_probs may then be None):
        MLC's i.i.d. rule on such children is off the target distribution.

        Returns:
            ``(sample_results, last_accepted_tree_node)``: per request, the :class:`SampleResult`
            of each accepted draft followed by exactly one correction or bonus token; and the
            request-local index of the last accepted node (0 when none). Probabilities: an
            accepted draft token's is its target probability at its parent's row; the final
            token's is its target probability at the last accepted node's row (the row it is
            drawn from in the all-accepted case, NOT the residual a rejection samples from:
            the residual depends on the random path, the target row is the model's view).
            ``top_prob_tokens``: the ``top_logprobs`` most likely tokens of that same target row
            when ``logprobs`` is on.
        """
        name = "batch_verify_draft_tokens_with_prob_after_top_p"
        op = f"Sampler.{name}"
        check_mode(op, validate)
        probs = self._probs(op, "probs", probs)
        num_nodes, V = probs.shape
        request_ids = _checked_list(op, "request_ids", request_ids, None, "", str)
        B = len(request_ids)
        cum = _host_ints(op, "cum_verify_lengths", cum_verify_lengths)
        lengths = _check_cum(op, cum, B, num_nodes)
        self._check_capacity(op, "cum_verify_lengths", num_nodes, "nodes")
        cfgs = _checked_list(op, "generation_cfg", generation_cfg, B, "one per request", GenerationConfig)
        rngs = _checked_list(op, "rngs", rngs, B, "one per request", RandomGenerator)
        drafts = _draft_tokens(op, draft_output_tokens, lengths, V)
        parents = _parent_ptr(op, token_tree_parent_ptr, cum, lengths)
        if method not in METHODS:
            fail(op, "method", f"one of {METHODS}", repr(method))
        if draft_sampling not in DRAFT_SAMPLING:
            fail(op, "draft_sampling", f"one of {DRAFT_SAMPLING}", repr(draft_sampling))
        sampled = method in ("rrs", "traversal")
        if draft_probs is not None:
            draft_probs = self._probs(op, "draft_probs", draft_probs)
            check_shape(op, "draft_probs", draft_probs, (num_nodes, V), "[num_nodes, V] (as probs)")
        elif sampled:
            fail(op, "draft_probs", f"a tensor [num_nodes, V] for method {method!r}", "None")
        if B == 0:
            return [], []
        counts = [_num_top(c) for c in cfgs]
        with self._traced(name, request_ids):
            dev, N = probs.device, int(lengths.max())
            j = torch.arange(N)
            present = j < lengths[:, None]  # [B, N]
            rows = cum[:-1, None] + torch.where(present, j, 0)  # global row of each node (absent: the root's)
            tree_parents = torch.full((B, N), -1, dtype=torch.int64)
            tree_parents[present] = parents
            tokens = torch.zeros(B, N, dtype=torch.int64)
            tokens[present & (j > 0)] = drafts
            tree = TokenTree.from_parents(tree_parents)
            if tree.device != dev:
                tree = tree.to(dev)
            rows, tokens = rows.to(dev), tokens.to(dev)
            uniform_sizes = bool((lengths == N).all())  # then the rows are already [B, N, V]: no copy

            def per_node(t: Tensor) -> Tensor:
                return t.reshape(B, N, V) if uniform_sizes else t[rows]

            res = verify_tree(per_node(probs), tokens, tree, per_node(draft_probs) if sampled else None,
                              method=method, draft_sampling=draft_sampling, rng=_philox(rngs, dev), validate=validate)
            drawn_at = rows.gather(1, res.path.clamp(min=0))  # [B, D+1]: global row each emitted token is drawn at
            emitted = res.tokens.clamp(min=0)
            top_ids, top_probs = _top_tokens(probs, drawn_at.view(-1), max(counts))
            K = top_ids.shape[1]
            tok, prob, n, last, ids, tps = _to_host(res.tokens, probs[drawn_at, emitted].float(),
                                                    res.num_accepted[:, None], res.last_node[:, None],
                                                    top_ids.view(B, -1), top_probs.view(B, -1))
            D1 = tok.shape[1]
            tok, prob, n, last = tok.long().tolist(), prob.tolist(), n[:, 0].long().tolist(), last[:, 0].long().tolist()
            ids, tps = ids.long().view(B, D1, K).tolist(), tps.view(B, D1, K).tolist()
            results = [[SampleResult((tok[b][k], prob[b][k]), _top_list(ids[b][k], tps[b][k], counts[b]))
                        for k in range(n[b] + 1)] for b in range(B)]
            return results, last


def _check_cum(op: str, cum: Tensor, B: int, num_nodes: int) -> Tensor:
    """Check ``cum_verify_lengths`` (CPU int64 ``[B+1]``) and return the node counts ``[B]``."""
    if cum.numel() != B + 1:
        fail(op, "cum_verify_lengths", f"B + 1 = {B + 1} entries (B = len(request_ids))", f"{cum.numel()} entries")
    if int(cum[0]) != 0:
        fail(op, "cum_verify_lengths[0]", "0", int(cum[0]))
    lengths = cum[1:] - cum[:-1]
    bad = (lengths < 1).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        fail(op, f"cum_verify_lengths[{i + 1}]",
             f"> cum_verify_lengths[{i}] = {int(cum[i])} (every request has its root node)", int(cum[i + 1]),
             request=i)
    if int(cum[-1]) != num_nodes:
        fail(op, f"cum_verify_lengths[{B}]", f"the number of rows of probs, {num_nodes}", int(cum[-1]))
    return lengths


def _draft_tokens(op: str, draft_output_tokens, lengths: Tensor, V: int) -> Tensor:
    """The draft token ids of all non-root nodes, request by request: CPU int64 ``[num_nodes - B]``."""
    B = lengths.numel()
    if isinstance(draft_output_tokens, (str, bytes, Tensor)) or not isinstance(draft_output_tokens, Iterable):
        fail(op, "draft_output_tokens", "a sequence of lists of SampleResult", type(draft_output_tokens).__name__)
    outer = list(draft_output_tokens)
    if len(outer) != B:
        fail(op, "draft_output_tokens", f"{B} lists (one per request)", f"{len(outer)} entries")
    flat = []
    for i, (drafts, n) in enumerate(zip(outer, lengths.tolist())):
        name = f"draft_output_tokens[{i}]"
        if isinstance(drafts, (str, bytes)) or not isinstance(drafts, Iterable):
            fail(op, name, "a sequence of SampleResult", type(drafts).__name__, request=i)
        drafts = list(drafts)
        if len(drafts) != n - 1:
            fail(op, name, f"{n - 1} draft tokens (cum_verify_lengths gives {n} nodes, the root included)",
                 f"{len(drafts)}", request=i)
        for k, d in enumerate(drafts):
            if not isinstance(d, SampleResult):
                fail(op, f"{name}[{k}]", "a SampleResult", type(d).__name__, request=i)
            t = d.sampled_token_id[0]
            if not _is_int(t) or not 0 <= t < V:
                fail(op, f"{name}[{k}].sampled_token_id[0]", f"a token id in [0, {V})", repr(t), request=i)
            flat.append(int(t))
    return torch.tensor(flat, dtype=torch.int64)


def _parent_ptr(op: str, token_tree_parent_ptr, cum: Tensor, lengths: Tensor) -> Tensor:
    """Check the request-local parent pointers; CPU int64 ``[num_nodes]``."""
    parents = _host_ints(op, "token_tree_parent_ptr", token_tree_parent_ptr)
    num_nodes = int(cum[-1])
    if parents.numel() != num_nodes:
        fail(op, "token_tree_parent_ptr", f"{num_nodes} entries (one per node, cum_verify_lengths[-1])",
             f"{parents.numel()} entries")
    request = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    node = torch.arange(num_nodes) - cum[:-1][request]
    bad = torch.where(node == 0, parents != -1, (parents < 0) | (parents >= node)).nonzero()
    if bad.numel():
        g = int(bad[0, 0])
        b, j = int(request[g]), int(node[g])
        expected = "-1 (node 0 is the request's root)" if j == 0 else f"a request-local parent index in [0, {j})"
        fail(op, f"token_tree_parent_ptr[{g}] (node {j})", expected, int(parents[g]), request=b)
    return parents
