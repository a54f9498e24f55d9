"""The public ops on vocabulary shards: ``sample_from_logits``, ``verify_chain_from_logits``,
``verify_tree_from_logits`` with ``shard=`` (docs/design.md, "Vocab-parallel").

Greedy decisions (``method="greedy"``, every temperature 0) take one ``all_reduce`` of the rows' argmax keys
(:mod:`.argmax`). Sampled rows are processed on the shards (:mod:`.process`) and the one-device walks run on
them through :class:`.vocab.ShardVocab`, whose sums, values and draws are exact whatever the split: every rank
takes the decisions the one-device op takes, on the same Philox numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..params import SamplingParams
from ..rng import STREAM_SAMPLE, Philox, uniform
from ..sampling import SampleOutput
from ..sampling.rounding import in_vector_body
from ..validation import (
    ValidationError,
    check_device,
    check_logits_values,
    check_method,
    check_mode,
    check_shape,
    check_tensor,
    check_token_values,
    fail,
)
from ..verify import ChainResult, TokenTree, TreeResult, walks
from ..verify import chain as _chain
from ..verify import tree as _tree
from .argmax import shard_argmax
from .process import process_shard
from .shard import VocabShard
from .vocab import ShardVocab


def _inputs(op: str, logits: Tensor, name: str, ndim: int, shard: object, rng: object, vocab_mask: Tensor | None,
            full: bool) -> Tensor:
    """Checks shared by the ops; returns the logits (their dtype) with masked tokens at -inf."""
    if not isinstance(shard, VocabShard):
        fail(op, "shard", "a specsampler.parallel.VocabShard", type(shard).__name__)
    if rng is not None and not isinstance(rng, Philox):
        fail(op, "rng", "a specsampler.Philox (the same streams on every rank)", type(rng).__name__)
    check_tensor(op, name, logits, kind="float", ndim=ndim)
    shard.check_rows(op, name, logits)
    x = logits
    if vocab_mask is not None:
        check_tensor(op, "vocab_mask", vocab_mask, kind="bool")
        check_device(op, "vocab_mask", vocab_mask, logits.device)
        try:
            mask = vocab_mask.expand_as(x)
        except RuntimeError:
            fail(op, "vocab_mask", f"a bool tensor broadcastable to {list(x.shape)}", f"shape {list(vocab_mask.shape)}")
        x = x.masked_fill(~mask, float("-inf"))
    if full:
        _agreed(op, shard, lambda: check_logits_values(op, name, logits), logits.device)
    return x


def _agreed(op: str, shard: VocabShard, check, device) -> None:
    """Run a value check on every rank and raise on all of them if it fails on any (a rank that raised alone
    would leave the others waiting in the next collective)."""
    try:
        check()
        bad, message = torch.zeros(1, dtype=torch.int64, device=device), None
    except ValidationError as e:
        bad, message = torch.ones(1, dtype=torch.int64, device=device), str(e)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=shard.group)
    if bool(bad):
        raise ValidationError(message or f"{op}: a value check failed on another rank of the shard's group")


def _greedy(params: SamplingParams | None) -> bool:
    """Every request's temperature is 0 (read on the host: one sync where the tensor is on a device)."""
    t = 1.0 if params is None else params.temperature
    return bool((t == 0).all()) if isinstance(t, Tensor) else t == 0


def _sampled_needs_philox(op: str, rng: object) -> None:
    """Sampled rows draw: every rank must draw the same numbers, which only a Philox gives."""
    if not isinstance(rng, Philox):
        fail(op, "rng", "a specsampler.Philox for sampled rows (the same streams on every rank)", repr(rng))


def _rows(op: str, params: SamplingParams | None, B: int, M: int, device, full: bool):
    return (params if params is not None else SamplingParams()).rows(op, B, M, device, full)


