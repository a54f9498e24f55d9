"""End-to-end speculative generation with Hugging Face causal LMs: :func:`speculative_generate` (a drafter
proposes a chain or tree, the target scores it in one forward pass, the verifier accepts a path and one more
token, the KV caches keep the accepted path) and :func:`generate` (plain sampling, the baseline).

Output tokens are distributed exactly as the target would sample them. The step, the lean path past the
public ops' checks, the models supported and how batches keep requests apart: docs/design.md, "Speculative
generation: ``specsampler.generate``".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from ..kernels import use_triton
from ..params import SamplingParams
from ..rng import STREAM_SAMPLE, Philox
from ..sampling.ops import sample_from_logits
from ..validation import as_integer, check_integer, check_no_bad, check_tensor, fail
from ..verify.chain import _STREAMS as _CHAIN_STREAMS
from ..verify.chain import _verify_chain_prepared
from ..verify.tree import _STREAMS as _TREE_STREAMS
from ..verify.tree import _verify_tree_prepared
from .cache import ModelCache, attention_windows, unsupported
from .drafters import ModelDrafter, NgramDrafter, RowsOf, draft_plan
from .draws import Call, Streams
from .layout import tree_layout

DRAFTERS = ("chain", "tree", "ngram")
DRAFT_SAMPLINGS = ("iid", "without_replacement", "deterministic")
CHAIN_METHODS = ("token", "block", "target_only", "greedy")
TREE_METHODS = ("rrs", "traversal", "target_only", "greedy")
NGRAM_METHODS = ("target_only", "greedy")
OP = "speculative_generate"


@dataclass
class GenerationStats:
    """What a generation cost.

    - ``target_calls`` / ``draft_calls``: forward passes of each model (prefills included).
    - ``accepted_per_step``: per verification step, the accepted drafts of each request still
      generating, among the tokens it took (drafts past ``max_new_tokens`` or an EOS do not count; ``[]`` for
      plain sampling).
    - ``draft_depth``: the most drafts one step can accept (chain length, tree depth).
    - ``new_tokens``: tokens generated per request; ``request_target_calls``: target calls per
      request while it was generating.
    - ``wall_time_s``: the call's wall time.
    """

    target_calls: int = 0
    draft_calls: int = 0
    accepted_per_step: list[list[int]] = field(default_factory=list)
    draft_depth: int = 0
    new_tokens: list[int] = field(default_factory=list)
    request_target_calls: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Generated tokens per target forward pass, over all requests (plain sampling: 1)."""
        return sum(self.new_tokens) / max(1, sum(self.request_target_calls))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over the most a step could accept (``draft_depth`` per request-step)."""
        steps = sum(len(a) for a in self.accepted_per_step)
        return sum(map(sum, self.accepted_per_step)) / max(1, steps * self.draft_depth)


@dataclass
class GenerationOutput:
    """``tokens``: int64 ``[B, T]`` generated ids, ``-1`` after a request's end (an EOS token is
    kept as its last token); ``[T]`` for a 1-D prompt. ``lengths``: int64 ``[B]``."""

    tokens: Tensor
    lengths: Tensor
    stats: GenerationStats


# ------------------------------------------------------------------------------ arguments


def _check_prompt(op: str, input_ids, attention_mask, model) -> tuple[Tensor, Tensor]:
    """The prompts as int64 ``[B, L]`` and which entries are real tokens (bool ``[B, L]``): real tokens are ids of
    ``model``'s vocabulary (where its input embeddings tell its size); padding is read as token 0 whatever its ids
    (the model attends to it nowhere). One read of the ids on the host."""
    check_tensor(op, "input_ids", input_ids, kind="int", ndim=(1, 2))
    if input_ids.shape[-1] == 0:
        fail(op, "input_ids", "at least one prompt token", f"shape {list(input_ids.shape)}")
    ids = input_ids.reshape(-1, input_ids.shape[-1]).long()
    if attention_mask is None:
        real = torch.ones_like(ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            fail(op, "attention_mask", f"a tensor of the shape of input_ids {list(input_ids.shape)}",
                 getattr(attention_mask, "shape", type(attention_mask).__name__))
        real = attention_mask.reshape(ids.shape).to(ids.device).bool()
        last_pad = ~real[:, -1]
        if bool(last_pad.any()):
            fail(op, "attention_mask", "left padding (the last token of every prompt real)", "a padded last token",
                 int(last_pad.nonzero()[0, 0]))
        ids = torch.where(real, ids, 0)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    V = getattr(embeddings, "num_embeddings", None)
    if V is not None:
        check_no_bad(op, "input_ids", (ids < 0) | (ids >= V), ids,
                     f"token ids in [0, {V}) (the model's vocabulary) where attention_mask is 1")
    return ids, real


def _check_model(op: str, name: str, model) -> None:
    """A ValueError naming ``model`` where the loop cannot give its own logits (:func:`~.cache.unsupported`)."""
    why = unsupported(model)
    if why is not None:
        fail(op, name, "a causal LM of attention layers that places tokens by their position ids",
             f"{type(model).__name__}, with {why}")


def _vocabulary(model) -> tuple[int | None, int | None]:
    """``model``'s vocabulary sizes: its input embeddings' rows and its head's outputs (None where it does not say;
    a quantised head's weight may be packed: its ``out_features`` only)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(embed, "num_embeddings", None), getattr(head, "out_features", None)


