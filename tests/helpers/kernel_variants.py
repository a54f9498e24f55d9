"""pytest plugin: count the distinct kernel specialisations that tests launch in the Triton interpreter.

A GPU run compiles each specialisation once (seconds to a minute or more each), so this number decides
how long a first GPU run of the kernel tests takes (``benchmarks/gpu_session.sh check``). Usage, from
``tests/``: ``TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest -p kernel_variants test_kernels_*.py``;
prints the count per kernel at the end. The key approximates Triton's: the kernel, its constexpr
arguments, the dtypes of its tensors and, for integers, whether they are 1 or divisible by 16 (pointer
alignment is not modelled).
"""

from __future__ import annotations

import collections

import torch
from triton.runtime.interpreter import InterpretedFunction

SEEN: set[tuple] = set()
_run = InterpretedFunction.run


def _spec(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype))
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("float",)
    return ("other", repr(value))


def _recording_run(self, *args, grid, warmup, **kwargs):
    key = (self.fn.__name__, *(_spec(a) for a in args), *((k, repr(v)) for k, v in sorted(kwargs.items())))
    SEEN.add(key)
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


InterpretedFunction.run = _recording_run


def pytest_terminal_summary(terminalreporter):
    per_kernel = collections.Counter(key[0] for key in SEEN)
    terminalreporter.write_line(f"kernel specialisations launched: {len(SEEN)} ({dict(per_kernel.most_common())})")