def sample_from_logits(logits: Tensor, params: SamplingParams | None = None, rng: Philox | None = None,
                       vocab_mask: Tensor | None = None, num_logprobs: int = 0, *, shard: VocabShard,
                       validate: str = "structure") -> SampleOutput:
    """:func:`specsampler.sample_from_logits` on shards: logits float ``[B, shard.size]`` (global ids
    ``[shard.start, shard.end)``), vocab_mask bool broadcastable to it; the same :class:`SampleOutput` (global
    ids) on every rank, equal to the one-device op on the whole rows; ``rng`` a :class:`Philox` where a row is
    sampled."""
    op = "parallel.sample_from_logits"
    full = check_mode(op, validate)
    x = _inputs(op, logits, "logits", 2, shard, rng, vocab_mask, full)
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int) or num_logprobs < 0:
        fail(op, "num_logprobs", "an int >= 0", repr(num_logprobs))
    if not _greedy(params):
        return _sample(op, x, params, rng, num_logprobs, shard, full)
    tokens, mass = shard_argmax(x, shard)
    # a greedy row is one-hot: log-probability 0 at its token, -inf elsewhere; -inf everywhere without mass
    logprobs = torch.where(mass, 0.0, float("-inf"))
    if num_logprobs == 0:
        return SampleOutput(tokens, logprobs, None, None)
    B = x.shape[0]
    top_ids = torch.full((B, num_logprobs), -1, dtype=torch.int64, device=x.device)
    top_lp = torch.full((B, num_logprobs), float("-inf"), device=x.device)
    top_ids[:, 0] = torch.where(mass, tokens, -1)
    top_lp[:, 0] = logprobs
    return SampleOutput(tokens, logprobs, top_ids, top_lp)


def _sample(op, x, params, rng, num_logprobs, shard, full) -> SampleOutput:
    """Sampled (and mixed) rows: processed on the shards, drawn by exact inversion across them."""
    _sampled_needs_philox(op, rng)
    B = x.shape[0]
    proc = process_shard(x.float(), _rows(op, params, B, 1, x.device, full), ShardVocab(shard))
    tokens = proc.sample(uniform(rng, op, B, 1, STREAM_SAMPLE, x.device).reshape(-1))
    logprobs = in_vector_body(torch.log, proc.prob(tokens))
    top_ids = top_lp = None
    if num_logprobs:
        top_ids, top_lp = proc.top(num_logprobs)
    return SampleOutput(tokens, logprobs, top_ids, top_lp)


def verify_chain_from_logits(target_logits: Tensor, draft_tokens: Tensor, params: SamplingParams | None = None, *,
                             draft_probs: Tensor | None = None, num_drafts: Tensor | None = None,
                             method: str = "auto", rng: Philox | None = None, vocab_mask: Tensor | None = None,
                             shard: VocabShard, validate: str = "structure") -> ChainResult:
    """:func:`specsampler.verify_chain_from_logits` on shards: target_logits float ``[B, K+1, shard.size]``,
    draft_tokens integer ``[B, K]`` (global ids), num_drafts integer ``[B]``; the same :class:`ChainResult` on
    every rank, equal to the one-device op; draft_probs float ``[B, K, shard.size]``; ``rng`` a :class:`Philox`
    unless every decision is greedy."""
    op = "parallel.verify_chain_from_logits"
    full = check_mode(op, validate)
    x = _inputs(op, target_logits, "target_logits", 3, shard, rng, vocab_mask, full)
    B, K1, _ = x.shape
    K, dev, V = K1 - 1, x.device, shard.vocab_size
    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=2)
    check_shape(op, "draft_tokens", draft_tokens, (B, K), "[B, K]")
    check_device(op, "draft_tokens", draft_tokens, dev)
    method, q = check_method(op, method, _chain.METHODS, ("token", "block"), draft_probs,
                             (B, K, shard.size), "[B, K, shard.size]", dev)
    drafts = draft_tokens.long()
    n_max = _chain.check_num_drafts(op, num_drafts, B, K, dev, full)
    if full:
        _agreed(op, shard, lambda: check_token_values(op, "draft_tokens", drafts, V), dev)
    usable = (drafts >= 0) & (drafts < V) & (torch.arange(K, device=dev) < n_max[:, None])
    vocab = ShardVocab(shard)
    if method == "greedy" or method == "target_only" and _greedy(params):
        c = _chain.ChainInputs(B, K, V, "greedy", drafts.clamp(0, V - 1), drafts, usable, n_max, None, vocab)
        return _chain.verify_greedy(c, shard_argmax(x, shard)[0])
    _sampled_needs_philox(op, rng)
    c = _chain.ChainInputs(B, K, V, method, drafts.clamp(0, V - 1), drafts, usable, n_max, q, vocab)
    target = process_shard(x.reshape(B * K1, shard.size).float(), _rows(op, params, B, K1, dev, full), vocab)
    res = _chain._verify(c, target, None, rng, op)
    res.expected_accepted  # noqa: B018 (its collectives now, on every rank: a rank reading it alone would wait)
    return res


