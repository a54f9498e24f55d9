"""The ``gather`` strategy's collective: the whole rows of tensors held as vocabulary shards, on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .rounds import exchange
from .shard import VocabShard


def whole_rows(shard: VocabShard, tensors: list[Tensor], op: str, fingerprint: Tensor) -> list[Tensor]:
    """Each of ``tensors`` (``[..., shard.size]``, any dtype, the same shapes on every rank) as its whole rows
    ``[..., V]`` (global ids), on every rank: one round when no shard holds more than ``ceil(V / world)`` ids (as
    :meth:`VocabShard.even` splits), the columns past that in a second round otherwise. The first round carries
    the call's ``fingerprint`` and is checked as :func:`.rounds.run` checks it."""
    per = -(-shard.vocab_size // dist.get_world_size(shard.group))
    got = exchange(shard, [_columns(t, 0, per) for t in tensors], fingerprint)
    got.layout.check(op)
    parts = [[p] for p in got.parts]
    if got.layout.widest > per:  # an uneven split: the rest of the longer shards
        extra = exchange(shard, [_columns(t, per, got.layout.widest - per) for t in tensors])
        for p, e in zip(parts, extra.parts):
            p.append(e)
    return [got.layout.whole(torch.cat(p, -1)) for p in parts]  # each [world, ..., columns sent]


def _columns(t: Tensor, start: int, n: int) -> Tensor:
    """Columns ``[start, start + n)`` of ``t``, padded with zeros past its last."""
    part = t[..., start:start + n]
    return torch.nn.functional.pad(part, (0, n - part.shape[-1]))