def _check_vocabularies(op: str, target, draft) -> None:
    """The draft scores the target's vocabulary and each model embeds every token the other emits (else a token
    of one would reach the other's embedding out of range), where the models say their sizes (else the first
    step's logits are compared)."""
    (t_in, t_out), (d_in, d_out) = _vocabulary(target), _vocabulary(draft)
    if None not in (t_out, d_out) and d_out != t_out:
        fail(op, "draft", f"a vocabulary of the target's size {t_out}", d_out)
    if None not in (t_out, d_in) and d_in < t_out:
        fail(op, "draft", f"input embeddings for the target's {t_out} tokens", d_in)
    if None not in (d_out, t_in) and t_in < d_out:
        fail(op, "target", f"input embeddings for the draft's {d_out} tokens", t_in)


def _check_window(op: str, name: str, model, real: Tensor, max_new: int) -> None:
    """``model`` attends to every position whose logits count: positions 0 to the longest prompt + ``max_new`` - 2
    fit in the window of its layers that the loop's mask cannot apply (sliding beside full layers, chunked ones:
    the logits would silently differ from the model's own; a window every layer slides is applied,
    :class:`ModelCache`). Tokens past them are fed at the last (:class:`ModelCache`)."""
    window = attention_windows(model)[1]
    if window is None or not max_new:
        return
    reach = int(real.sum(1).max()) + max_new - 1
    if reach > window:
        fail(op, name, f"attention over the {reach} positions whose logits count (longest prompt + max_new_tokens "
             "- 1; sliding-window layers beside full ones, and chunked layers, are not supported past their window)",
             f"a model whose layers attend to the last {window} positions")


def _check_rng(op: str, rng) -> None:
    if rng is not None and not isinstance(rng, (torch.Generator, Philox)):
        fail(op, "rng", "None, a torch.Generator or a specsampler.Philox", type(rng).__name__)


def _check_on_step(op: str, on_step) -> None:
    if on_step is not None and not callable(on_step):
        fail(op, "on_step", "None or a callable taking a GenerationOutput", type(on_step).__name__)


