"""End-to-end speculative generation with Hugging Face causal LMs.

A step: the draft proposes a chain or a tree of tokens after the last committed token (the
*root*), the target scores every node in one forward pass with a tree attention mask, the
verifier (:func:`verify_chain_from_logits` / :func:`verify_tree_from_logits`) accepts a path
and one more token, and both models keep the KV entries of the accepted path (moved in place
by :func:`compact_kv`, the rest cropped). Output tokens are distributed exactly as the target
would sample them with ``params`` (greedy at temperature 0).

Models: anything called as a transformers causal LM, ``model(input_ids=[B, n],
attention_mask=float [B, 1, n, S + n] (0 = visible, dtype min = hidden), position_ids=[B, n],
past_key_values=DynamicCache, use_cache=True).logits -> [B, n, V]``: Llama, Mistral, Qwen,
GPT-NeoX and other full-attention models that take a custom 4-D mask. Sliding-window and
recurrent layers are not supported.

Batches: each request keeps its own positions; cache slots that hold no committed token of a
request (left padding, rejected nodes beyond the shortest path of the batch) stay in the
cache and are hidden by the mask, so requests never see each other's state. A request's
tokens depend on its own prompt, params and Philox seed; the model's floating-point results
may still vary slightly with the batch's cache width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..verify.chain import verify_chain_from_logits
from ..verify.kv import compact_kv
from ..params import SamplingParams
from ..rng import Philox
from ..sampling.ops import logits_to_probs, sample, sample_from_logits
from ..verify.token_tree import TokenTree
from ..verify.tree import verify_tree_from_logits
from ..validation import check_tensor, fail

DRAFTERS = ("chain", "tree")
DRAFT_SAMPLINGS = ("iid", "without_replacement", "deterministic")
CHAIN_METHODS = ("token", "block", "target_only", "greedy")
TREE_METHODS = ("rrs", "traversal", "target_only", "greedy")


@dataclass
class GenerationStats:
    """What a generation cost.

    - ``target_calls`` / ``draft_calls``: forward passes of each model (prefills included).
    - ``accepted_per_step``: per verification step, the accepted drafts of each request still
      generating (``[]`` for plain sampling).
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


# ------------------------------------------------------------------------------ model state


class _KV:
    """One model's KV cache over the batch: its slots, and which slots hold committed tokens."""

    def __init__(self, model, batch: int, device: torch.device):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache()
        self.committed = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.calls = 0

    @property
    def slots(self) -> int:
        return self.committed.shape[1]

    def forward(self, tokens: Tensor, positions: Tensor, visible: Tensor, committed: Tensor | None = None) -> Tensor:
        """Run the model on ``tokens`` int64 ``[B, n]`` at ``positions`` ``[B, n]``; ``visible``
        bool ``[B, n, S + n]``: which slots (old and new) each new token attends to. The new
        slots count as committed where ``committed`` (bool ``[B, n]``) says so.
        Returns float32 logits ``[B, n, V]``."""
        B, n = tokens.shape
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=tokens.device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True)
        self.calls += 1
        new = committed if committed is not None else torch.zeros(B, n, dtype=torch.bool, device=tokens.device)
        self.committed = torch.cat([self.committed, new], 1)
        return out.logits.float()

    def keep_path(self, start: int, path: Tensor, num: Tensor) -> None:
        """Keep the slots ``start + path[b, j]``, j <= ``num[b]``, as committed slots ``start + j``
        (:func:`compact_kv`); drop every slot after the longest kept path of the batch."""
        B = path.shape[0]
        compact_kv(self.cache, torch.full((B,), start, device=path.device), path, num)
        width = int(num.max()) + 1
        kept = torch.arange(width, device=path.device) <= num[:, None]
        self.committed = torch.cat([self.committed[:, :start], kept], 1)
        extra = self.cache.get_seq_length() - self.slots
        if extra > 0:
            self.cache.crop(-extra)  # a negative count removes tokens (transformers 4.x and 5.x)


