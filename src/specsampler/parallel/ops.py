"""The public ops on vocabulary shards: ``sample_from_logits``, ``verify_chain_from_logits``,
``verify_tree_from_logits`` with ``shard=`` (docs/design.md, "Vocab-parallel").

Two strategies, the same tokens: ``shard`` keeps the rows where they are: greedy decisions take one ``all_reduce``
of the rows' argmax keys (:mod:`.argmax`), sampled rows are processed on the shards (:mod:`.process`) and verified
(:mod:`.walks`) in a few rounds of small collectives (:mod:`.rounds`), every rank taking the decisions the
one-device op takes on the same Philox numbers; ``gather`` all-gathers the rows (:mod:`.gather`) and runs the
one-device op. ``auto`` picks the cheaper by a latency-bandwidth model of the link (:mod:`.cost`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from .. import sampling as _sampling
from ..params import SamplingParams
from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, Philox, uniform
from ..sampling import SampleOutput
from ..sampling.filters import masked_logits
from ..sampling.rounding import in_vector_body
from ..tracing import eager_when_traced
from ..validation import (
    ValidationError,
    check_device,
    check_logits_values,
    check_method,
    check_mode,
    check_probs_values,
    check_shape,
    check_tensor,
    check_token_values,
    fail,
)
from ..verify import ChainResult, TokenTree, TreeResult
from ..verify import chain as _chain
from ..verify import tree as _tree
from ..verify import walks as _walks
from . import cost, walks
from .argmax import shard_argmax
from .gather import whole_rows
from .process import process, sample
from .rounds import digest, run
from .shard import VocabShard

STRATEGIES = ("auto", "shard", "gather")
_MESSAGE_BYTES = 512  # a value check's message, as every rank receives it


def _inputs(op: str, logits: Tensor, name: str, ndim: int, shard: object, rng: object, vocab_mask: Tensor | None,
            strategy: str, link: object) -> None:
    """Checks shared by the ops (those every rank can make alike, before any collective)."""
    if not isinstance(shard, VocabShard):
        fail(op, "shard", "a specsampler.parallel.VocabShard", type(shard).__name__)
    if rng is not None and not isinstance(rng, Philox):
        fail(op, "rng", "a specsampler.Philox (the same streams on every rank)", type(rng).__name__)
    if strategy not in STRATEGIES:
        fail(op, "strategy", f"one of {STRATEGIES}", repr(strategy))
    if link is not None and not isinstance(link, cost.Link) and link not in cost.LINKS:
        fail(op, "link", f"None, a specsampler.parallel.Link or one of {tuple(cost.LINKS)}", repr(link))
    check_tensor(op, name, logits, kind="float", ndim=ndim)
    shard.check_rows(op, name, logits)
    if vocab_mask is not None:
        check_tensor(op, "vocab_mask", vocab_mask, kind="bool")
        check_device(op, "vocab_mask", vocab_mask, logits.device)
        try:
            vocab_mask.expand_as(logits)
        except RuntimeError:
            fail(op, "vocab_mask", f"a bool tensor broadcastable to {list(logits.shape)}",
                 f"shape {list(vocab_mask.shape)}")


def _masked(logits: Tensor, vocab_mask: Tensor | None) -> Tensor:
    """The logits (their dtype) with masked tokens at -inf."""
    return logits if vocab_mask is None else masked_logits(logits, vocab_mask.expand_as(logits))


def _agreed(op: str, shard: VocabShard, check, device) -> None:
    """Run a value check on every rank and raise on all of them if it fails on any, with the first failing rank's
    message (a rank that raised alone would leave the others waiting in the next collective): one ``all_gather``
    of each rank's message, a few hundred bytes."""
    try:
        check()
        message = b""
    except ValidationError as e:
        message = f"{e} (on rank {dist.get_rank(shard.group)}, which holds ids [{shard.start}, {shard.end}))".encode()
    message = message[:_MESSAGE_BYTES]
    sent = torch.tensor(list(message) + [0] * (_MESSAGE_BYTES - len(message)), dtype=torch.uint8, device=device)
    got = [torch.empty_like(sent) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(got, sent, group=shard.group)
    for m in torch.stack(got).cpu():  # one read on the host, every rank's message
        if m[0]:
            raise ValidationError(bytes(m.tolist()).rstrip(b"\0").decode(errors="replace"))


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


def _gathered(op: str, fingerprint: Tensor, shard: VocabShard, logits: Tensor, vocab_mask: Tensor | None,
              *more: Tensor | None) -> list[Tensor]:
    """The ``gather`` strategy's round: the whole rows of the logits, the mask (where given) and ``more`` (where
    given), on every rank. The values were checked on the shards (``validate="full"``), so the one-device op that
    follows checks structure only."""
    rows = [logits] + ([] if vocab_mask is None else [vocab_mask.expand_as(logits)])
    return whole_rows(shard, rows + [t for t in more if t is not None], op, fingerprint)


def _fingerprint(op: str, logits: Tensor, vocab_mask: Tensor | None, draft_probs: Tensor | None, *args) -> Tensor:
    """:func:`.rounds.digest` of a call: its op, the shapes and dtypes but the shards' columns, and ``args``."""
    def rows(t: Tensor | None):
        return None if t is None else (tuple(t.shape[:-1]), str(t.dtype))
    return digest(logits.device, op, rows(logits), rows(vocab_mask), rows(draft_probs), *args)


def _strategy(strategy: str, link: cost.Link, shard: VocabShard, plans, rows: int) -> str:
    """``strategy``, or for ``auto`` the one :mod:`.cost` predicts cheaper on ``link`` (``plans()``: the bytes each
    rank sends per round with ``shard`` and with ``gather``; the same on every rank, so every rank chooses alike);
    ``shard`` for a call of no ``rows`` (nothing to weigh: both give the empty result)."""
    if strategy != "auto":
        return strategy
    if not rows:
        return "shard"
    return cost.choose(link, dist.get_world_size(shard.group), *plans())


@eager_when_traced()  # collectives and the PyTorch path on the shards: as in eager mode
@torch.no_grad()
def sample_from_logits(logits: Tensor, params: SamplingParams | None = None, rng: Philox | None = None,
                       vocab_mask: Tensor | None = None, num_logprobs: int = 0, *, shard: VocabShard,
                       validate: str = "structure", strategy: str = "auto",
                       link: str | cost.Link | None = None) -> SampleOutput:
    """:func:`specsampler.sample_from_logits` on shards: logits float ``[B, shard.size]`` (global ids
    ``[shard.start, shard.end)``), vocab_mask bool broadcastable to it; the same :class:`SampleOutput` (global
    ids) on every rank, equal to the one-device op on the whole rows; ``rng`` a :class:`Philox` where a row is
    sampled. strategy: ``"shard"`` (at most 3 rounds, 4 with top-p: docs/design.md), ``"gather"`` (the rows
    all-gathered, then the one-device op) or ``"auto"`` (the cheaper for ``link``, :mod:`.cost`)."""
    op = "parallel.sample_from_logits"
    full = check_mode(op, validate)
    _inputs(op, logits, "logits", 2, shard, rng, vocab_mask, strategy, link)
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int) or num_logprobs < 0:
        fail(op, "num_logprobs", "an int >= 0", repr(num_logprobs))
    greedy = _greedy(params)
    if not greedy:
        _sampled_needs_philox(op, rng)
    B, dev = logits.shape[0], logits.device
    rp = _rows(op, params, B, 1, dev, full)
    if full:
        _agreed(op, shard, lambda: check_logits_values(op, "logits", logits), dev)
    how = _strategy(strategy, cost.link_of(link, shard), shard,
                    lambda: cost.sample_plan(rp, greedy, num_logprobs, logits, vocab_mask, shard), B)

    def fingerprint():
        return _fingerprint(op, logits, vocab_mask, None, params, rng, num_logprobs, validate, strategy, link)

    if how == "gather":
        x, *mask = _gathered(op, fingerprint(), shard, logits, vocab_mask)
        return _sampling.sample_from_logits(x, params, rng, mask[0] if mask else None, num_logprobs)
    x = _masked(logits, vocab_mask)
    if not greedy or num_logprobs > 1:  # more log-probabilities: the greedy rows' candidates, as on one device
        return _sample(op, x, rp, rng, num_logprobs, shard, fingerprint())
    tokens, mass = shard_argmax(x, shard)
    # a greedy row is one-hot: log-probability 0 at its token, -inf elsewhere; -inf everywhere without mass
    logprobs = torch.where(mass, 0.0, float("-inf"))
    if num_logprobs == 0:
        return SampleOutput(tokens, logprobs, None, None)
    return SampleOutput(tokens, logprobs, torch.where(mass, tokens, -1)[:, None], logprobs[:, None])


