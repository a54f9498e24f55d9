"""The row operations of :class:`specsampler.sampling.vocab.Vocab` on vocabulary shards: :class:`ShardVocab`.

Each is exact whatever the split: a row's mass is the sum of the shards' masses (exact integers, one
``all_reduce``); a value at a global id is its owner's (one ``all_reduce`` of ``R`` floats, zeros elsewhere); a
draw inverts ``floor(u * Z)`` over the prefix sums of the masses, each rank learning the masses before it from
one ``all_gather`` of ``R`` totals, the owner of the draw sending its id (one ``all_reduce``). So the
verification walks, run with a ``ShardVocab``, take every decision the one-device walk takes, identically on
every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..sampling.masses import draw_target, invert, masses, row_mass
from ..sampling.vocab import Vocab
from .shard import VocabShard


class ShardVocab(Vocab):
    """Rows ``[..., shard.size]`` holding global ids ``[shard.start, shard.end)`` of the vocabulary."""

    def __init__(self, shard: VocabShard):
        super().__init__(shard.vocab_size)
        self.shard = shard

    @property
    def width(self) -> int:
        return self.shard.size

    def all_reduce(self, t: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        t = t.contiguous()
        dist.all_reduce(t, op=op, group=self.shard.group)
        return t

    def all_gather(self, t: Tensor) -> Tensor:
        """``[world, *t.shape]``: every rank's ``t`` in rank order."""
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.shard.group))]
        dist.all_gather(parts, t.contiguous(), group=self.shard.group)
        return torch.stack(parts)

    def mass(self, w: Tensor, keepdim: bool = False) -> Tensor:
        return self.all_reduce(row_mass(w, keepdim))

    def has_mass(self, w: Tensor, keepdim: bool = False) -> Tensor:
        return self.mass(w, keepdim) > 0  # the shards' masses summed: a shard alone does not know

    def _local(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Whether this rank holds each global id, and its column (0 where not)."""
        col = ids - self.shard.start
        owned = (col >= 0) & (col < self.shard.size)
        return owned, torch.where(owned, col, 0)

    def value(self, w: Tensor, ids: Tensor) -> Tensor:
        owned, col = self._local(ids)
        local = w.gather(1, col[:, None])[:, 0] if self.shard.size else w.new_zeros(ids.shape)
        return self.all_reduce(torch.where(owned, local, 0.0))

    def zero_at(self, w: Tensor, ids: Tensor) -> Tensor:
        owned, col = self._local(ids)
        if not self.shard.size:
            return w.clone()
        return w.scatter(1, col[:, None], torch.where(owned[:, None], 0.0, w.gather(1, col[:, None])))

    def draw(self, w: Tensor, u: Tensor, fallback: Tensor | None = None) -> Tensor:
        """As :meth:`Vocab.draw`; a row without mass draws ``fallback`` int64 ``[R]`` (default 0)."""
        R = w.shape[0]
        cum = masses(w).cumsum(-1) if self.shard.size else w.new_zeros(R, 0, dtype=torch.float64)
        own = cum[:, -1] if self.shard.size else torch.zeros(R, dtype=torch.float64, device=w.device)
        totals = self.all_gather(own)  # [world, R]
        rank = dist.get_rank(self.shard.group)
        before = totals[:rank].sum(0)
        total = totals.sum(0)
        t = draw_target(u, total) - before  # the draw's mass within this shard
        mine = (t >= 0) & (t < own)
        idx = invert(cum, t.clamp(min=0)) if self.shard.size else torch.zeros_like(t, dtype=torch.int64)
        token = self.all_reduce(torch.where(mine, self.shard.start + idx, -1), dist.ReduceOp.MAX)
        return torch.where(token >= 0, token, 0 if fallback is None else fallback)
