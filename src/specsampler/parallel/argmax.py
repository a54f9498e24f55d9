"""The greedy choice over rows held in shards, in one ``all_reduce``: the greedy decisions of the parallel ops.

Each rank packs its shard's maximum and the global id where it occurs into one int64 key that orders as
the one-device greedy choice does (:func:`specsampler.sampling.greedy.greedy_ids`: NaN never chosen, -0.0
equal to 0.0, ties to the lowest id), so that a MAX reduction over ranks is the choice over the whole row,
whatever the split (a greedy row has mass where that maximum is finite).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..sampling.greedy import greedy_ids
from .shard import VocabShard

_LOW = 2**32  # the id's field; the value's order key sits above it
_FLIP = 0x7FFFFFFF  # the magnitude bits of a negative float32, flipped so that its int32 bits order as the float


def _order_key(v: Tensor) -> Tensor:
    """float32 (no NaN) -> int64 in float order, -0.0 as 0.0."""
    bits = (v + 0.0).view(torch.int32).long()  # x + 0.0 turns -0.0 into +0.0
    return torch.where(bits >= 0, bits, bits ^ _FLIP)


def _value(key32: Tensor) -> Tensor:
    """The float32 of an order key (the inverse of :func:`_order_key`)."""
    return torch.where(key32 >= 0, key32, key32 ^ _FLIP).to(torch.int32).view(torch.float32)


def argmax_keys(rows: Tensor, shard: VocabShard) -> Tensor:
    """int64 ``[...]``: this shard's greedy choice of each row as a key whose MAX over the ranks is the choice
    over the whole row (:func:`decode`). rows: float ``[..., shard.size]``, masked tokens at -inf."""
    if shard.size == 0:
        return torch.full(rows.shape[:-1], torch.iinfo(torch.int64).min, dtype=torch.int64, device=rows.device)
    local = greedy_ids(rows).unsqueeze(-1)  # in the rows' own dtype: no float32 copy of the shard
    top = rows.gather(-1, local)[..., 0].float()
    top = torch.where(torch.isnan(top), float("-inf"), top)  # a row of NaN only
    return _order_key(top) * _LOW + (_LOW - 1 - (shard.start + local[..., 0]))


def decode(key: Tensor) -> tuple[Tensor, Tensor]:
    """The global ids int64 and the maxima float32 (NaN aside) of reduced :func:`argmax_keys`."""
    return _LOW - 1 - (key & (_LOW - 1)), _value(key >> 32)


def shard_argmax(rows: Tensor, shard: VocabShard) -> tuple[Tensor, Tensor]:
    """The greedy choice over the whole vocabulary of rows held as shards.

    rows: float ``[..., shard.size]`` (this rank's logits, masked tokens at -inf), the same leading shape on every
    rank. Returns ``(ids, mass)``: int64 ``[...]`` global ids, those :func:`greedy_ids` gives on the whole rows,
    and bool ``[...]``: the row has mass (its maximum, NaN aside, is finite). One ``all_reduce`` of int64 ``[...]``.
    """
    key = argmax_keys(rows, shard).contiguous()
    dist.all_reduce(key, op=dist.ReduceOp.MAX, group=shard.group)
    ids, top = decode(key)
    return ids, torch.isfinite(top)