def _sample(op, x, rp, rng, num_logprobs, shard, fingerprint) -> SampleOutput:
    """Sampled (and mixed) rows, and greedy ones with more than one log-probability: processed on the shards,
    drawn by exact inversion across them."""
    B, dev = x.shape[0], x.device
    u = uniform(rng, op, B, 1, STREAM_SAMPLE, dev).reshape(-1)

    def steps():
        rows = yield from process(x.float(), rp, shard, None, num_logprobs)
        return (yield from sample(rows, u, num_logprobs, shard))

    tokens, probs, top_ids, top_p = run(steps(), shard, dev, op, fingerprint)
    logprobs = in_vector_body(torch.log, probs)
    if not num_logprobs:
        return SampleOutput(tokens, logprobs, None, None)
    return SampleOutput(tokens, logprobs, top_ids, in_vector_body(torch.log, top_p))


@eager_when_traced()  # collectives and the PyTorch path on the shards: as in eager mode
@torch.no_grad()
def verify_chain_from_logits(target_logits: Tensor, draft_tokens: Tensor, params: SamplingParams | None = None, *,
                             draft_probs: Tensor | None = None, num_drafts: Tensor | None = None,
                             method: str = "auto", rng: Philox | None = None, vocab_mask: Tensor | None = None,
                             shard: VocabShard, validate: str = "structure", strategy: str = "auto",
                             link: str | cost.Link | None = None) -> ChainResult:
    """:func:`specsampler.verify_chain_from_logits` on shards: target_logits float ``[B, K+1, shard.size]``,
    draft_tokens integer ``[B, K]`` (global ids), num_drafts integer ``[B]``; the same :class:`ChainResult` on
    every rank, equal to the one-device op; draft_probs float ``[B, K, shard.size]``; ``rng`` a :class:`Philox`
    unless every decision is greedy. strategy: ``"shard"`` (at most 5 rounds), ``"gather"`` or ``"auto"``, as for
    :func:`sample_from_logits`."""
    op = "parallel.verify_chain_from_logits"
    full = check_mode(op, validate)
    _inputs(op, target_logits, "target_logits", 3, shard, rng, vocab_mask, strategy, link)
    B, K1, size = target_logits.shape
    K, dev, V = K1 - 1, target_logits.device, shard.vocab_size
    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=2)
    check_shape(op, "draft_tokens", draft_tokens, (B, K), "[B, K]")
    check_device(op, "draft_tokens", draft_tokens, dev)
    method, q = check_method(op, method, _chain.METHODS, ("token", "block"), draft_probs, (B, K, size),
                             "[B, K, shard.size]", dev)
    greedy = method == "greedy" or method == "target_only" and _greedy(params)
    if not greedy:
        _sampled_needs_philox(op, rng)
    drafts = draft_tokens.long()
    n_max = _chain.check_num_drafts(op, num_drafts, B, K, dev, full)
    rp = _rows(op, params, B, K1, dev, full)
    if full:
        _agreed(op, shard, lambda: (
            check_logits_values(op, "target_logits", torch.where(_chain.drafted(n_max, K1, bonus=True)[..., None],
                                                                 target_logits.float(), 0.0)),
            check_token_values(op, "draft_tokens", torch.where(_chain.drafted(n_max, K), drafts, 0), V),
            q is not None and check_probs_values(op, "draft_probs", torch.where(_chain.drafted(n_max, K)[..., None],
                                                                                q.float(), 1.0), whole_rows=False)),
            dev)
    link = cost.link_of(link, shard)
    how = _strategy(strategy, link, shard,
                    lambda: cost.chain_plan(method, greedy, rp, target_logits, q, vocab_mask, shard, link), B)

    def fingerprint():
        return _fingerprint(op, target_logits, vocab_mask, q, drafts, params, method, num_drafts, rng, validate,
                            strategy, link)

    if how == "gather":
        x, *rest = _gathered(op, fingerprint(), shard, target_logits, vocab_mask, q)
        mask = rest.pop(0) if vocab_mask is not None else None
        return _chain.verify_chain_from_logits(x, draft_tokens, params, draft_probs=rest[0] if rest else None,
                                               num_drafts=num_drafts, method=method, rng=rng, vocab_mask=mask)
    x = _masked(target_logits, vocab_mask)
    c = _chain.ChainInputs(B, K, V, "greedy" if greedy else method, drafts, n_max, q)
    if greedy:
        ids, mass = shard_argmax(x, shard)
        if method == "target_only":  # as the one-device op: a row without mass accepts no draft (greedy: its argmax)
            c = replace(c, given_usable=c.usable & mass.view(B, K1)[:, :K])
        return _chain.verify_greedy(c, ids)
    u_draw = uniform(rng, op, B, K1, STREAM_SAMPLE, dev)
    u_accept = uniform(rng, op, B, K1, STREAM_ACCEPT, dev) if method in ("token", "block") else None
    if B == 0:
        return _chain._result(c, torch.zeros(0, dtype=torch.int64, device=dev),
                              torch.zeros(0, dtype=torch.int64, device=dev), lambda: torch.zeros(0, device=dev))
    return run(walks.verify_chain(c, x.reshape(B * K1, size).float(), rp, shard, u_draw, u_accept, link), shard, dev,
               op, fingerprint())


