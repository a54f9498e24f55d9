"""Small tensors made from host numbers, made once per process: per-row parameters given as scalars, a chain's
default draft count, the draw index of each row.

On a GPU an op at a small batch is bound by its launches, and each ``torch.full`` or ``arange`` is one (about
1-1.5 us, and a node of a CUDA graph): 16 of a chain verify's 19 launches at B = 1 on an H100, 2026-11-27
(``benchmarks/results/gpu-nvidia-h100-2026-11-27``). These tensors depend only on (value, length, dtype, device)
and are only read, so they are kept and shared by every call. They are never evicted: a CUDA graph that captured
one reads its memory at every replay and does not keep it alive; past ``LIMIT`` tensors, new ones are made per
call instead. None is made for keeping while a CUDA graph is being captured (the graph's pool would own it and
fill it only at replay) or while torch.compile traces (which traces the plain ops); one made for keeping is waited
for once, so that a call on another stream never reads it before it is filled.
"""

from __future__ import annotations

import torch
from torch import Tensor

LIMIT = 4096
_KEPT: dict[tuple, Tensor] = {}


def _kept(key, make) -> Tensor:
    """The tensor ``make()`` gives, kept under ``key()`` (a tuple; a function, as sizes may be symbolic while
    torch.compile traces, where nothing is kept and a key could not be formed)."""
    if torch.compiler.is_compiling():
        return make()
    key = key()
    t = _KEPT.get(key)
    if t is not None:
        return t
    device = key[-1]
    if len(_KEPT) >= LIMIT or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return make()
    with torch.inference_mode(False):  # a tensor usable outside inference mode too
        t = make()
    if device.type == "cuda":  # filled before any stream reads it (once per kept tensor)
        torch.cuda.current_stream(device).synchronize()
    _KEPT[key] = t
    return t


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the same tensors whatever device is current later
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def full(n: int, value: float | int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``torch.full((n,), value, dtype=dtype, device=device)``, shared: never write to it."""
    device = _device(device)
    # repr tells -0.0 from 0.0 (equal as keys) and 1 from 1.0
    return _kept(lambda: ("full", n, repr(value), dtype, device),
                 lambda: torch.full((n,), value, dtype=dtype, device=device))


def index_in_request(batch: int, count: int, device: torch.device | str) -> Tensor:
    """int64 ``[batch * count]``: ``0 .. count-1`` for each of ``batch`` requests (request-major), shared."""
    device = _device(device)
    return _kept(lambda: ("index", batch, count, device),
                 lambda: torch.arange(count, device=device).repeat(batch))


def plan_counters(plan: tuple[tuple[int, int], ...], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """An op's planned draws (``(stream, count)`` pairs, :func:`specsampler.rng.planned`) laid side by side: each
    draw's index within its stream and its stream, int64 ``[sum of counts]`` each, shared."""
    device = _device(device)
    index = _kept(lambda: ("plan index", plan, device), lambda: torch.cat(
        [torch.arange(count, dtype=torch.int64) for _, count in plan]).to(device))
    streams = _kept(lambda: ("plan streams", plan, device), lambda: torch.cat(
        [torch.full((count,), s, dtype=torch.int64) for s, count in plan]).to(device))
    return index, streams
