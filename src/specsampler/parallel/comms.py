"""What the parallel ops send: :func:`count_collectives`, a counter of ``torch.distributed`` calls.

The ops call collectives as ``torch.distributed.<name>(...)``; inside the context manager each call is
recorded (name, bytes this rank contributes) before it runs, so tests and benchmarks can assert rounds
and bytes per op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# the collectives the ops use; each takes the tensor it sends as its first or second argument
COUNTED = ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast", "reduce_scatter_tensor")


@dataclass
class CollectiveLog:
    """The collectives called in a :func:`count_collectives` block: ``calls`` ``[(name, bytes)]``, bytes
    being what this rank sends (the input tensor's size)."""

    calls: list[tuple[str, int]] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.calls)

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.calls)


def _sent(name: str, args: tuple, kwargs: dict) -> int:
    t = args[1] if name in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor") else args[0]
    t = kwargs.get("input_tensor", kwargs.get("tensor", t))
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


@contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """``with count_collectives() as log: ...``: ``log.rounds``, ``log.bytes``, ``log.calls`` afterwards."""
    log = CollectiveLog()
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name, fn):
        def call(*args, **kwargs):
            log.calls.append((name, _sent(name, args, kwargs)))
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