def _check_params(op: str, name: str, params, batch: int, device: torch.device) -> SamplingParams:
    """``params`` (default: temperature 1), its tensors' shapes checked for ``batch`` requests."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        fail(op, name, "a SamplingParams or None", type(params).__name__)
    params.rows(op, batch, 1, device, False, label=f"{name}.")  # errors name the argument: params.top_k, ...
    return params


def _eos_ids(op: str, eos_token_id) -> list[int]:
    """The end ids: None, one integer (an int, a NumPy integer, a 0-d integer tensor) or a sequence of them."""
    if eos_token_id is None:
        return []
    one = as_integer(eos_token_id)
    if one is not None:
        ids = [one]
    elif isinstance(eos_token_id, (str, bytes, Mapping)) or (isinstance(eos_token_id, Tensor)
                                                             and eos_token_id.dim() != 1):
        ids = [None]
    else:
        try:
            ids = [as_integer(i) for i in eos_token_id]
        except TypeError:  # not iterable: a float, an object
            ids = [None]
    if not all(i is not None and i >= 0 for i in ids):
        fail(op, "eos_token_id", "None, an integer >= 0 or a list of them", repr(eos_token_id))
    return ids


class _Output:
    """Per-request generated tokens, with the max_new_tokens and EOS ends applied."""

    def __init__(self, B: int, max_new: int, eos: list[int]):
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.done = [max_new == 0] * B
        self.max_new, self.eos = max_new, set(eos)

    def add(self, rows: list[list[int]], counts: list[int]) -> list[int]:
        """Append ``rows[b][:counts[b]]`` to each request still generating, up to its end; returns how many tokens
        each request took."""
        took = [0] * len(rows)
        for b, (row, n) in enumerate(zip(rows, counts)):
            if self.done[b]:
                continue
            for t in row[:n]:
                self.tokens[b].append(t)
                took[b] += 1
                if t in self.eos or len(self.tokens[b]) >= self.max_new:
                    self.done[b] = True
                    break
        return took

    def result(self, stats: GenerationStats, one_d: bool, device, started: float) -> GenerationOutput:
        """The output so far, with a copy of ``stats`` as of now (the loop goes on adding to its own)."""
        T = max((len(t) for t in self.tokens), default=0)
        stats = replace(stats, accepted_per_step=[list(a) for a in stats.accepted_per_step],
                        request_target_calls=list(stats.request_target_calls),
                        new_tokens=[len(t) for t in self.tokens], wall_time_s=time.perf_counter() - started)
        with torch.inference_mode(False):  # the loop runs in inference mode; its outputs are ordinary tensors
            out = torch.full((len(self.tokens), T), -1, dtype=torch.long)
            for b, t in enumerate(self.tokens):
                out[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            out = out.to(device)
            lengths = torch.tensor(stats.new_tokens, dtype=torch.long, device=device)
        return GenerationOutput(out[0] if one_d else out, lengths, stats)


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _sample(logits: Tensor, params: SamplingParams, rows: RowsOf, call: Call) -> Tensor:
    """One token per request from logits ``[B, V]``: the draw of :func:`sample_from_logits` on
    ``call``'s random stream. int64 ``[B]``."""
    if use_triton(logits.device):
        return sample_from_logits(logits, params, call.rng).tokens
    return rows.process(logits[:, None]).sample(call.uniform(STREAM_SAMPLE, 1).reshape(-1))


# ------------------------------------------------------------------------------ plain sampling


