"""Rounds: every collective of the shard path is one ``all_gather`` that every step sending something in that round
shares (docs/design.md, "Vocab-parallel").

A step is a generator (a :data:`Task`): it yields the tensors this rank sends in a round and is sent back
:class:`Gathered`, every rank's copies of them. :func:`together` runs steps side by side (rows of different kinds, a
read of draft probabilities beside the row processing), so they share rounds; ``yield from`` runs them in turn;
:func:`run` drives a task, one ``all_gather`` of bytes per round whatever the dtypes sent. Every rank runs the same
steps on the same replicated decisions, so the ranks agree on the rounds and on the shapes sent; only the values
differ.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .shard import VocabShard

T = TypeVar("T")


@dataclass(frozen=True)
class Layout:
    """Which ids each rank holds, learnt with every round: ``starts``, ``sizes`` int64 ``[world]``; ``rank`` this
    rank's index in the group."""

    starts: Tensor
    sizes: Tensor
    rank: int

    def before(self, per_rank: Tensor) -> Tensor:
        """``[world, ...]``: for each rank, the sum of ``per_rank`` ``[world, ...]`` over the ranks holding lower ids
        (an exclusive scan in id order; ranks may hold their shards in any order)."""
        lower = (self.starts[None, :] < self.starts[:, None]).to(per_rank.dtype)  # [rank, other]
        return (lower.view(*lower.shape, *(1,) * (per_rank.dim() - 1)) * per_rank[None]).sum(1)

    def owner(self, ids: Tensor) -> Tensor:
        """int64 ``[...]``: the rank holding each global id."""
        inside = (ids[..., None] >= self.starts) & (ids[..., None] < self.starts + self.sizes)
        return inside.long().argmax(-1)

    @cached_property
    def widest(self) -> int:
        """The most ids a rank holds (read on the host once)."""
        return int(self.sizes.max())

    def whole(self, columns: Tensor) -> Tensor:
        """Every rank's columns ``[world, ..., >= its size]`` (the first ``size`` of each its own, the rest padding)
        as whole rows ``[..., V]``, in id order."""
        order, sizes = torch.argsort(self.starts).tolist(), self.sizes.tolist()  # read once: one sync
        return torch.cat([columns[r, ..., :sizes[r]] for r in order], -1)


@dataclass(frozen=True)
class Gathered:
    """What a round brought back: ``parts[i]`` ``[world, *shape_i]`` for the i-th tensor sent, and the layout."""

    parts: list[Tensor]
    layout: Layout


Task = Generator[list[Tensor], Gathered, T]


def exchange(shard: VocabShard, tensors: list[Tensor]) -> Gathered:
    """One ``all_gather`` of ``tensors`` (any dtypes and shapes, the same on every rank) as bytes, with the shard's
    ``(start, size)`` in front."""
    head = torch.tensor([shard.start, shard.size], dtype=torch.int64, device=_device(tensors))
    # contiguous_format: a one-element slice counts as contiguous whatever its stride, which a byte view refuses
    parts = [head] + [t.clone(memory_format=torch.contiguous_format) if t.stride() and t.stride()[-1] != 1 else
                      t.contiguous() for t in tensors]
    raw = [t.view(-1).view(torch.uint8) if t.numel() else t.new_zeros(0, dtype=torch.uint8) for t in parts]
    pad = [(-r.numel()) % 8 for r in raw]  # every part 8-byte aligned, so it can be viewed as its dtype again
    payload = torch.cat([torch.nn.functional.pad(r, (0, p)) for r, p in zip(raw, pad)])
    world = dist.get_world_size(shard.group)
    out = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(out, payload, group=shard.group)
    got = torch.stack(out)  # [world, bytes]
    at, unpacked = 0, []
    for t, r, p in zip(parts, raw, pad):
        n = r.numel()
        unpacked.append(got[:, at:at + n].contiguous().view(t.dtype).view(world, *t.shape))
        at += n + p
    head = unpacked.pop(0)
    return Gathered(unpacked, Layout(head[:, 0], head[:, 1], dist.get_rank(shard.group)))


def _device(tensors: list[Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def run(task: Task[T], shard: VocabShard, device: torch.device) -> T:
    """Drive ``task`` to its result, one :func:`exchange` per round (on ``device`` when it sends nothing)."""
    try:
        sent = next(task)
        while True:
            sent = task.send(exchange(shard, sent or [torch.zeros(0, device=device)]))
    except StopIteration as done:
        return done.value


def together(*tasks: Task[Any]) -> Task[tuple]:
    """Run ``tasks`` side by side: each round sends what every unfinished one sends. Returns their results."""
    results: list[Any] = [None] * len(tasks)
    live: dict[int, list[Tensor]] = {}
    for i, t in enumerate(tasks):
        try:
            live[i] = next(t)
        except StopIteration as done:
            results[i] = done.value
    while live:
        order = list(live)
        got = yield [x for i in order for x in live[i]]
        at = 0
        for i in order:
            n = len(live[i])
            reply = Gathered(got.parts[at:at + n], got.layout)
            at += n
            try:
                live[i] = tasks[i].send(reply)
            except StopIteration as done:
                results[i] = done.value
                del live[i]
    return tuple(results)
