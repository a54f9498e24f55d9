"""The specialisations Triton's JIT would compile the kernels under, recorded while they run in the interpreter.

Triton compiles a kernel once per specialisation key: its constexprs, the dtypes of its tensors, and what it
learns from the other arguments (an integer's divisibility by 16 or value 1, a pointer's 16-byte alignment) unless
a kernel opts out (``do_not_specialize``). :func:`recorded_specialisations` computes, for every kernel launch that
the interpreter runs, the key the JIT would use for a CUDA target (sm_90) with the kernel's own options, from the
JIT's own argument binder: no GPU and no compiling needed, so a test can replay hundreds of public calls and count
the distinct keys per kernel.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from specsampler.kernels.warmup import TargetDriver

_JIT_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment", "noinline")


def specialisation_key(fn: InterpretedFunction, args: tuple, kwargs: dict, arch: int = 90) -> str:
    """The key under which ``triton.jit`` would compile ``fn`` (an interpreted kernel) for these arguments."""
    twin = JITFunction(fn.fn, **{k: v for k, v in fn.kwargs.items() if k in _JIT_OPTIONS})
    saved = driver._active  # without a GPU there is no default driver to reset to
    driver.set_active(TargetDriver(arch))
    try:
        binder = twin.device_caches[0][-1]
        _, specialisation, options = binder(*args, **kwargs)
    finally:
        driver._active = saved
    return repr((specialisation, options))


@contextlib.contextmanager
def recorded_specialisations(arch: int = 90, execute: bool = True):
    """While active, every interpreted kernel launch records its JIT specialisation key: yields a dict kernel
    name -> set of keys. With ``execute`` the launches also run in the interpreter; without, they only record,
    and ``torch.empty`` gives zeros meanwhile, so that what the ops do with their kernels' outputs (gathers by
    the returned paths, say) sees valid values: a trace of large batches then costs no kernel time. (No launcher
    reads a value back to decide anything, so the keys are those of a real run.)"""
    keys: dict[str, set[str]] = collections.defaultdict(set)
    run, empty = InterpretedFunction.run, torch.empty

    def recording_run(self, *args, grid, warmup, **kwargs):
        keys[self.fn.__name__].add(specialisation_key(self, args, kwargs, arch))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None

    InterpretedFunction.run = recording_run
    if not execute:
        torch.empty = torch.zeros
    try:
        yield keys
    finally:
        InterpretedFunction.run, torch.empty = run, empty
