"""Greedy choice: the argmax of a row, the same rule on every back end and on vocabulary shards."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def nan_as_minus_inf(x: Tensor) -> Tensor:
    """``x`` with NaN read as -inf (and infinities kept): what the greedy choice compares."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def greedy_ids(x: Tensor) -> Tensor:
    """int64 ``[...]``: the argmax of ``x`` (float ``[..., V]``) over its last dimension, ties to the lowest id;
    NaN is never chosen (read as -inf, as the kernels compare), so a row of NaN gives 0."""
    if x.device.type != "cpu":  # no host sync on a device: compare NaN as -inf in the one pass
        return nan_as_minus_inf(x).argmax(-1)
    ids = _argmax_on_cpu(x)  # one pass; the argmax stops at a NaN, which only rows holding one redo
    nan = torch.isnan(x.gather(-1, ids.unsqueeze(-1))).squeeze(-1)
    if bool(nan.any()):
        ids = torch.where(nan, _argmax_on_cpu(nan_as_minus_inf(x)), ids)
    return ids


def _argmax_on_cpu(x: Tensor) -> Tensor:
    """``x.argmax(-1)`` (the first of the largest; a NaN, the first one, is the largest) of float ``[..., V]``
    on CPU, through NumPy: its argmax is vectorised, ATen's is not (3-8x slower over rows of 128256). Half-precision
    rows are widened first (exact, and the order kept)."""
    a = (x if x.dtype in (torch.float32, torch.float64) else x.float()).detach().numpy()
    return torch.from_numpy(np.asarray(np.argmax(a, -1), dtype=np.int64))
