"""Large temporaries reused across calls, one set per thread (fresh allocations of this size cost more
in page faults than the passes that fill them)."""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor


class _Scratch(threading.local):
    """Large temporaries reused across calls, one set per thread (fresh allocations of this
    size cost more in page faults than the passes that fill them). Never part of a result."""

    def __init__(self):
        self.buffers: dict = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):  # written by later calls, in inference mode or not
                buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


SCRATCH = _Scratch()