@torch.inference_mode()
def generate(
    model,
    input_ids: Tensor,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    *,
    rng: torch.Generator | Philox | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: Tensor | None = None,
    on_step: Callable[[GenerationOutput], None] | None = None,
) -> GenerationOutput:
    """Plain autoregressive sampling with :func:`sample_from_logits`: one model call per token.

    The baseline of :func:`speculative_generate`, with the same arguments, caching and random
    streams (a :class:`Philox` advances one offset per token).

    Args:
        model: a transformers causal LM (the call it must take: docs/design.md, "Speculative generation").
        input_ids: integer ``[B, L]`` (left-padded with ``attention_mask``) or ``[L]``.
        max_new_tokens: an integer >= 0 (an int, a NumPy integer or a 0-d integer tensor).
        params: :class:`SamplingParams` (scalars or ``[B]``); default temperature 1.
        rng: ``None``, a ``torch.Generator`` or :class:`Philox` (per-request seeds ``[B]``).
        eos_token_id: None, an id or a list of ids (integers) that end a request (kept as its last token).
        attention_mask: ``[B, L]``, 1 for real tokens (ids of the model's vocabulary), 0 for left padding
            (any ids: read as 0).
        on_step: None or a callable, called after every model call with the :class:`GenerationOutput` so far
            (its tokens shaped and placed as the returned output's: ``[T]`` for a 1-D prompt).
    Returns:
        :class:`GenerationOutput`.
    """
    op = "generate"
    started = time.perf_counter()
    _check_rng(op, rng)
    _check_on_step(op, on_step)
    ids, real = _check_prompt(op, input_ids, attention_mask, model)
    max_new_tokens = check_integer(op, "max_new_tokens", max_new_tokens, 0)
    one_d, out_device = input_ids.dim() == 1, input_ids.device
    dev = _model_device(model)
    ids, real = ids.to(dev), real.to(dev)
    B = ids.shape[0]
    params = _check_params(op, "params", params, B, dev)
    _check_model(op, "model", model)
    _check_window(op, "model", model, real, max_new_tokens)
    out = _Output(B, max_new_tokens, _eos_ids(op, eos_token_id))
    stats = GenerationStats(request_target_calls=[0] * B)
    streams = Streams(rng, B, dev, op, horizon=max_new_tokens)
    rows = RowsOf(params, B, dev, op)
    plan = (((STREAM_SAMPLE, 1),),)
    state = ModelCache(model, B, dev, op=op, name="model", fewest=real.shape[1] + max_new_tokens - 1)
    pos = real.long().sum(1)[:, None]
    own = torch.zeros(1, 1, dtype=state.dtype, device=dev)  # a new token sees itself
    committed = torch.ones(B, 1, dtype=torch.bool, device=dev)
    logits = state.prefill(ids, real) if max_new_tokens else None
    while not all(out.done):
        x = _sample(logits, params, rows, streams.step(plan)[0])
        stats.request_target_calls = [n + (not d) for n, d in zip(stats.request_target_calls, out.done)]
        out.add([[t] for t in x.tolist()], [1] * B)
        stats.target_calls = state.calls
        if on_step is not None:
            on_step(out.result(stats, one_d, out_device, started))  # shaped and placed as the returned output
        if all(out.done):
            break
        logits = state.forward(x[:, None], pos, own, committed=committed)[:, 0]
        pos = pos + 1
    return out.result(stats, one_d, out_device, started)


# ------------------------------------------------------------------------------ speculative generation


def _resolve(op: str, drafter: str, method: str, how: str | None) -> tuple[str, str]:
    """The verification method and the draft sampling for a drafter."""
    if drafter not in DRAFTERS:
        fail(op, "drafter", f"one of {DRAFTERS}", repr(drafter))
    if drafter == "ngram":
        if how not in (None, "deterministic"):
            fail(op, "draft_sampling", "None or 'deterministic' for drafter 'ngram' (its drafts are looked up)",
                 repr(how))
        if method not in (*NGRAM_METHODS, "auto"):
            fail(op, "method", f"one of {('auto', *NGRAM_METHODS)} for drafter 'ngram'", repr(method))
        return ("target_only" if method == "auto" else method), "deterministic"
    how = "iid" if how is None else how
    if how not in DRAFT_SAMPLINGS:
        fail(op, "draft_sampling", f"one of {DRAFT_SAMPLINGS}", repr(how))
    methods, sampled = (CHAIN_METHODS, "token") if drafter == "chain" else (TREE_METHODS, "rrs")
    if method not in (*methods, "auto"):
        fail(op, "method", f"one of {('auto', *methods)} for drafter {drafter!r}", repr(method))
    if method == "auto":
        return ("target_only" if how == "deterministic" else sampled), how
    if how == "deterministic" and method not in ("target_only", "greedy"):
        fail(op, "method", "'target_only' or 'greedy' for deterministic drafts (the others need sampled drafts)",
             repr(method))
    if how != "deterministic" and method == "target_only":
        fail(op, "draft_sampling", "'deterministic' for method 'target_only' (it assumes drafts chosen without "
             "randomness)", repr(how))
    return method, how


