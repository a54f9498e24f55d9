"""Sums and elementwise functions that round the same whatever the batch (on CPU, ATen rounds by a row's
length, its place in a vectorised loop and its thread split): a request's results depend on its own
inputs alone (docs/design.md, promise 3, "Reproducible per request")."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

_SUM_BLOCK = 256  # values per block of the sums of padded rows (padded_row_sum)
_VECTOR_BODY = 64  # lengths that are whole iterations of ATen's vectorised CPU loops (in_vector_body)
_GRAIN = 32768  # ATen's at::internal::GRAIN_SIZE: elementwise loops over more values are split among threads


def row_sum(t: Tensor, keepdim: bool = False) -> Tensor:
    """Sums over the last dim of ``t`` ``[..., C]`` for rows of a length of their own (a
    vocabulary, not a batch's widest row: see :func:`padded_row_sum`), each as in any batch.

    A request's results must not depend on its neighbours (docs/design.md, promise 3), but ATen splits the
    sum of a lone long row across threads, which rounds otherwise than a row among others
    (summed by one thread): a lone row is summed as one of two.
    """
    if t.device.type == "cpu" and t.dim() and math.prod(t.shape[:-1]) == 1:
        s = t.reshape(1, -1).expand(2, -1).sum(-1)[:1]
        return s.view(*t.shape[:-1], 1) if keepdim else s.view(t.shape[:-1])
    return t.sum(-1, keepdim=keepdim)


def padded_row_sum(t: Tensor, keepdim: bool = False) -> Tensor:
    """Sums over the last dim of ``t`` ``[..., C]`` that zeros at the end of a row do not change
    (rows padded to the widest of a batch, whose width depends on the others).

    ATen's sum of a row associates its values by the row's length. Here: sums of 256
    consecutive values (the last block padded with zeros), then of 256 of those, and so on,
    each an ATen sum of fixed length (never split across threads); zeros add nothing.
    """
    W = _SUM_BLOCK
    while (C := t.shape[-1]) > W:
        full = C - C % W
        sums = t[..., :full].unflatten(-1, (full // W, W)).sum(-1)
        if full < C:
            tail = torch.nn.functional.pad(t[..., full:], (0, W - C + full))
            sums = torch.cat([sums, tail.sum(-1, keepdim=True)], -1)
        t = sums
    return torch.nn.functional.pad(t, (0, W - C)).sum(-1, keepdim=keepdim)  # a new tensor, even of one column


def in_vector_body(fn, t: Tensor) -> Tensor:
    """``fn(t)`` for an elementwise ``fn`` with exponentials or logarithms, on CPU computed over
    ``t`` padded (last dim) to a multiple of 64 values, contiguous, then cut back.

    ATen's CPU loops round these (and fused multiply-adds) one way in their vectorised body
    and another in the scalar tail of a loop, and where a value falls depends on the batch
    when its place in the tensor does: a request's log-probability among the others' (the
    weights of :func:`.filters._weights` are computed in a buffer of whole iterations instead).
    Padded, every value is in the body; a loop over more values than ATen runs on one thread is computed over a
    flat buffer of :func:`grid_length` values, so that every thread's share is whole iterations too.
    """
    if t.device.type != "cpu":
        return fn(t)
    C = t.shape[-1]
    if C % _VECTOR_BODY or not t.is_contiguous():  # (a contiguous t of whole iterations is read as it is)
        t = torch.nn.functional.pad(t, (0, -C % _VECTOR_BODY))
    n = t.numel()
    m = grid_length(n)
    if m == n:
        out = fn(t)
        return out if out.shape[-1] == C else out[..., :C]  # (a view costs a call too)
    return fn(torch.nn.functional.pad(t.reshape(-1), (0, m - n)))[:n].view(t.shape)[..., :C]


def grid_length(n: int) -> int:
    """The least length of at least ``n`` values over which an ATen elementwise loop on CPU computes every value in
    its vectorised body, whatever the intra-op threads (``torch.get_num_threads()``): a multiple of 64 whose every
    thread's share is a multiple of 64 too. Without it, from 3 threads up a share may end inside an iteration, and
    the values there (which depend on the batch's size) round as the scalar loop does: with 7 threads, 3 rows of a
    batch of 9 plain rows of 32000 came out otherwise than alone (tests/sampling, thread counts)."""
    # while torch.compile traces, the function itself (dynamo warns on every trace of an lru_cache, then ignores it)
    grid = _grid_length.__wrapped__ if torch.compiler.is_compiling() else _grid_length
    return grid(n, torch.get_num_threads())


@functools.lru_cache(maxsize=4096)
def _grid_length(n: int, threads: int) -> int:
    m = -(-n // _VECTOR_BODY) * _VECTOR_BODY
    # ATen's OpenMP split: min(threads, ceil(m / grain)) shares of ceil(m / shares) values each (its native backend
    # makes shares of max(grain, ceil(m / threads)) values: multiples of 64 wherever these are)
    while m > _GRAIN and threads > 1 and -(-m // min(threads, -(-m // _GRAIN))) % _VECTOR_BODY:
        m += _VECTOR_BODY
    return m
