"""Greedy choice: the argmax of a row, the same rule on every back end and on vocabulary shards."""

from __future__ import annotations

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
    ids = x.argmax(-1)  # one pass; torch.argmax stops at a NaN, which only rows holding one redo
    nan = torch.isnan(x.gather(-1, ids.unsqueeze(-1))).squeeze(-1)
    if bool(nan.any()):
        ids = torch.where(nan, nan_as_minus_inf(x).argmax(-1), ids)
    return ids