def _branching(op: str, drafter: str, num_draft_tokens: int, tree_shape) -> tuple[int, ...]:
    """The branching factors per depth: ``(1,) * num_draft_tokens`` for a chain, ``tree_shape`` (or the default
    shape of depth ``num_draft_tokens``) for a tree. Any integers (NumPy's too), as Python ints."""
    if drafter != "tree":
        if tree_shape is not None:
            fail(op, "tree_shape", f"None for drafter {drafter!r} (num_draft_tokens sets the chain)",
                 repr(tree_shape))
        return (1,) * check_integer(op, "num_draft_tokens", num_draft_tokens, 1)
    if tree_shape is None:
        k = check_integer(op, "num_draft_tokens", num_draft_tokens, 1)
        return (2, 2) + (1,) * (k - 2) if k >= 2 else (2,)
    listed = isinstance(tree_shape, Sequence) and not isinstance(tree_shape, (str, bytes)) or (
        isinstance(tree_shape, (np.ndarray, Tensor)) and tree_shape.ndim == 1)
    shape = tuple(as_integer(c) for c in tree_shape) if listed else ()
    if not shape or not all(c is not None and c >= 1 for c in shape):
        fail(op, "tree_shape", "a non-empty list of integer branching factors >= 1 per depth (e.g. [3, 2, 1])",
             repr(tree_shape))
    return shape


_STREAMS = {**_CHAIN_STREAMS, **_TREE_STREAMS}  # each verification method's streams (the two ops agree on the shared)


def _verify_plan(method: str, count: int) -> tuple[tuple[int, int], ...]:
    """The uniforms a verification draws, in its order: its op's streams (greedy: none), ``count`` each."""
    return tuple((stream, count) for stream in _STREAMS[method])