class _ShardRows(walks.TargetRows):
    """The target rows a walk visits, processed on the shards (logits already masked)."""

    def __init__(self, logits: Tensor, rp, vocab: ShardVocab):
        super().__init__(logits=logits, rp=rp)
        self.vocab = vocab

    def at(self, b: Tensor, node: Tensor):
        flat = self._flat(b, node)
        return process_shard(self._logits(b, node, flat), self.rp.take(flat), self.vocab)


class _Argmaxes:
    """The walk's view of the target rows when only their argmax is needed: the global ids ``[B, N]``."""

    def __init__(self, ids: Tensor):
        self.ids = ids

    def argmax(self, b: Tensor, node: Tensor) -> Tensor:
        return self.ids[b, node]


def verify_tree_from_logits(target_logits: Tensor, draft_tokens: Tensor, tree: TokenTree,
                            params: SamplingParams | None = None, *, draft_probs: Tensor | None = None,
                            method: str = "auto", draft_sampling: str = "iid", rng: Philox | None = None,
                            vocab_mask: Tensor | None = None, shard: VocabShard,
                            validate: str = "structure") -> TreeResult:
    """:func:`specsampler.verify_tree_from_logits` on shards: target_logits float ``[B, N, shard.size]``,
    draft_tokens integer ``[B, N]`` (global ids), tree a :class:`TokenTree` (the same on every rank); the same
    :class:`TreeResult` on every rank, equal to the one-device op; draft_probs float ``[B, N, shard.size]``;
    ``rng`` a :class:`Philox` unless every decision is greedy."""
    op = "parallel.verify_tree_from_logits"
    full = check_mode(op, validate)
    x = _inputs(op, target_logits, "target_logits", 3, shard, rng, vocab_mask, full)
    B, N, _ = x.shape
    dev, V = x.device, shard.vocab_size
    if not isinstance(tree, TokenTree):
        fail(op, "tree", "a specsampler.TokenTree", type(tree).__name__)
    check_shape(op, "tree.parents", tree.parents, (B, N), "[B, N]")
    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=2)
    check_shape(op, "draft_tokens", draft_tokens, (B, N), "[B, N]")
    check_device(op, "draft_tokens", draft_tokens, dev)
    if draft_sampling not in ("iid", "without_replacement"):
        fail(op, "draft_sampling", "one of ('iid', 'without_replacement')", repr(draft_sampling))
    method, q = check_method(op, method, _tree.METHODS, ("rrs", "traversal"), draft_probs,
                             (B, N, shard.size), "[B, N, shard.size]", dev)
    drafts = draft_tokens.long()
    if full:
        _agreed(op, shard, lambda: check_token_values(op, "draft_tokens", drafts[tree.depth > 0], V), dev)
    usable = (tree.depth > 0) & (drafts >= 0) & (drafts < V)
    vocab = ShardVocab(shard)
    if method == "greedy" or method == "target_only" and _greedy(params):
        c = walks.TreeInputs(B, N, V, "greedy", draft_sampling, tree, drafts.clamp(0, V - 1), drafts, usable, None,
                             vocab)
        path, n, y_out = walks.walk_draws(c, _Argmaxes(shard_argmax(x, shard)[0]), None, op)
        return _tree._finish(c, path, n, y_out, n.float())
    _sampled_needs_philox(op, rng)
    c = walks.TreeInputs(B, N, V, method, draft_sampling, tree, drafts.clamp(0, V - 1), drafts, usable, q, vocab)
    rows = _ShardRows(x.float(), _rows(op, params, B, N, dev, full), vocab)
    path, n, y_out = walks.WALKS[method](c, rows, rng, op)
    return _tree._finish(c, path, n, y_out, None)
