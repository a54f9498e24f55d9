"""The ``auto`` strategy's latency-bandwidth model (docs/design.md, "Vocab-parallel: shard or gather").

A collective round costs ``alpha`` seconds whatever its size, plus ``beta`` seconds per byte a rank receives: an
``all_gather`` of ``b`` bytes per rank over ``world`` ranks brings each ``(world - 1) * b``. A strategy's time is the
sum over its rounds, from the bytes each rank sends per round, which the plans below give from the call's shapes and
parameters alone (the same on every rank, so every rank chooses alike): ``shard``'s rounds as :mod:`.process`,
:mod:`.nucleus`, :mod:`.draws` and :mod:`.walks` send them (a top-p row's cut counted at its usual three rounds, a
draw's at one; tests/parallel checks the plans against :func:`.count_collectives`), ``gather``'s one round of the
rows (and masks, draft probabilities) of ``ceil(V / world)`` columns. Compute is not modelled: on a GPU both
strategies read the shard about as often; ``gather`` then processes ``world`` times more columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..params import RowParams
from ..sampling.processing import _kinds
from .draws import WINDOW
from .nucleus import APPROX_BINS, ENTRIES, most_sub_bins
from .process import fewest_rounds
from .shard import VocabShard


@dataclass(frozen=True)
class Link:
    """A link's cost model: ``alpha`` seconds per collective round, ``beta`` seconds per byte a rank receives."""

    alpha: float
    beta: float

    def time(self, rounds: list[int], world: int) -> float:
        """Seconds for rounds of ``rounds[i]`` bytes sent by each rank (every round an ``all_gather``)."""
        return sum(self.alpha + self.beta * (world - 1) * b for b in rounds)


# defaults: NVLink (NCCL, one node), PCIe (NCCL without NVLink), Ethernet (across nodes, 100 Gb/s)
LINKS = {"nvlink": Link(20e-6, 1 / 300e9), "pcie": Link(25e-6, 1 / 20e9), "ethernet": Link(50e-6, 1 / 12e9)}


def link_of(link: str | Link | None, shard: VocabShard) -> Link:
    """The model ``link`` names (a key of :data:`LINKS`, or a :class:`Link`); None: NVLink for an NCCL group,
    Ethernet otherwise."""
    if link is None:
        return LINKS["nvlink" if dist.get_backend(shard.group) == "nccl" else "ethernet"]
    return link if isinstance(link, Link) else LINKS[link]


def choose(link: Link, world: int, shard: list[int], gather: list[int]) -> str:
    """``"shard"`` or ``"gather"``: the one whose rounds (bytes each rank sends per round) the link makes faster."""
    return "shard" if link.time(shard, world) <= link.time(gather, world) else "gather"


def entries_width(link: Link, world: int, rows: int, q_rows: int, instead: int, later: int, columns: int) -> float:
    """The most nonzero probabilities a rank may hold of a row for the walks to gather the rows' entries
    (:func:`.walks._entries`: an id and a probability for each of ``rows`` rows, a draft probability for each of
    ``q_rows``, 4 bytes each) and go on alone: where that round and the ``later`` rounds the walk then still takes
    cost no more than the ``instead`` rounds of the walk on the shards' columns (their few bytes not counted): ``W``
    with ``alpha (1 + later) + beta (world - 1) 4 (2 rows + q_rows) W <= alpha instead``; any width where the
    rows' whole ``columns`` (the widest shard's, 4 bytes a value, no ids) fit instead. 0 where none."""
    saved = instead - 1 - later
    if saved <= 0:
        return 0.0
    if columns_cheaper(link, world, rows + q_rows, columns, saved):
        return math.inf
    return saved * link.alpha / (link.beta * (world - 1) * 4 * (2 * rows + q_rows))


def columns_cheaper(link: Link, world: int, rows: int, columns: int, rounds: int) -> bool:
    """Whether ``rows`` rows of ``columns`` float32 values a rank, sent in a round taken anyway, cost no more than
    ``rounds`` rounds."""
    return link.beta * (world - 1) * 4 * rows * columns <= link.alpha * rounds


_HEAD = 16  # every round's (start, size)