@torch.inference_mode()
def speculative_generate(
    target,
    draft,
    input_ids: Tensor,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    *,
    drafter: str = "chain",
    num_draft_tokens: int = 4,
    tree_shape: Sequence[int] | None = None,
    draft_sampling: str | None = None,
    method: str = "auto",
    rng: torch.Generator | Philox | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: Tensor | None = None,
    draft_params: SamplingParams | None = None,
    prompt_lookup_min: int = 1,
    prompt_lookup_max: int = 3,
    on_step: Callable[[GenerationOutput], None] | None = None,
) -> GenerationOutput:
    """Generate with a drafter proposing and the target verifying, losslessly.

    Args:
        target: a transformers causal LM (the call it must take: docs/design.md, "Speculative generation").
        draft: the draft model, over the target's vocabulary; None for ``drafter="ngram"``.
        input_ids: integer ``[B, L]`` (left-padded with ``attention_mask``) or ``[L]``.
        max_new_tokens: an integer >= 0 (an int, a NumPy integer or a 0-d integer tensor).
        params: the target's :class:`SamplingParams` (scalars or ``[B]``); the output follows
            them exactly. Default: temperature 1.
        drafter: ``"chain"`` (``num_draft_tokens`` drafts per step), ``"tree"`` (``tree_shape``
            children per node at each depth; default ``[2, 2, 1, ..]`` of depth
            ``num_draft_tokens``) or ``"ngram"`` (prompt lookup: up to ``num_draft_tokens``
            tokens that followed the latest earlier occurrence of the context's last n tokens,
            n from ``prompt_lookup_max`` down to ``prompt_lookup_min``; no draft model).
        tree_shape: branching factors per depth (integers >= 1), e.g. ``[3, 2, 1]`` (tree drafter only).
        draft_sampling: ``"iid"`` (siblings drawn independently from the draft; the default),
            ``"without_replacement"`` (distinct siblings; a node whose draft support is used up
            gets fewer children) or ``"deterministic"`` (the most likely tokens of the draft, at most
            V children per node: those a shape asks for past the vocabulary's V tokens are left out;
            the n-gram drafter's drafts are deterministic too).
        method: ``"auto"``, or a chain method (``token``, ``block``, ``target_only``, ``greedy``),
            tree method (``rrs``, ``traversal``, ``target_only``, ``greedy``) or n-gram method
            (``target_only``, ``greedy``). ``auto``: ``token`` / ``rrs`` for sampled drafts,
            ``target_only`` for deterministic ones.
        rng: ``None``, a ``torch.Generator`` or :class:`Philox` (per-request seeds ``[B]``; the
            first-token draw, each draft level's draws and each verification take the next
            offset, the same sequence for every request).
        eos_token_id: None, an id or a list of ids (integers) that end a request (kept as its last token).
        attention_mask: ``[B, L]``, 1 for real tokens (ids of the model's vocabulary), 0 for left padding
            (any ids: read as 0).
        draft_params: how the draft's logits become its distributions (default ``params``).
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes the n-gram drafter matches.
        on_step: None or a callable, called after every verification step with the :class:`GenerationOutput` so
            far (its tokens shaped and placed as the returned output's: ``[T]`` for a 1-D prompt).
    Returns:
        :class:`GenerationOutput`; ``stats`` counts both models' calls and the accepted drafts.
    """
    started = time.perf_counter()
    _check_rng(OP, rng)
    _check_on_step(OP, on_step)
    ids, real = _check_prompt(OP, input_ids, attention_mask, target)
    max_new_tokens = check_integer(OP, "max_new_tokens", max_new_tokens, 0)
    method, how = _resolve(OP, drafter, method, draft_sampling)
    branching = _branching(OP, drafter, num_draft_tokens, tree_shape)
    if (draft is None) != (drafter == "ngram"):
        fail(OP, "draft", "None for drafter 'ngram' and a draft model for the others", type(draft).__name__)
    dev = _model_device(target)
    ids, real = ids.to(dev), real.to(dev)
    B = ids.shape[0]
    params = _check_params(OP, "params", params, B, dev)
    draft_params = params if draft_params is None else _check_params(OP, "draft_params", draft_params, B, dev)
    eos = _eos_ids(OP, eos_token_id)
    _check_model(OP, "target", target)
    if draft is not None:
        _check_model(OP, "draft", draft)
        _check_vocabularies(OP, target, draft)
    # the target only: a draft's window changes its proposals, never the output's distribution
    _check_window(OP, "target", target, real, max_new_tokens)
    if drafter == "ngram":
        num_draft_tokens = check_integer(OP, "num_draft_tokens", num_draft_tokens, 1)
        prompt_lookup_min = check_integer(OP, "prompt_lookup_min", prompt_lookup_min, 1)
        prompt_lookup_max = check_integer(OP, "prompt_lookup_max", prompt_lookup_max, prompt_lookup_min)
    run = _Run(target, ids, real, max_new_tokens, params, method, rng, eos, on_step, started, input_ids)
    if drafter == "ngram":
        run.ngram(num_draft_tokens, prompt_lookup_min, prompt_lookup_max)
    else:
        run.model(draft, draft_params, branching, how, tree=drafter == "tree")
    return run.out.result(run.stats, run.one_d, run.out_device, started)