class _Argmaxes:
    """The walk's view of the target rows when only their argmax is needed: the global ids ``[B, N]``."""

    def __init__(self, ids: Tensor):
        self.ids = ids

    def argmax(self, b: Tensor, node: Tensor) -> Tensor:
        return self.ids[b, node]


@eager_when_traced()  # collectives and the PyTorch path on the shards: as in eager mode
@torch.no_grad()
def verify_tree_from_logits(target_logits: Tensor, draft_tokens: Tensor, tree: TokenTree,
                            params: SamplingParams | None = None, *, draft_probs: Tensor | None = None,
                            method: str = "auto", draft_sampling: str = "iid", rng: Philox | None = None,
                            vocab_mask: Tensor | None = None, shard: VocabShard, validate: str = "structure",
                            strategy: str = "auto", link: str | cost.Link | None = None) -> TreeResult:
    """:func:`specsampler.verify_tree_from_logits` on shards: target_logits float ``[B, N, shard.size]``,
    draft_tokens integer ``[B, N]`` (global ids), tree a :class:`TokenTree` (the same on every rank); the same
    :class:`TreeResult` on every rank, equal to the one-device op; draft_probs float ``[B, N, shard.size]``;
    ``rng`` a :class:`Philox` unless every decision is greedy. strategy: ``"shard"`` (rounds: docs/design.md),
    ``"gather"`` or ``"auto"``, as for :func:`sample_from_logits`."""
    op = "parallel.verify_tree_from_logits"
    full = check_mode(op, validate)
    _inputs(op, target_logits, "target_logits", 3, shard, rng, vocab_mask, strategy, link)
    B, N, size = target_logits.shape
    dev, V = target_logits.device, shard.vocab_size
    if not isinstance(tree, TokenTree):
        fail(op, "tree", "a specsampler.TokenTree", type(tree).__name__)
    check_shape(op, "tree.parents", tree.parents, (B, N), "[B, N]")
    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=2)
    check_shape(op, "draft_tokens", draft_tokens, (B, N), "[B, N]")
    check_device(op, "draft_tokens", draft_tokens, dev)
    if draft_sampling not in _tree.DRAFT_SAMPLING:
        fail(op, "draft_sampling", f"one of {_tree.DRAFT_SAMPLING}", repr(draft_sampling))
    method, q = check_method(op, method, _tree.METHODS, ("rrs", "traversal"), draft_probs,
                             (B, N, size), "[B, N, shard.size]", dev)
    greedy = method == "greedy" or method == "target_only" and _greedy(params)
    if not greedy:
        _sampled_needs_philox(op, rng)
    drafts = draft_tokens.long()
    rp = _rows(op, params, B, N, dev, full)
    if full:
        depth = tree.depth.to(dev)
        child, present = depth > 0, (depth >= 0)[..., None]  # absent nodes' rows are padding
        _agreed(op, shard, lambda: (
            check_logits_values(op, "target_logits", torch.where(present, target_logits.float(), 0.0)),
            check_token_values(op, "draft_tokens", torch.where(child, drafts, 0), V),
            q is not None and check_probs_values(op, "draft_probs", torch.where(child[..., None], q.float(), 1.0),
                                                 whole_rows=False)),
            dev)
    link = cost.link_of(link, shard)
    how = _strategy(strategy, link, shard, lambda: cost.tree_plan(method, draft_sampling, greedy, rp, tree,
                                                                   target_logits, q, vocab_mask, shard, link), B)

    def fingerprint():
        return _fingerprint(op, target_logits, vocab_mask, q, drafts, tree, params, method, draft_sampling, rng,
                            validate, strategy, link)

    if how == "gather":
        x, *rest = _gathered(op, fingerprint(), shard, target_logits, vocab_mask, q)
        mask = rest.pop(0) if vocab_mask is not None else None
        return _tree.verify_tree_from_logits(x, draft_tokens, tree, params, draft_probs=rest[0] if rest else None,
                                             method=method, draft_sampling=draft_sampling, rng=rng, vocab_mask=mask)
    x = _masked(target_logits, vocab_mask)
    c = _walks.TreeInputs(B, N, V, "greedy" if greedy else method, draft_sampling, tree, drafts, q)
    if greedy:
        ids, mass = shard_argmax(x, shard)
        if method == "target_only":  # as the one-device op: a node without mass accepts no child (greedy: any)
            mass = mass.view(B, N)
            c = replace(c, given_usable=c.usable & mass.gather(1, tree.parents.clamp(min=0)))
        path, n, y_out = _walks.walk_draws(c, _Argmaxes(ids), None, op)
        return _tree._finish(c, path, n, y_out, n.float() if method == "greedy" else None)  # as the one-device op
    u_draw = uniform(rng, op, B, N, STREAM_SAMPLE, dev)
    u_accept = uniform(rng, op, B, N, STREAM_ACCEPT, dev) if method in ("rrs", "traversal") else None
    if B == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return _tree._finish(c, torch.zeros(0, tree.max_depth + 1, dtype=torch.int64, device=dev), empty, empty, None)
    path, n, y_out = run(walks.verify_tree(c, x.reshape(B * N, size).float(), rp, shard, u_draw, u_accept, link),
                         shard, dev, op, fingerprint())
    return _tree._finish(c, path, n, y_out, None)