def _b(n: int, itemsize: int) -> int:
    """Bytes of a part of ``n`` items, padded to 8."""
    return -(-n * itemsize // 8) * 8


def _rounds(*tasks: list[int]) -> list[int]:
    """Bytes per round of tasks run side by side (each a list of bytes per round)."""
    n = max((len(t) for t in tasks), default=0)
    return [_HEAD + sum(t[i] for t in tasks if i < len(t)) for i in range(n)]


def _describe(a: int, bins: int) -> int:
    return _b(a, 8) * 3 + _b(a * bins, 8) + 2 * _b(a * ENTRIES, 4)


def _draw(n: int) -> int:
    return _b(n, 8) + 2 * _b(n * WINDOW, 8) + _b(n * WINDOW, 4)


def _process(rp: RowParams, V: int, world: int, rows_reads: Tensor, min_candidates: int = 0) -> tuple[list[int], int]:
    """Bytes per round of :func:`.process.process` of rows with parameters ``rp`` (reads per row ``rows_reads``),
    and the rows drawn across the shards (neither greedy nor top-k). Read on the host."""
    greedy, bounded, nucleus, plain = (t.cpu() for t in _kinds(rp.temperature, rp.top_k, rp.top_p, V, True))
    tasks = []
    nb = int(bounded.sum())
    if nb:
        C = min(V, max(min_candidates, int(torch.where(greedy, 1, rp.top_k.cpu())[bounded].max())))
        tasks.append([_b(nb * C, 4) + _b(nb * C, 8)])
    nn, reads = int(nucleus.sum()), int(rows_reads[nucleus].sum())
    if nn:
        first = 2 * _b(nn, 8) + _b(nn, 1) + _b(nn * APPROX_BINS, 4) + _b(nn, 4)
        bins = most_sub_bins(V, world)  # the most a description sends
        tasks.append([first, 3 * _b(nn, 8) + 2 * _b(reads, 8) + _describe(nn, bins), _describe(nn, bins)])
    np_, reads = int(plain.sum()), int(rows_reads[plain].sum())
    if np_:
        tasks.append([_b(np_, 8) + _b(np_, 1), 2 * _b(np_, 8) + _b(reads, 4)])
    return [r - _HEAD for r in _rounds(*tasks)], nn + np_


def _held_width(rp: RowParams, V: int, world: int) -> int:
    """The candidates per row every rank holds after the processing where every row is a greedy or top-k row
    (:func:`.process.process`), else 0."""
    greedy, bounded, _, _ = (t.cpu() for t in _kinds(rp.temperature, rp.top_k, rp.top_p, V, True))
    if not bool((greedy | bounded).all()):
        return 0
    k = int(torch.where(greedy, 1, rp.top_k.cpu()).max())
    return min(k, world * min(V, k))


def _entries(rows: int, q_rows: int, V: int, world: int) -> int:
    """Bytes of :func:`.walks._entries`' round where a rank holds ``ceil(V / world)`` nonzero probabilities of each
    row (the most an even split gives it): the whole columns (:func:`.walks._columns`)."""
    per = -(-V // world)
    return _b(rows * per, 4) + _b(q_rows * per, 4)


def _cheaper(link: Link, world: int, *options: list[int]) -> list[int]:
    """The option (bytes per round) the link makes fastest: what the walks choose (:func:`entries_width`)."""
    return min(options, key=lambda rounds: link.time(rounds, world))


def _gather(V: int, world: int, *tensors: Tensor | None) -> list[int]:
    """One round of the tensors' rows, ``ceil(V / world)`` columns each."""
    per = -(-V // world)
    return [_HEAD + sum(_b(t.shape[:-1].numel() * per, t.element_size()) for t in tensors if t is not None)]


def sample_plan(rp: RowParams, greedy: bool, num_logprobs: int, logits: Tensor, mask: Tensor | None,
                shard: VocabShard) -> tuple[list[int], list[int]]:
    """Bytes per round per rank of :func:`.ops.sample_from_logits`: ``(shard, gather)``."""
    V, world = shard.vocab_size, dist.get_world_size(shard.group)
    B = logits.shape[0]
    gather = _gather(V, world, logits, None if mask is None else mask.expand_as(logits))
    if greedy and num_logprobs <= 1:
        return [_b(B, 8)], gather
    rounds, dense = _process(rp, V, world, torch.zeros(B, dtype=torch.int64), num_logprobs)
    if dense:
        rounds.append(_draw(dense) + (_b(dense * num_logprobs, 4) + _b(dense * num_logprobs, 8)))
    return _rounds(rounds), gather


def chain_plan(method: str, greedy: bool, rp: RowParams, logits: Tensor, q: Tensor | None, mask: Tensor | None,
               shard: VocabShard, link: Link) -> tuple[list[int], list[int]]:
    """Bytes per round per rank of :func:`.ops.verify_chain_from_logits`: ``(shard, gather)``; a token verification
    counted with a rejection (its residual's round), its rows as wide as an even split makes them (the walk gathers
    their entries where ``link`` makes that cheaper than the residual's round and the draw)."""
    V, world = shard.vocab_size, dist.get_world_size(shard.group)
    B, K1, _ = logits.shape
    K = K1 - 1
    gather = _gather(V, world, logits, None if mask is None else mask.expand_as(logits), q)
    if greedy:
        return [_b(B * K1, 8)], gather
    reads = (torch.arange(K1) < K).long().repeat(B)
    rounds, dense = _process(rp, V, world, reads)
    rounds[0] += _b(B * K, 4) + _b(1, 1) if q is not None else 0  # the drafts' q, and whether any is bad
    C = _held_width(rp, V, world)
    if C and K and method in ("token", "block"):  # walks._held_chain: the residuals' draft rows at the candidates
        return _rounds(rounds + [_b(B * (K if method == "block" else 1) * C, 4)]), gather
    if method == "target_only":
        rounds += [_draw(dense)] if dense else []
    elif not K:
        rounds += [_draw(B)]
    else:
        residual = B * (K if method == "block" else 1)
        entries = _entries(B * K1 if method == "block" else B, residual, V, world)
        rounds += _cheaper(link, world, [_b(residual, 8), _draw(B)], [entries])
    return _rounds(rounds), gather


def tree_plan(method: str, sampling: str, greedy: bool, rp: RowParams, tree, logits: Tensor, q: Tensor | None,
              mask: Tensor | None, shard: VocabShard, link: Link) -> tuple[list[int], list[int]]:
    """Bytes per round per rank of :func:`.ops.verify_tree_from_logits`: ``(shard, gather)``; the rows as wide as
    an even split makes them (the walk gathers their entries where ``link`` makes that cheaper than its rounds)."""
    V, world = shard.vocab_size, dist.get_world_size(shard.group)
    B, N, _ = logits.shape
    gather = _gather(V, world, logits, None if mask is None else mask.expand_as(logits), q)
    if greedy:
        return [_b(B * N, 8)], gather
    depth = tree.depth.cpu()
    present = (depth >= 0).reshape(-1)
    rp = RowParams(*(f.cpu()[present] for f in (rp.temperature, rp.top_k, rp.top_p, rp.min_p)), rp.shared)
    children = _children(tree)
    if method == "target_only":
        rounds, dense = _process(rp, V, world, torch.zeros(int(present.sum()), dtype=torch.int64))
        return _rounds(rounds + ([_draw(dense)] if dense else [])), gather
    rounds, _ = _process(rp, V, world, (children > 0).long().reshape(-1)[present])
    kids = int((depth > 0).sum())
    rounds[0] += _b(kids, 4) + _b(1, 1)  # the children's q, and whether any is bad
    wo = sampling == "without_replacement"
    parents, widest, surest = int((children > 0).sum()), int(children.max()), fewest_rounds(rp, V)
    if wo:  # walks._SharedQ: the shared q's masses in the processing's surest rounds
        for i in range(min(widest - 1, surest)):
            rounds[i] += _b(parents, 8)
    C = _held_width(rp, V, world)
    if sampling == "iid" and C:  # walks._Compact: one round, then every rank alone
        return _rounds(rounds + ([_b(kids * C, 4)] if kids else [])), gather
    # without replacement, held: the shared q's masses not yet known, one a round (the most: a walk settled sooner
    # ends them sooner), or the shared q's rows whole beside the round that holds the rows (walks._SharedQ.gather)
    rest, per = (max(widest - 1 - surest, 0) if wo else 0), -(-V // world)
    whole = rest > 0 and columns_cheaper(link, world, parents, per, rest)
    # the bytes the shared q adds to the round that holds the rows, then its masses' rounds
    shared_q = [_b(parents * per, 4) if whole else 0] + [_b(parents, 8)] * (0 if whole else rest)
    if C:
        return _rounds(rounds + (([_b(parents * C, 4) + shared_q[0]] + shared_q[1:]) if parents else [])), gather
    walk = [2 * _b(a, 8) + (_b(a, 8) if wo else 0) + (2 + (method == "traversal" and wo)) * _b(a, 4)
            for a in _active_per_round(method, tree, children)] + [_draw(B)]
    if not parents:
        return _rounds(rounds + walk), gather
    # or walks._entries: every present row's entries, with each child's q (i.i.d.) or each parent's shared q there
    entries = [_entries(int(present.sum()), parents if wo else kids, V, world) + shared_q[0]] + shared_q[1:]
    return _rounds(rounds + _cheaper(link, world, walk, entries)), gather


def _children(tree) -> Tensor:
    """int64 ``[B, N]``: each node's number of children (read on the host)."""
    parents, depth = tree.parents.cpu(), tree.depth.cpu()
    return torch.zeros(parents.shape, dtype=torch.int64).scatter_add_(1, parents.clamp(min=0), (depth > 0).long())


def walk_rounds(method: str, tree) -> int:
    """The most residual rounds ``rrs`` or ``traversal`` take on the shards' columns (:func:`_active_per_round`)."""
    return len(_active_per_round(method, tree, _children(tree)))


def _active_per_round(method: str, tree, children: Tensor) -> list[int]:
    """How many nodes advance their residuals in each round after the processing: rrs, every node with at least
    ``k`` children in round ``k``; traversal, the node's ``k``-th deletion in round ``k`` plus the sibling ranks along
    its path (when it is pushed)."""
    has = children[children > 0]
    if method == "rrs":
        return [int((has >= k).sum()) for k in range(1, int(has.max()) + 1)] if has.numel() else []
    rank, depth, parents = tree.sibling_rank.cpu(), tree.depth.cpu(), tree.parents.cpu()
    path_rank = torch.where(depth > 0, rank, 0)
    for d in range(2, tree.max_depth + 1):
        path_rank = torch.where(depth == d, path_rank + path_rank.gather(1, parents.clamp(min=0)), path_rank)
    start = path_rank[children > 0]
    last = int((start + has).max()) if has.numel() else 0
    return [int(((start < t) & (t <= start + has)).sum()) for t in range(1, last + 1)]
