"""The public ops on vocabulary shards: ``sample_from_logits``, ``verify_chain_from_logits``,
``verify_tree_from_logits`` with ``shard=`` (docs/design.md, "Vocab-parallel").

Greedy decisions (temperature-0 rows, ``method="greedy"``) run here on any split: one ``all_reduce`` of the
rows' argmax keys (:mod:`.argmax`), then the one-device walk on those ids, identical on every rank. Sampled
rows need the shard-invariant draw recipe (exact integer masses, so that sums do not depend on the split)
and raise ``NotImplementedError`` until it lands.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..params import SamplingParams
from ..rng import Philox
from ..sampling import SampleOutput
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
from .shard import VocabShard

PENDING = ("sampled rows on vocabulary shards need the shard-invariant draw recipe, not built yet: only greedy "
           "rows (temperature 0) and method='greedy' run on shards")


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


def sample_from_logits(logits: Tensor, params: SamplingParams | None = None, rng: Philox | None = None,
                       vocab_mask: Tensor | None = None, num_logprobs: int = 0, *, shard: VocabShard,
                       validate: str = "structure") -> SampleOutput:
    """:func:`specsampler.sample_from_logits` on shards: logits float ``[B, shard.size]`` (global ids
    ``[shard.start, shard.end)``), vocab_mask bool broadcastable to it; the same :class:`SampleOutput` (global
    ids) on every rank, equal to the one-device op on the whole rows. Greedy rows only (see the module)."""
    op = "parallel.sample_from_logits"
    full = check_mode(op, validate)
    x = _inputs(op, logits, "logits", 2, shard, rng, vocab_mask, full)
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int) or num_logprobs < 0:
        fail(op, "num_logprobs", "an int >= 0", repr(num_logprobs))
    if not _greedy(params):
        raise NotImplementedError(f"{op}: {PENDING}")
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


def verify_chain_from_logits(target_logits: Tensor, draft_tokens: Tensor, params: SamplingParams | None = None, *,
                             draft_probs: Tensor | None = None, num_drafts: Tensor | None = None,
                             method: str = "auto", rng: Philox | None = None, vocab_mask: Tensor | None = None,
                             shard: VocabShard, validate: str = "structure") -> ChainResult:
    """:func:`specsampler.verify_chain_from_logits` on shards: target_logits float ``[B, K+1, shard.size]``,
    draft_tokens integer ``[B, K]`` (global ids), num_drafts integer ``[B]``; the same :class:`ChainResult` on
    every rank, equal to the one-device op. ``method="greedy"``, or ``target_only`` with every temperature 0."""
    op = "parallel.verify_chain_from_logits"
    full = check_mode(op, validate)
    x = _inputs(op, target_logits, "target_logits", 3, shard, rng, vocab_mask, full)
    B, K1, _ = x.shape
    K, dev, V = K1 - 1, x.device, shard.vocab_size
    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=2)
    check_shape(op, "draft_tokens", draft_tokens, (B, K), "[B, K]")
    check_device(op, "draft_tokens", draft_tokens, dev)
    method, _ = check_method(op, method, _chain.METHODS, ("token", "block"), draft_probs,
                             (B, K, shard.size), "[B, K, shard.size]", dev)
    if not (method == "greedy" or method == "target_only" and _greedy(params)):
        raise NotImplementedError(f"{op}: {PENDING}")
    drafts = draft_tokens.long()
    n_max = _chain.check_num_drafts(op, num_drafts, B, K, dev, full)
    if full:
        _agreed(op, shard, lambda: check_token_values(op, "draft_tokens", drafts, V), dev)
    y, _ = shard_argmax(x, shard)
    usable = (drafts >= 0) & (drafts < V) & (torch.arange(K, device=dev) < n_max[:, None])
    c = _chain.ChainInputs(B, K, V, "greedy", drafts.clamp(0, V - 1), drafts, usable, n_max, None)
    return _chain.verify_greedy(c, y)


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
    :class:`TreeResult` on every rank, equal to the one-device op. ``method="greedy"``, or ``target_only`` with
    every temperature 0."""
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
    method, _ = check_method(op, method, _tree.METHODS, ("rrs", "traversal"), draft_probs,
                             (B, N, shard.size), "[B, N, shard.size]", dev)
    if not (method == "greedy" or method == "target_only" and _greedy(params)):
        raise NotImplementedError(f"{op}: {PENDING}")
    drafts = draft_tokens.long()
    if full:
        _agreed(op, shard, lambda: check_token_values(op, "draft_tokens", drafts[tree.depth > 0], V), dev)
    y, _ = shard_argmax(x, shard)
    usable = (tree.depth > 0) & (drafts >= 0) & (drafts < V)
    c = walks.TreeInputs(B, N, V, "greedy", draft_sampling, tree, drafts.clamp(0, V - 1), drafts, usable, None)
    path, n, y_out = walks.walk_draws(c, _Argmaxes(y), None, op)
    return _tree._finish(c, path, n, y_out, n.float())
