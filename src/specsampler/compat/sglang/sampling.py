"""``sgl_kernel.sampling`` on specsampler: top-k / top-p / min-p filters and the draws after them.

Each function has sgl_kernel's name, signature, defaults and outputs (float32 probabilities, int32 tokens);
the filters are :func:`specsampler.top_k_renorm`, :func:`~specsampler.top_p_renorm` and
:func:`~specsampler.min_p_renorm`, the draw is :func:`specsampler.sample` (the Triton kernels on CUDA
tensors). Where it differs (generators, top-k ties, ``indices``, ranges): docs/design.md, "Drop-in
compatibility per peer", ``compat.sglang``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import Philox, min_p_renorm, sample, top_k_renorm, top_p_renorm
from ...rng import STREAM_SAMPLE, uniform
from ...validation import check_tensor, fail

Generator = torch.Generator | Philox | None

__all__ = [
    "min_p_sampling_from_probs",
    "top_k_renorm_prob",
    "top_k_renorm_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_prob",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]


def _param(value: int | float | Tensor, dtype: torch.dtype, device: torch.device) -> int | float | Tensor:
    """A scalar as given; a tensor in the dtype specsampler takes (sgl_kernel casts with ``.int()`` / ``.float()``)."""
    return value.to(device=device, dtype=dtype) if isinstance(value, Tensor) else value


def _check_nan(probs: Tensor, check_nan: bool) -> None:
    if check_nan and bool(torch.isnan(probs).any()):
        raise ValueError("Input probs contains NaN.")


def first_above(cdf: Tensor, rows: Tensor, target: Tensor) -> Tensor:
    """For each i, the first id j with ``cdf[rows[i], j] > target[i]`` (V - 1 where there is none).

    cdf: float32 ``[R, V]``, non-decreasing along V; rows: int64 ``[M]``; target: float32 ``[M]``.
    A binary search on the shared rows: memory ``O(M)``, never ``[M, V]``. Returns int64 ``[M]``.
    """
    V = cdf.shape[-1]
    flat, base = cdf.reshape(-1), rows * V
    lo = torch.zeros_like(rows)
    hi = torch.full_like(rows, V - 1)
    for _ in range(V.bit_length()):
        mid = (lo + hi) // 2
        right = flat[base + mid] <= target
        lo, hi = torch.where(right, mid + 1, lo), torch.where(right, hi, mid)
    return lo.clamp(max=V - 1)


def draw_with_coins(weights: Tensor, coins: Tensor, exhausted: Tensor | None = None) -> Tensor:
    """The FlashInfer-style draw the speculative kernels end with, on the caller's coins.

    weights: float32 ``[R, V]`` (>= 0); coins: float ``[R]`` in [0, 1). Returns int64 ``[R]``: the
    first id whose inclusive cumulative weight exceeds ``coin * sum(weights)``. Where none does
    (rounding, or no mass): with ``exhausted`` (int64 ``[R]``, sgl_kernel), the last id of positive weight, else
    ``exhausted``; without (tokenspeed), ``V - 1``.
    """
    R, V = weights.shape
    target = coins.float() * weights.sum(-1)
    cdf = weights.cumsum(-1)
    rows = torch.arange(R, device=weights.device)
    j = first_above(cdf, rows, target)
    found = cdf[rows, j] > target
    if exhausted is None:
        return torch.where(found, j, V - 1)
    last = torch.where(weights > 0, torch.arange(V, device=weights.device), -1).amax(-1)
    return torch.where(found, j, torch.where(last >= 0, last, exhausted))


def _row_indices(op: str, indices: Tensor, rows_of: Tensor) -> Tensor:
    """``indices`` as int64 row numbers of ``rows_of`` (``[R, V]``): checked on CPU tensors (a ValueError); on a
    GPU, where a check would synchronise, clamped into ``[0, R)`` so that no read leaves the tensor."""
    check_tensor(op, "indices", indices, kind="int", ndim=1)
    rows = indices.to(device=rows_of.device, dtype=torch.int64)
    R = rows_of.shape[0]
    if rows.device.type != "cpu":
        return rows.clamp(0, max(R - 1, 0))
    if rows.numel() and bool(((rows < 0) | (rows >= R)).any()):
        fail(op, "indices", f"row indices in [0, {R})", rows.tolist())
    return rows


def _draw(op: str, weights: Tensor, indices: Tensor | None, generator: Generator) -> Tensor:
    """One token per output: from row i of ``weights``, or from row ``indices[i]``. int32 ``[M]``."""
    if indices is None:
        return sample(weights, rng=generator).to(torch.int32)
    rows = _row_indices(op, indices, weights)
    u = uniform(generator, op, rows.numel(), 1, STREAM_SAMPLE, weights.device)[:, 0]
    cdf = weights.float().cumsum(-1)
    return first_above(cdf, rows, u * cdf[rows, -1]).to(torch.int32)


@torch.no_grad()
def top_k_renorm_probs(probs: Tensor, top_k: Tensor | int) -> Tensor:
    """Keep the ``top_k`` most likely tokens of each row, and every token tied with the k-th, and renormalise.

    probs: float ``[B, V]``; top_k: int or integer tensor ``[B]`` (``<= 0`` or ``>= V``: all kept).
    Returns float32 ``[B, V]``. :func:`specsampler.top_k_renorm` keeps exactly k (ties to the lower
    id); sgl_kernel's pivot keeps every token ``>=`` the k-th probability, which its tests pin, so the
    tokens tied with the last one kept join it here.
    """
    p = probs.float()
    kept = top_k_renorm(p, _param(top_k, torch.int64, probs.device)) > 0
    pivot = torch.where(kept, p, float("inf")).amin(-1, keepdim=True)
    w = torch.where(p >= pivot, p, 0.0)
    total = w.sum(-1, keepdim=True)
    return torch.where(total > 0, w / total, w)


top_k_renorm_prob = top_k_renorm_probs


@torch.no_grad()
def top_p_renorm_probs(probs: Tensor, top_p: Tensor | float) -> Tensor:
    """Keep the smallest most-likely set of mass ``>= top_p`` and renormalise (:func:`specsampler.top_p_renorm`).

    probs: float ``[B, V]``; top_p: float in (0, 1] or float tensor ``[B]``. Returns float32 ``[B, V]``.
    """
    return top_p_renorm(probs, _param(top_p, torch.float32, probs.device))


top_p_renorm_prob = top_p_renorm_probs


@torch.no_grad()
def top_p_sampling_from_probs(
    probs: Tensor,
    top_p: Tensor | float,
    indices: Tensor | None = None,
    deterministic: bool = True,
    generator: Generator = None,
    check_nan: bool = False,
) -> Tensor:
    """Top-p (nucleus) sampling: :func:`specsampler.top_p_renorm`, then :func:`specsampler.sample`.

    probs: float ``[B, V]`` (``[R, V]`` with ``indices``); top_p: float or float tensor ``[B]`` (per
    row of ``probs``); indices: optional integer ``[M]``, output i drawn from ``probs[indices[i]]``.
    Returns int32 ``[B]`` (``[M]``). ``check_nan``: ValueError "Input probs contains NaN.".
    """
    _check_nan(probs, check_nan)
    kept = top_p_renorm_probs(probs, top_p)
    return _draw("sglang.top_p_sampling_from_probs", kept, indices, generator)


@torch.no_grad()
def top_k_top_p_sampling_from_probs(
    probs: Tensor,
    top_k: Tensor | int,
    top_p: Tensor | float,
    indices: Tensor | None = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: Generator = None,
    check_nan: bool = False,
) -> Tensor:
    """Top-k and top-p sampling from probabilities.

    ``filter_apply_order="top_k_first"``: top-p on the top-k-renormalised distribution (as
    :func:`specsampler.logits_to_probs`); ``"joint"``: the tokens both filters keep on the original
    distribution. Then :func:`specsampler.sample`.

    probs: float ``[B, V]`` (``[R, V]`` with ``indices``); top_k: int or integer tensor ``[B]``;
    top_p: float or float tensor ``[B]``; indices: optional integer ``[M]``. Returns int32 ``[B]``
    (``[M]``). Another order: ValueError "Invalid filter_apply_order: ...".
    """
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ValueError(f"Invalid filter_apply_order: {filter_apply_order}")
    _check_nan(probs, check_nan)
    if filter_apply_order == "top_k_first":
        kept = top_p_renorm_probs(top_k_renorm_probs(probs, top_k), top_p)
    else:
        both = (top_k_renorm_probs(probs, top_k) > 0) & (top_p_renorm_probs(probs, top_p) > 0)
        kept = probs.float() * both
    return _draw("sglang.top_k_top_p_sampling_from_probs", kept, indices, generator)


@torch.no_grad()
def min_p_sampling_from_probs(
    probs: Tensor,
    min_p: Tensor | float,
    indices: Tensor | None = None,
    deterministic: bool = True,
    generator: Generator = None,
    check_nan: bool = False,
) -> Tensor:
    """Min-p sampling: :func:`specsampler.min_p_renorm` (keep ``p >= min_p * max p``), then :func:`specsampler.sample`.

    probs: float ``[B, V]`` (``[R, V]`` with ``indices``); min_p: float in [0, 1] or float tensor
    ``[B]`` (one per output, as sgl_kernel reads it); indices: optional integer ``[M]``. Returns int32.
    """
    _check_nan(probs, check_nan)
    if indices is not None and isinstance(min_p, Tensor):
        probs, indices = probs.index_select(0, _row_indices("sglang.min_p_sampling_from_probs", indices, probs)), None
    kept = min_p_renorm(probs, _param(min_p, torch.float32, probs.device))
    return _draw("sglang.min_p_sampling_from_probs", kept, indices, generator)


@torch.no_grad()
def top_k_top_p_sampling_from_logits(
    logits: Tensor,
    top_k: Tensor | int,
    top_p: Tensor | float,
    indices: Tensor | None = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: Generator = None,
    check_nan: bool = False,
) -> Tensor:
    """Top-k and top-p sampling from logits: the softmax, then :func:`top_k_top_p_sampling_from_probs`.

    logits: float ``[B, V]``. Draws the tokens ``top_k_top_p_sampling_from_probs(softmax(logits), ...)``
    draws on the same generator state, as sgl_kernel's tests require. Returns int32 ``[B]`` (``[M]``).
    """
    if check_nan and bool(torch.isnan(logits).any()):
        raise ValueError("Input logits contains NaN.")
    probs = torch.softmax(logits.float(), dim=-1)
    return top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices, filter_apply_order, deterministic,
                                           generator)