class _Run:
    """One speculative generation: the target's state, the output and the loop of each drafter."""

    def __init__(self, target, ids: Tensor, real: Tensor, max_new: int, params: SamplingParams, method: str, rng,
                 eos: list[int], on_step, started: float, input_ids: Tensor):
        self.B, self.dev = ids.shape[0], ids.device
        self.ids, self.real, self.params, self.method = ids, real, params, method
        self.on_step, self.started = on_step, started
        self.one_d, self.out_device = input_ids.dim() == 1, input_ids.device  # the output's shape and place
        self.out = _Output(self.B, max_new, eos)
        self.stats = GenerationStats(request_target_calls=[0] * self.B)
        self.streams = Streams(rng, self.B, self.dev, OP, horizon=max_new)
        self.rows = RowsOf(params, self.B, self.dev, OP)
        self.pos_root = real.long().sum(1)  # the root's position: tokens before it
        # the last position whose logits count: the one that draws the max_new-th token
        self.last = self.pos_root + max_new - 2
        self.target = ModelCache(target, self.B, self.dev, self.last, op=OP, name="target",
                                 fewest=real.shape[1] + max_new - 1)
        self.kernels = use_triton(self.dev)

    def rng_of(self, call: Call):
        """The rng a verification's kernel draws from (the PyTorch path takes ``call.uniform``)."""
        return call.rng if self.kernels else None

    def _first(self) -> Tensor:
        """Prefill the target and draw the first token (the first root), int64 ``[B]``."""
        root = _sample(self.target.prefill(self.ids, self.real), self.params, self.rows,
                       self.streams.call(((STREAM_SAMPLE, 1),)))
        self.stats.request_target_calls = [1] * self.B
        self.out.add([[t] for t in root.tolist()], [1] * self.B)
        return root

    def _record(self, accepted: list[int], rows: list[list[int]], draft_calls: int = 0) -> None:
        """Book a verification step: ``accepted[b]`` drafts, then one more token, of ``rows[b]``."""
        live = [not d for d in self.out.done]
        self.stats.request_target_calls = [c + g for c, g in zip(self.stats.request_target_calls, live)]
        took = self.out.add(rows, [a + 1 for a in accepted])
        # the accepted drafts among the tokens a request took (max_new_tokens or an EOS may end it at an accepted one)
        self.stats.accepted_per_step.append([min(a, n) for a, n, g in zip(accepted, took, live) if g])
        self.stats.target_calls, self.stats.draft_calls = self.target.calls, draft_calls
        if self.on_step is not None:
            self.on_step(self.out.result(self.stats, self.one_d, self.out_device, self.started))

    def model(self, draft, draft_params: SamplingParams, branching: tuple[int, ...], how: str, tree: bool) -> None:
        """Drafting with a draft model: a chain (branching 1 at every depth) or a tree."""
        B, dev, method = self.B, self.dev, self.method
        layout = tree_layout(branching)
        D, N = layout.depth, layout.size
        self.stats.draft_depth = D
        state = ModelCache(draft, B, dev, self.last, op=OP, name="draft", exact=False)
        sampled = method not in ("target_only", "greedy")
        drafter = ModelDrafter(state, layout, RowsOf(draft_params, B, dev, OP), how, keep_q=sampled)
        plan = (*draft_plan(layout, how), _verify_plan(method, N))
        verify_sampling = "iid" if how == "iid" else "without_replacement"
        positions = layout.tensor("depth", dev)
        whole = torch.ones(B, D, dtype=torch.bool, device=dev), torch.full((B,), D, dtype=torch.long, device=dev)
        if all(self.out.done):
            return
        root = self._first()
        if all(self.out.done):  # the first token ended every request: no draft step follows
            self.stats.target_calls = self.target.calls
            return
        state.prefill(self.ids, self.real)
        pending = torch.stack([torch.zeros_like(root), root], 1)
        pending_on = torch.tensor([[False, True]] * B, device=dev)
        P = 1
        while not all(self.out.done):
            calls = self.streams.step(plan)
            d = drafter.propose(pending, pending_on, P, self.pos_root, calls[:-1])
            start = self.target.slots
            logits = self.target.forward(d.tokens, self.pos_root[:, None] + positions,
                                         layout.bias(dev, self.target.dtype))
            V = logits.shape[-1]
            if drafter.vocab != V:
                fail(OP, "draft", f"a vocabulary of the target's size {V}", drafter.vocab)
            check = calls[-1]
            if tree:
                links = layout.links(B, dev, d.present)
                rp, small = self.rows(N, V)
                res = _verify_tree_prepared(logits, d.tokens, links, d.q_parent, links.usable, method,
                                            verify_sampling, self.params, rp, self.rng_of(check), check.uniform, small)
                host = torch.cat([res.num_accepted[:, None], res.tokens, res.path], 1).tolist()
                path = res.path
            else:
                q = d.q_parent[:, 1:] if sampled else None
                rp, small = self.rows(D + 1, V)
                res = _verify_chain_prepared(logits, d.tokens[:, 1:], q, whole[1], whole[0], method, self.params,
                                             rp, self.rng_of(check), check.uniform, small)
                host = torch.cat([res.num_accepted[:, None], res.tokens], 1).tolist()
                path = None
            n = res.num_accepted
            accepted = [row[0] for row in host]
            tokens = [row[1: D + 2] for row in host]
            self._record(accepted, tokens, state.calls)
            moved = path is not None and any(row[D + 2 + j] != j for row in host for j in range(1, row[0] + 1))
            self.target.keep(start, path if moved else None, n, accepted)
            fed = [min(a, D - 1) for a in accepted]  # the draft never saw the deepest level
            state.keep(d.root_slot, path if moved else None, n.clamp(max=D - 1), fed)
            P = 2 if D in accepted else 1
            pending = torch.tensor([[t[max(a - 1, 0)], t[a]] for t, a in zip(tokens, accepted)], device=dev)
            pending_on = torch.tensor([[a == D, True] for a in accepted], device=dev)
            self.pos_root = self.pos_root + n + 1
        self.stats.target_calls, self.stats.draft_calls = self.target.calls, state.calls

    def ngram(self, k: int, min_n: int, max_n: int) -> None:
        """Drafting by prompt lookup: up to k tokens per request, verified as a ragged chain."""
        dev = self.dev
        self.stats.draft_depth = k
        plan = (_verify_plan(self.method, k + 1),)
        if all(self.out.done):
            return
        contexts = [row[mask].tolist() for row, mask in zip(self.ids, self.real)]
        root = self._first()
        drafter = NgramDrafter(contexts, k, min_n, max_n)
        for b, t in enumerate(root.tolist()):
            drafter.extend(b, [t])
        roots = root.tolist()
        while not all(self.out.done):
            proposals = [[] if done else drafter.propose(b) for b, done in enumerate(self.out.done)]
            K = max(map(len, proposals))
            chain = torch.tensor([[r, *p] + [0] * (K - len(p)) for r, p in zip(roots, proposals)], device=dev)
            num = torch.tensor([len(p) for p in proposals], device=dev)
            start = self.target.slots
            steps = torch.arange(K + 1, device=dev)
            causal = tree_layout((1,) * K).bias(dev, self.target.dtype)  # a chain's mask
            logits = self.target.forward(chain, self.pos_root[:, None] + steps, causal)
            check = self.streams.step(plan)[0]
            rp, small = self.rows(K + 1, logits.shape[-1])
            res = _verify_chain_prepared(logits, chain[:, 1:], None, num, steps[:K] < num[:, None], self.method,
                                         self.params, rp, self.rng_of(check), check.uniform, small)
            host = torch.cat([res.num_accepted[:, None], res.tokens], 1).tolist()
            accepted = [row[0] for row in host]
            tokens = [row[1:] for row in host]
            for b, (t, a) in enumerate(zip(tokens, accepted)):
                if not self.out.done[b]:
                    drafter.extend(b, t[: a + 1])
            self._record(accepted, tokens)
            self.target.keep(start, None, res.num_accepted, accepted)
            roots = [t[a] for t, a in zip(tokens, accepted)]
            self.pos_root = self.pos_root + res.num_accepted + 1
        self.stats.target_calls = self.target.calls
