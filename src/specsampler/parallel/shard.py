"""Which part of the vocabulary a rank holds: :class:`VocabShard`."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from ..validation import fail


@dataclass(frozen=True)
class VocabShard:
    """Rank's slice ``[start, start + size)`` of a vocabulary of ``vocab_size`` global ids, in process
    group ``group`` (None: the default group). The shards of a group tile ``[0, vocab_size)``; a rank may
    hold none (``size == 0``) when the group is larger than the vocabulary."""

    start: int
    size: int
    vocab_size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        op = "VocabShard"
        for name in ("start", "size", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                fail(op, name, "an int", repr(v))
        if not 1 <= self.vocab_size < 2**31:
            fail(op, "vocab_size", "an int in [1, 2**31)", self.vocab_size)
        if not 0 <= self.start <= self.vocab_size:
            fail(op, "start", f"an int in [0, vocab_size = {self.vocab_size}]", self.start)
        if not 0 <= self.size <= self.vocab_size - self.start:
            fail(op, "size", f"an int in [0, vocab_size - start = {self.vocab_size - self.start}]", self.size)

    @classmethod
    def even(cls, vocab_size: int, group: dist.ProcessGroup | None = None) -> VocabShard:
        """``ceil(vocab_size / world)`` ids per rank in rank order, the last ranks fewer (Megatron's split)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        per = -(-vocab_size // world)
        start = min(rank * per, vocab_size)
        return cls(start, min(per, vocab_size - start), vocab_size, group)

    @property
    def end(self) -> int:
        return self.start + self.size

    def check_rows(self, op: str, name: str, t: Tensor) -> None:
        """``t``'s last dimension is this shard's size."""
        if t.shape[-1] != self.size:
            fail(op, name, f"a last dimension of shard.size = {self.size} (global ids [{self.start}, {self.end}))",
                 f"shape {list(t.shape)}")
