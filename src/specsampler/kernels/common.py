"""Pieces shared by the kernel modules (:mod:`.chain`, :mod:`.chain_logits`, :mod:`.tree`,
:mod:`.tree_logits`, :mod:`.sampling`): the randomness of a request (stream ids, Philox keys, uniforms),
a row's argmax and descriptor, and the launchers' normalisation of their arguments."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..rng import STREAM_ACCEPT, STREAM_SAMPLE
from .philox import philox_uniform
from .rows import STAGES, describe_row

SAMPLE = tl.constexpr(STREAM_SAMPLE)
ACCEPT = tl.constexpr(STREAM_ACCEPT)
TINY = tl.constexpr(1.1754943508222875e-38)  # the reference normalises processed rows by max(sum, tiny)


@triton.jit
def request_keys(seed_ptr, offset_ptr, b, PHILOX: tl.constexpr):
    """Request ``b``'s Philox ``(seed, offset)`` (int64 scalars); ``(0, 0)`` (not read) without ``PHILOX``."""
    seed = 0
    offset = 0
    if PHILOX:
        seed = tl.load(seed_ptr + b)
        offset = tl.load(offset_ptr + b)
    return seed, offset


@triton.jit
def uniform(u_row, seed, offset, index, STREAM: tl.constexpr, PHILOX: tl.constexpr):
    """The request's uniform at draw ``index`` of ``STREAM``: Philox in-kernel, or precomputed ``u_row[index]``."""
    return tl.sum(philox_uniform(seed, offset, index, STREAM), 0) if PHILOX else tl.load(u_row + index)


@triton.jit
def argmax(row, V, BLOCK_V: tl.constexpr):
    """The lowest id of the row's largest value (int32), read in blocks of ``BLOCK_V``."""
    best = tl.full((), float("-inf"), tl.float32)
    arg = tl.full((), 0, tl.int32)
    for start in tl.range(0, V, BLOCK_V, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(p, 0)
        first = tl.min(tl.where(p == m, offs, V), 0)
        arg = tl.where(m > best, first, arg)
        best = tl.maximum(best, m)
    return arg


@triton.jit
def describe(logits_row, mask_row, r, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, fscratch_row,
             iscratch_row, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
             NCH_P2: tl.constexpr, CAND: tl.constexpr, NUCLEUS: tl.constexpr, GROUP: tl.constexpr,
             SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """:func:`describe_row` of the row whose parameters are at index ``r``, in fixed types (a
    descriptor is carried through loops)."""
    m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w = describe_row(
        logits_row, mask_row, V, tl.load(temperature_ptr + r), tl.load(top_k_ptr + r), tl.load(top_p_ptr + r),
        tl.load(min_p_ptr + r), fscratch_row, iscratch_row,
        HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)
    f = tl.full((), 0.0, tl.float32)
    i = tl.full((), 0, tl.int32)
    return (m + f, inv_t + f, tau + f, (id_cut + i).to(tl.int32), w_min + f, z + f, (in_regs + i).to(tl.int32),
            cand_ids.to(tl.int32), cand_w.to(tl.float32))


def last_dim_contiguous(t: Tensor) -> Tensor:
    """``t`` with a contiguous last dimension (copied only when it is not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def mask_strides(vocab_mask: Tensor | None, logits: Tensor) -> tuple[Tensor, int, int]:
    """A vocabulary mask ``[B * M, V]`` (request-major) or ``[B, M, V]`` for logits ``[B, M, V]``:
    (mask as uint8, request stride, row stride); the logits and zero strides when there is none."""
    if vocab_mask is None:
        return logits, 0, 0
    mask = last_dim_contiguous(vocab_mask)
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if mask.dim() == 2:
        return mask, mask.stride(0) * logits.shape[1], mask.stride(0)
    return mask, mask.stride(0), mask.stride(1)


def check_randomness(op: str, method: str, seed, u_accept: Tensor | None, u_sample: Tensor | None,
                     needs_accept: bool, accept_methods: str) -> bool:
    """Whether the uniforms come from Philox (``seed`` given); raises when they do not and ``method``
    lacks ``u_sample`` (all but greedy) or ``u_accept`` (``needs_accept``, for ``accept_methods``)."""
    philox = seed is not None
    if not philox and method != "greedy" and (u_sample is None or (needs_accept and u_accept is None)):
        raise ValueError(f"{op}: method {method!r} needs seed, or u_sample (and u_accept{accept_methods})")
    return philox


def randomness(seed, offset, u_accept: Tensor | None, u_sample: Tensor | None, B: int, device,
               unused: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' ``(seed, offset, u_accept, u_sample)`` arguments: with ``seed``, the Philox keys as
    int64 ``[B]`` (ints broadcast, offset None = 0), else the given uniforms as contiguous float32;
    ``unused`` (any tensor) stands for the side not read."""
    if seed is None:
        ua = unused if u_accept is None else u_accept.float().contiguous()
        us = unused if u_sample is None else u_sample.float().contiguous()
        return unused, unused, ua, us
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device).expand(B).contiguous()
    offset = torch.zeros_like(seed) if offset is None else (
        torch.as_tensor(offset, dtype=torch.int64, device=device).expand(B).contiguous())
    return seed, offset, unused, unused


def block_size(block_v: int, V: int) -> int:
    """Vocabulary entries per block: ``block_v`` at most, the power of 2 covering ``V`` at least."""
    return min(block_v, triton.next_power_of_2(V))
