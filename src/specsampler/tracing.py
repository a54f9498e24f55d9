"""The PyTorch path under ``torch.compile``: run eagerly, outside the graph.

Its tokens rest on how each step rounds (ATen's own elementwise loops, exact masses summed in float64, a few steps
in NumPy on the CPU) and on host reads that decide which rows take which steps. A compiled graph would round its
fused loops its own way and cannot hold NumPy's in-place views (inductor failed on them, and so did dynamo's guards
under ``inference_mode``). So a call that takes the PyTorch path breaks the graph and runs as in eager mode: the
same tokens under any back end. Calls that take a kernel (custom ops that allocate from shapes) trace whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_when_traced(kernel: Callable[..., bool] | None = None) -> Callable[[F], F]:
    """Decorate a public op: while ``torch.compile`` traces a call for which ``kernel(*args, **kwargs)`` is false
    (None: always; the op has no kernel), the op runs outside the graph (a graph break), as in eager mode. Outside
    tracing the op is called directly."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def op(*args, **kwargs):
            if torch.compiler.is_compiling() and (kernel is None or not kernel(*args, **kwargs)):
                # made here, not at import: importing dynamo takes seconds, and it is loaded once something traces
                return torch.compiler.disable(fn)(*args, **kwargs)
            return fn(*args, **kwargs)

        return op  # type: ignore[return-value]

    return wrap