def _causal(real: Tensor) -> Tensor:
    """bool ``[B, n, n]``: each of n new tokens sees the real ones (``real`` bool ``[B, n]``) up to
    itself, and always itself, so that every query attends to something."""
    n = real.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=real.device).tril()
    return (causal & real[:, None, :]) | torch.eye(n, dtype=torch.bool, device=real.device)


def _prefill(kv: _KV, input_ids: Tensor, real: Tensor) -> Tensor:
    """Feed the prompts (left-padded; ``real`` bool ``[B, L]``); returns the last row's logits ``[B, V]``."""
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    return kv.forward(input_ids, positions, _causal(real), committed=real)[:, -1]


# ------------------------------------------------------------------------------ tree layout


@dataclass(frozen=True)
class _Shape:
    """A static draft-tree layout from branching factors ``(c_1, .., c_D)``: nodes in level
    order (root 0, its ``c_1`` children, their ``c_2`` children each, ...)."""

    branching: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.branching)

    def levels(self) -> list[range]:
        """Node ids of each level 0 .. D."""
        out, start, width = [range(0, 1)], 1, 1
        for c in self.branching:
            width *= c
            out.append(range(start, start + width))
            start += width
        return out

    def parents(self) -> list[int]:
        lv = self.levels()
        return [-1] + [lv[d - 1].start + k // c for d, c in enumerate(self.branching, 1) for k in range(len(lv[d]))]


def _visible_nodes(tree: TokenTree) -> Tensor:
    """bool ``[B, N, N]``: node j is node i or an ancestor of i (:meth:`TokenTree.mask`), and
    every absent node sees itself, so that each of the model's queries attends to something."""
    N = tree.size
    return tree.mask() | torch.eye(N, dtype=torch.bool, device=tree.device)


# ------------------------------------------------------------------------------ randomness


class _Streams:
    """The rng of each random call, in call order. A :class:`Philox` advances its offsets by one
    per call; every step makes the same calls, so request b's draws depend on its seed only."""

    def __init__(self, rng: torch.Generator | Philox | None):
        self.rng, self.calls = rng, 0

    def next(self) -> torch.Generator | Philox | None:
        self.calls += 1
        return self.rng.advance(self.calls - 1) if isinstance(self.rng, Philox) else self.rng


# ------------------------------------------------------------------------------ drafting


def _children(q: Tensor, c: int, how: str, streams: _Streams) -> tuple[Tensor, Tensor]:
    """Draw ``c`` children per parent from ``q`` float ``[B, P, V]``.

    Returns tokens int64 ``[B, P * c]`` (each parent's children together) and bool
    ``[B, P * c]``: whether the child exists (without replacement, a parent whose support is
    used up has fewer children).
    """
    B, P, V = q.shape
    if how == "deterministic":
        return q.topk(min(c, V), -1).indices.reshape(B, -1), torch.ones(B, P * c, dtype=torch.bool, device=q.device)
    if how == "iid":
        x = sample(q[:, :, None, :].expand(B, P, c, V), streams.next())
        return x.reshape(B, -1), torch.ones(B, P * c, dtype=torch.bool, device=q.device)
    left, xs, have = q.clone(), [], []
    for _ in range(c):
        have.append(left.sum(-1) > 0)
        x = sample(left, streams.next())
        left.scatter_(-1, x[..., None], 0.0)
        xs.append(x)
    return torch.stack(xs, 2).reshape(B, -1), torch.stack(have, 2).reshape(B, -1)


def _draft(dkv: _KV, pending: Tensor, pending_on: Tensor, pos_root: Tensor, shape: _Shape, params, how: str,
           streams: _Streams) -> tuple[Tensor, Tensor, Tensor, int]:
    """Let the draft grow one tree per request after the root.

    pending: int64 ``[B, 2]``: the committed tokens the draft has not seen, the last one the
    root; ``pending_on`` bool ``[B, 2]`` says which exist (the root always does).
    Returns the node tokens int64 ``[B, N]`` (node 0 the root), the parents int64 ``[B, N]``
    (``-1`` for absent nodes), the draft distributions float32 ``[B, N, V]`` at every node
    with children (zeros elsewhere), and the draft cache slot of the root.
    """
    B = pending.shape[0]
    dev = pending.device
    P = 2 if bool(pending_on[:, 0].any()) else 1
    toks, on = pending[:, 2 - P:], pending_on[:, 2 - P:]
    visible = torch.cat([dkv.committed[:, None, :].expand(B, P, -1), _causal(on)], 2)
    positions = (pos_root[:, None] - P + 1 + torch.arange(P, device=dev)).clamp(min=0)
    committed = torch.cat([on[:, :-1], torch.zeros(B, 1, dtype=torch.bool, device=dev)], 1)
    root_slot = dkv.slots + P - 1
    q_level = logits_to_probs(dkv.forward(toks, positions, visible, committed)[:, -1:], params)

    levels = shape.levels()
    N = levels[-1].stop
    tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
    tokens[:, 0] = pending[:, 1]
    parents = torch.tensor(shape.parents(), device=dev).expand(B, N).clone()
    q_nodes = torch.zeros(B, N, q_level.shape[-1], device=dev)
    q_nodes[:, :1] = q_level
    prefix = dkv.committed[:, :root_slot]
    for d, c in enumerate(shape.branching, 1):
        lv = levels[d]
        x, have = _children(q_level, c, how, streams)
        parent_ids = parents[:, lv.start:lv.stop]  # the layout's parents (>= 0)
        parent_on = (parent_ids == 0) | (parents.gather(1, parent_ids) >= 0)
        tokens[:, lv.start:lv.stop] = x
        parents[:, lv.start:lv.stop] = torch.where(have & parent_on, parent_ids, -1)
        if d == shape.depth:
            break
        n = len(lv)
        anc = _visible_nodes(TokenTree.from_parents(parents[:, :lv.stop]))[:, lv.start:]
        visible = torch.cat([prefix[:, None, :].expand(B, n, -1), anc], 2)
        q_level = logits_to_probs(dkv.forward(x, (pos_root + d)[:, None].expand(B, n), visible), params)
        q_nodes[:, lv.start:lv.stop] = q_level
    return tokens, parents, q_nodes, root_slot


# ------------------------------------------------------------------------------ generation


def _check_prompt(op: str, input_ids, attention_mask) -> tuple[Tensor, Tensor]:
    """The prompts as int64 ``[B, L]`` and which entries are real tokens (bool ``[B, L]``)."""
    check_tensor(op, "input_ids", input_ids, kind="int", ndim=(1, 2))
    ids = input_ids.reshape(-1, input_ids.shape[-1]).long()
    if ids.shape[1] == 0:
        fail(op, "input_ids", "at least one prompt token", f"shape {list(input_ids.shape)}")
    if attention_mask is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        fail(op, "attention_mask", f"a tensor of the shape of input_ids {list(input_ids.shape)}",
             getattr(attention_mask, "shape", type(attention_mask).__name__))
    real = attention_mask.reshape(ids.shape).to(ids.device).bool()
    last_pad = ~real[:, -1]
    if bool(last_pad.any()):
        fail(op, "attention_mask", "left padding (the last token of every prompt real)", "a padded last token",
             int(last_pad.nonzero()[0, 0]))
    return ids, real


def _check_count(op: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        fail(op, name, f"an int >= {low}", repr(value))
    return value


def _eos_ids(op: str, eos_token_id, device) -> Tensor:
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        fail(op, "eos_token_id", "None, an int >= 0 or a list of them", repr(eos_token_id))
    return torch.tensor(ids, dtype=torch.long, device=device)


class _Output:
    """Per-request generated tokens, with the max_new_tokens and EOS ends applied."""

    def __init__(self, B: int, max_new: int, eos: Tensor):
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.done = [max_new == 0] * B
        self.max_new, self.eos = max_new, eos.tolist()

    def add(self, new: Tensor, count: Tensor) -> None:
        """Append ``new[b, :count[b]]`` (int64 ``[B, J]``) to each request still generating."""
        for b, (row, n) in enumerate(zip(new.tolist(), count.tolist())):
            if self.done[b]:
                continue
            for t in row[:n]:
                self.tokens[b].append(t)
                if t in self.eos or len(self.tokens[b]) >= self.max_new:
                    self.done[b] = True
                    break

    def result(self, stats: GenerationStats, one_d: bool, device, started: float) -> GenerationOutput:
        T = max((len(t) for t in self.tokens), default=0)
        out = torch.full((len(self.tokens), T), -1, dtype=torch.long)
        for b, t in enumerate(self.tokens):
            out[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        stats.new_tokens = [len(t) for t in self.tokens]
        stats.wall_time_s = time.perf_counter() - started
        lengths = torch.tensor(stats.new_tokens, dtype=torch.long, device=device)
        out = out.to(device)
        return GenerationOutput(out[0] if one_d else out, lengths, stats)


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
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
        model: a transformers causal LM (see the module docstring).
        input_ids: integer ``[B, L]`` (left-padded with ``attention_mask``) or ``[L]``.
        max_new_tokens: int >= 0.
        params: :class:`SamplingParams` (scalars or ``[B]``); default temperature 1.
        rng: ``None``, a ``torch.Generator`` or :class:`Philox` (per-request seeds ``[B]``).
        eos_token_id: None, an id or a list of ids that end a request (kept as its last token).
        attention_mask: ``[B, L]``, 1 for real tokens, 0 for left padding.
        on_step: called after every model call with the tokens generated so far.
    Returns:
        :class:`GenerationOutput`.
    """
    op = "generate"
    started = time.perf_counter()
    ids, real = _check_prompt(op, input_ids, attention_mask)
    _check_count(op, "max_new_tokens", max_new_tokens, 0)
    dev = _model_device(model)
    ids, real = ids.to(dev), real.to(dev)
    B = ids.shape[0]
    out = _Output(B, max_new_tokens, _eos_ids(op, eos_token_id, dev))
    stats = GenerationStats(request_target_calls=[0] * B)
    streams = _Streams(rng)
    kv = _KV(model, B, dev)
    pos = real.long().sum(1)
    logits = _prefill(kv, ids, real) if max_new_tokens else None
    while not all(out.done):
        x = sample_from_logits(logits, params, streams.next()).tokens
        stats.request_target_calls = [n + (not d) for n, d in zip(stats.request_target_calls, out.done)]
        out.add(x[:, None], torch.ones_like(x))
        stats.target_calls = kv.calls
        if on_step is not None:
            on_step(out.result(stats, False, dev, started))
        if all(out.done):
            break
        visible = torch.cat([kv.committed[:, None, :], torch.ones(B, 1, 1, dtype=torch.bool, device=dev)], 2)
        logits = kv.forward(x[:, None], pos[:, None], visible, torch.ones(B, 1, dtype=torch.bool, device=dev))[:, 0]
        pos = pos + 1
    return out.result(stats, input_ids.dim() == 1, input_ids.device, started)


def _resolve(op: str, drafter: str, method: str, how: str) -> str:
    """The verification method for a drafter and a draft sampling."""
    if drafter not in DRAFTERS:
        fail(op, "drafter", f"one of {DRAFTERS}", repr(drafter))
    if how not in DRAFT_SAMPLINGS:
        fail(op, "draft_sampling", f"one of {DRAFT_SAMPLINGS}", repr(how))
    methods, sampled = (CHAIN_METHODS, "token") if drafter == "chain" else (TREE_METHODS, "rrs")
    if method not in (*methods, "auto"):
        fail(op, "method", f"one of {('auto', *methods)} for drafter {drafter!r}", repr(method))
    if method == "auto":
        return "target_only" if how == "deterministic" else sampled
    if how == "deterministic" and method not in ("target_only", "greedy"):
        fail(op, "method", "'target_only' or 'greedy' for deterministic drafts (the others need sampled drafts)",
             repr(method))
    if how != "deterministic" and method == "target_only":
        fail(op, "draft_sampling", "'deterministic' for method 'target_only' (it assumes drafts chosen without "
             "randomness)", repr(how))
    return method


def _tree_shape(op: str, drafter: str, num_draft_tokens: int, tree_shape) -> _Shape:
    if drafter == "chain":
        if tree_shape is not None:
            fail(op, "tree_shape", "None for drafter 'chain' (num_draft_tokens sets the chain)", repr(tree_shape))
        return _Shape((1,) * _check_count(op, "num_draft_tokens", num_draft_tokens, 1))
    if tree_shape is None:
        _check_count(op, "num_draft_tokens", num_draft_tokens, 1)
        return _Shape((2, 2) + (1,) * (num_draft_tokens - 2) if num_draft_tokens >= 2 else (2,))
    shape = tuple(tree_shape) if isinstance(tree_shape, (list, tuple)) else None
    if not shape or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in shape):
        fail(op, "tree_shape", "a non-empty list of branching factors >= 1 per depth (e.g. [3, 2, 1])",
             repr(tree_shape))
    return _Shape(shape)


@torch.no_grad()
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
    draft_sampling: str = "iid",
    method: str = "auto",
    rng: torch.Generator | Philox | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: Tensor | None = None,
    draft_params: SamplingParams | None = None,
    on_step: Callable[[GenerationOutput], None] | None = None,
) -> GenerationOutput:
    """Generate with a draft model proposing and the target verifying, losslessly.

    Args:
        target, draft: transformers causal LMs over the same vocabulary (see the module docstring).
        input_ids: integer ``[B, L]`` (left-padded with ``attention_mask``) or ``[L]``.
        max_new_tokens: int >= 0.
        params: the target's :class:`SamplingParams` (scalars or ``[B]``); the output follows
            them exactly. Default: temperature 1.
        drafter: ``"chain"`` (``num_draft_tokens`` drafts per step) or ``"tree"``
            (``tree_shape`` children per node at each depth; default ``[2, 2, 1, ..]`` of
            depth ``num_draft_tokens``).
        tree_shape: branching factors per depth, e.g. ``[3, 2, 1]`` (tree drafter only).
        draft_sampling: ``"iid"`` (siblings drawn independently from the draft),
            ``"without_replacement"`` (distinct siblings; a node whose draft support is used up
            gets fewer children) or ``"deterministic"`` (the most likely tokens of the draft).
        method: ``"auto"``, or a chain method (``token``, ``block``, ``target_only``, ``greedy``)
            or tree method (``rrs``, ``traversal``, ``target_only``, ``greedy``). ``auto``:
            ``token`` / ``rrs`` for sampled drafts, ``target_only`` for deterministic ones.
        rng: ``None``, a ``torch.Generator`` or :class:`Philox` (per-request seeds ``[B]``; the
            first-token draw, each draft level's draws and each verification take the next
            offset, the same sequence for every request).
        eos_token_id: None, an id or a list of ids that end a request (kept as its last token).
        attention_mask: ``[B, L]``, 1 for real tokens, 0 for left padding.
        draft_params: how the draft's logits become its distributions (default ``params``).
        on_step: called after every verification step with the tokens generated so far.
    Returns:
        :class:`GenerationOutput`; ``stats`` counts both models' calls and the accepted drafts.
    """
    op = "speculative_generate"
    started = time.perf_counter()
    ids, real = _check_prompt(op, input_ids, attention_mask)
    _check_count(op, "max_new_tokens", max_new_tokens, 0)
    method = _resolve(op, drafter, method, draft_sampling)
    shape = _tree_shape(op, drafter, num_draft_tokens, tree_shape)
    dev = _model_device(target)
    ids, real = ids.to(dev), real.to(dev)
    B = ids.shape[0]
    draft_params = params if draft_params is None else draft_params
    out = _Output(B, max_new_tokens, _eos_ids(op, eos_token_id, dev))
    stats = GenerationStats(request_target_calls=[0] * B, draft_depth=shape.depth)
    streams = _Streams(rng)
    tkv, dkv = _KV(target, B, dev), _KV(draft, B, dev)
    pos_root = real.long().sum(1)  # the root's position: tokens before it
    D = shape.depth
    if max_new_tokens:
        root = sample_from_logits(_prefill(tkv, ids, real), params, streams.next()).tokens
        _prefill(dkv, ids, real)
        stats.request_target_calls = [1] * B
        out.add(root[:, None], torch.ones_like(root))
    pending_on = torch.tensor([[False, True]] * B, device=dev)
    pending = torch.stack([torch.zeros_like(pos_root), root], 1) if max_new_tokens else None
    while not all(out.done):
        tokens, parents, q_nodes, root_slot = _draft(dkv, pending, pending_on, pos_root, shape, draft_params,
                                                     draft_sampling, streams)
        tree = TokenTree.from_parents(parents)
        visible = torch.cat([tkv.committed[:, None, :].expand(B, tree.size, -1), _visible_nodes(tree)], 2)
        start = tkv.slots
        logits = tkv.forward(tokens, pos_root[:, None] + tree.depth.clamp(min=0), visible)
        if logits.shape[-1] != q_nodes.shape[-1]:
            fail(op, "draft", f"a vocabulary of the target's size {logits.shape[-1]}", q_nodes.shape[-1])
        sampled = method not in ("target_only", "greedy")
        if drafter == "chain":
            res = verify_chain_from_logits(logits, tokens[:, 1:], params, method=method, rng=streams.next(),
                                           draft_probs=q_nodes[:, :-1] if sampled else None)
            path = torch.where(torch.arange(D + 1, device=dev) <= res.num_accepted[:, None],
                               torch.arange(D + 1, device=dev), -1)
        else:
            q_parent = q_nodes.gather(1, parents.clamp(min=0)[:, :, None].expand_as(q_nodes)) if sampled else None
            res = verify_tree_from_logits(logits, tokens, tree, params, draft_probs=q_parent, method=method,
                                          draft_sampling="iid" if draft_sampling == "iid" else "without_replacement",
                                          rng=streams.next())
            path = res.path
        n = res.num_accepted.long()
        stats.accepted_per_step.append([int(v) for v, d in zip(n.tolist(), out.done) if not d])
        stats.request_target_calls = [c + (not d) for c, d in zip(stats.request_target_calls, out.done)]
        out.add(res.tokens, n + 1)
        tkv.keep_path(start, path, n)
        fed = n.clamp(max=D - 1)  # the draft never saw the deepest level
        dkv.keep_path(root_slot, path, fed)
        pending_on = torch.stack([n == D, torch.ones_like(n, dtype=torch.bool)], 1)
        last_draft = res.tokens.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        pending = torch.stack([last_draft, res.tokens.gather(1, n[:, None])[:, 0]], 1)
        pos_root = pos_root + n + 1
        stats.target_calls, stats.draft_calls = tkv.calls, dkv.calls
        if on_step is not None:
            on_step(out.result(stats, False, dev, started))
    stats.target_calls, stats.draft_calls = tkv.calls, dkv.calls
    return out.result(stats, input_ids.dim() == 1, input_ids.device, started)
