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

import zlib
from collections.abc import Generator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..lazy import cached_property
from ..params import SamplingParams
from ..rng import Philox
from ..validation import fail
from ..verify import TokenTree
from .shard import VocabShard

T = TypeVar("T")
_FIELD = 2**32  # the header packs two values below 2**31 in each int64


@dataclass(frozen=True)
class Layout:
    """Which ids each rank holds, learnt with every round: ``starts``, ``sizes`` int64 ``[world]``; ``rank`` this
    rank's index in the group; ``vocab_sizes`` and ``digests`` int64 ``[world]``: each rank's vocabulary size and
    the fingerprint of its call's arguments (:func:`digest`; 0 past the first round)."""

    starts: Tensor
    sizes: Tensor
    rank: int
    vocab_sizes: Tensor
    digests: Tensor

    def check(self, op: str) -> None:
        """Raise the same error on every rank (every rank holds the same layout) unless the ranks hold one
        vocabulary, their shards tile it once, and they passed the same arguments. One read on the host."""
        starts, sizes, vocab, digests = (t.tolist() for t in (self.starts, self.sizes, self.vocab_sizes,
                                                              self.digests))
        held = sorted((s, n) for s, n in zip(starts, sizes) if n)
        ends = [s + n for s, n in held]
        if len(set(vocab)) > 1 or [s for s, _ in held] != [0] + ends[:-1] or (ends[-1] if ends else 0) != vocab[0]:
            fail(op, "shard", "shards that tile [0, vocab_size) once, with one vocab_size on every rank",
                 "(start, size, vocab_size) by rank " + ", ".join(map(str, zip(starts, sizes, vocab))))
        if len(set(digests)) > 1:
            fail(op, "arguments", "the same arguments on every rank but its shard's columns (shapes, draft tokens, "
                 "tree, params, rng, method, strategy, link)",
                 f"ranks {[r for r, d in enumerate(digests) if d != digests[0]]} differing from rank 0")

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


def exchange(shard: VocabShard, tensors: list[Tensor], fingerprint: Tensor | None = None) -> Gathered:
    """One ``all_gather`` of ``tensors`` (any dtypes and shapes, the same on every rank) as bytes, with the shard's
    ``(start, size)`` and ``(vocab_size, fingerprint)`` (a :func:`digest`, or 0) in front: two int64, each pair
    packed in one (vocabularies below 2**31)."""
    head = torch.tensor([shard.start * _FIELD + shard.size, shard.vocab_size * _FIELD], dtype=torch.int64,
                        device=_device(tensors))
    if fingerprint is not None:
        head[1:] += fingerprint.to(head.device)
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
    return Gathered(unpacked, Layout(head[:, 0] >> 32, head[:, 0] & (_FIELD - 1), dist.get_rank(shard.group),
                                     head[:, 1] >> 32, head[:, 1] & (_FIELD - 1)))


def _device(tensors: list[Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def run(task: Task[T], shard: VocabShard, device: torch.device, op: str, fingerprint: Tensor) -> T:
    """Drive ``task`` to its result, one :func:`exchange` per round (on ``device`` when it sends nothing); the first
    round carries the call's ``fingerprint`` (:func:`digest`) and is checked (:meth:`Layout.check`) before the task
    reads it."""
    try:
        sent = next(task)
        got = exchange(shard, sent or [torch.zeros(0, device=device)], fingerprint)
        got.layout.check(op)
        while True:
            sent = task.send(got)
            got = exchange(shard, sent or [torch.zeros(0, device=device)])
    except StopIteration as done:
        return done.value


def digest(device: torch.device, *args) -> Tensor:
    """int64 0-d on ``device``, in ``[0, 2**32)``: a fingerprint of a call's arguments that every rank passes alike:
    Python values by their ``repr``, tensors (and those of a :class:`SamplingParams`, :class:`Philox` or
    :class:`TokenTree`) by their dtypes, shapes and ``sum_i v_i * (i + 1)`` of their values as int64 (floats by
    their bits; the arithmetic wraps alike on every rank), computed on the device: no host sync."""
    host, values = [], []
    for a in args:
        for v in _fields(a):
            if isinstance(v, Tensor):
                host.append((v.dtype, tuple(v.shape)))
                v = v.to(device).reshape(-1)
                values.append(v.float().view(torch.int32).long() if v.is_floating_point() else v.long())
            else:
                host.append(v)
    total = torch.full((), zlib.crc32(repr(host).encode()), dtype=torch.int64, device=device)
    if values:
        v = torch.cat(values)
        total = total + (v * torch.arange(1, v.numel() + 1, device=device)).sum()
    return total & (_FIELD - 1)


def _fields(a) -> list:
    """The values of an argument that every rank passes alike."""
    if isinstance(a, (SamplingParams, Philox)):
        return [type(a).__name__, *(getattr(a, f.name) for f in fields(a))]
    if isinstance(a, TokenTree):
        return ["TokenTree", a.parents]
    return [a]


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
