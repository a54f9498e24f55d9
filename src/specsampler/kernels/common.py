"""Pieces shared by the kernel modules (:mod:`.chain`, :mod:`.tree`, :mod:`.sampling`): the bundles a kernel
makes of its arguments (:class:`Strided`, :class:`Randomness`, :class:`LogitRows`) and its row constexprs
(:class:`RowConfig`), a request's uniforms, a row's argmax, descriptor and draw, and the launchers' normalisation
of their inputs into keyword arguments. Kernels take tensors as flat arguments (one per line, with its shape)
and bundle them in their first lines: tools that follow a launch's tensors see them all."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..rng import STREAM_ACCEPT, STREAM_SAMPLE
from .describe import describe_row, draw, unpack_candidates
from .philox import philox_uniform
from .rows import STAGES, aligned_strides, row_scratch

SAMPLE = tl.constexpr(STREAM_SAMPLE)
ACCEPT = tl.constexpr(STREAM_ACCEPT)
TINY = tl.constexpr(1.1754943508222875e-38)  # the reference normalises processed rows by max(sum, tiny)


class Strided(NamedTuple):
    """In a kernel: a ``[B, rows, V]`` tensor with a contiguous last dim (row ``i`` of request ``b`` starts at
    :func:`row_ptr`)."""

    data: object  # pointer (None where the kernel reads none)
    stride_b: object
    stride_row: object


class Randomness(NamedTuple):
    """In a kernel: the uniforms of a batch, Philox keys (``seed``, ``offset``: int64 ``[B]``; the kernel
    computes the uniforms at the counters of :mod:`specsampler.rng`) where ``philox`` is 1, or the uniforms
    themselves (``u_accept``, ``u_sample``: float32 ``[B, n]`` by draw index, rows ``*_stride`` apart) where it
    is 0. The side not used holds stand-ins, never read (:func:`randomness`)."""

    seed: object
    offset: object
    u_accept: object
    u_accept_stride: object
    u_sample: object
    u_sample_stride: object
    philox: object


class LogitRows(NamedTuple):
    """In a kernel from logits: what it reads besides the logits, each row's parameters (float32 / int64
    ``[B * rows]``, request-major: row ``i`` of request ``b`` at ``b * rows + i``), the vocabulary mask
    (:class:`Strided` uint8, True = allowed; its data None: all allowed) and the scratch of its programs
    (:func:`specsampler.kernels.rows.row_scratch`)."""

    vocab_mask: Strided
    temperature: object
    top_k: object
    top_p: object
    min_p: object
    fscratch: object
    iscratch: object


class RowConfig(NamedTuple):
    """The constexprs of the row functions (:func:`specsampler.kernels.rows.row_config`), one kernel
    argument (``ROWS``)."""

    CHUNK: int
    BLOCK_CHUNKS: int
    NCH_P2: int
    CAND: int
    NUCLEUS: int
    GROUP: int
    SEARCH_BLOCK: int
    NPIV: int


@triton.jit
def row_ptr(t, b, i):
    """Row ``i`` of request ``b`` of a :class:`Strided` tensor."""
    return t.data + b * t.stride_b + i * t.stride_row


@triton.jit
def mask_row(rows, logits_row, b, i, HAS_MASK: tl.constexpr):
    """Row ``i`` of request ``b`` of the vocabulary mask of :class:`LogitRows` ``rows``; without a mask the
    logits row, which :func:`specsampler.kernels.rows.load_logits` then never reads as a mask."""
    return row_ptr(rows.vocab_mask, b, i) if HAS_MASK else logits_row


@triton.jit
def scratch_rows(rows, p, ROWS: tl.constexpr):
    """The scratch rows (float32, int64) of program (or row) ``p`` in :class:`LogitRows` ``rows``."""
    return rows.fscratch + p * (3 * ROWS.NCH_P2), rows.iscratch + p * (3 * ROWS.CAND)


@triton.jit
def request_keys(randomness, b):
    """Request ``b``'s keys for :func:`uniform`: ``(b, seed, offset)``, the Philox keys loaded once (int64
    scalars; 0 without Philox)."""
    seed = tl.full((), 0, tl.int64)
    offset = tl.full((), 0, tl.int64)
    if randomness.philox != 0:
        seed = tl.load(randomness.seed + b)
        offset = tl.load(randomness.offset + b)
    return b, seed, offset


@triton.jit
def uniform(randomness, keys, index, STREAM: tl.constexpr):
    """The request's uniform at draw ``index`` of ``STREAM`` (``keys``: :func:`request_keys`): Philox
    in-kernel, or the given ``u_accept`` / ``u_sample`` at ``index``."""
    b, seed, offset = keys
    u = tl.full((), 0.0, tl.float32)
    if randomness.philox != 0:
        u = tl.sum(philox_uniform(seed, offset, index, STREAM), 0)
    elif STREAM == ACCEPT:
        u = tl.load(randomness.u_accept + b * randomness.u_accept_stride + index)
    else:
        u = tl.load(randomness.u_sample + b * randomness.u_sample_stride + index)
    return u


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
def describe(rows, r, logits_row, mask_row, V, fscratch_row, iscratch_row, HAS_MASK: tl.constexpr,
             ROWS: tl.constexpr):
    """The descriptor of a row of logits whose parameters are at index ``r`` of :class:`LogitRows` ``rows``
    (:func:`specsampler.kernels.describe.describe_row`): the tuple ``(m, inv_t, tau, id_cut, w_min, z, in_regs,
    cand_ids, cand_w)``, in fixed types (a descriptor is carried through loops)."""
    cand_row = iscratch_row + 2 * ROWS.CAND  # row_scratch's third part
    m, inv_t, tau, id_cut, w_min, z, in_regs = describe_row(
        logits_row, mask_row, V, tl.load(rows.temperature + r), tl.load(rows.top_k + r), tl.load(rows.top_p + r),
        tl.load(rows.min_p + r), fscratch_row, iscratch_row, cand_row, HAS_MASK, ROWS.CHUNK, ROWS.BLOCK_CHUNKS,
        ROWS.NCH_P2, ROWS.CAND, ROWS.NUCLEUS, ROWS.GROUP, ROWS.SEARCH_BLOCK, ROWS.NPIV)
    tl.debug_barrier()  # the kept tokens stored by all threads
    cand_ids, cand_w = unpack_candidates(cand_row, ROWS.CAND)
    return fixed_types(m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w)


@triton.jit
def fixed_types(m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w):
    """A descriptor tuple whose scalars are float32 / int32 tensors whatever the values were made of."""
    f = tl.full((), 0.0, tl.float32)
    i = tl.full((), 0, tl.int32)
    return (m + f, inv_t + f, tau + f, (id_cut + i).to(tl.int32), w_min + f, z + f, (in_regs + i).to(tl.int32),
            cand_ids.to(tl.int32), cand_w.to(tl.float32))


@triton.jit
def choose(take, a, b):
    """Descriptor ``a`` where ``take``, else ``b``."""
    return (tl.where(take, a[0], b[0]), tl.where(take, a[1], b[1]), tl.where(take, a[2], b[2]),
            tl.where(take, a[3], b[3]), tl.where(take, a[4], b[4]), tl.where(take, a[5], b[5]),
            tl.where(take, a[6], b[6]), tl.where(take, a[7], b[7]), tl.where(take, a[8], b[8]))


@triton.jit
def draw_from(u, d, logits_row, mask_row, V, fscratch_row, HAS_MASK: tl.constexpr, ROWS: tl.constexpr):
    """:func:`specsampler.kernels.describe.draw` of the uniform ``u`` from a row of descriptor ``d``: the token
    (int32) and its kept weight."""
    m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w = d
    return draw(u, m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w, logits_row, mask_row, V,
                fscratch_row, HAS_MASK, ROWS.CHUNK, ROWS.NCH_P2)


def aligned_rows(*tensors: Tensor | None) -> bool:
    """Whether every row of these ``[..., V]`` tensors (None: none) starts a multiple of 16 elements from the
    first: the kernels' ``ALIGNED`` (:func:`specsampler.kernels.rows.aligned_strides`)."""
    return aligned_strides(*(s for t in tensors if t is not None for s in t.stride()[:-1]))


def row_parameters(temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> tuple[Tensor, ...]:
    """Per-row parameters as the kernels take them: float32, int64, float32, float32, contiguous (copied only
    when they are not)."""
    return (temperature.to(torch.float32).contiguous(), top_k.to(torch.int64).contiguous(),
            top_p.to(torch.float32).contiguous(), min_p.to(torch.float32).contiguous())


def last_dim_contiguous(t: Tensor) -> Tensor:
    """``t`` with a contiguous last dimension (copied only when it is not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def strides(t: Tensor | None) -> tuple[int, int]:
    """The batch and row strides of a ``[B, rows, V]`` tensor; ``(0, 0)`` for none (the kernel reads none)."""
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def logit_rows(logits: Tensor, vocab_mask: Tensor | None, temperature: Tensor, top_k: Tensor, top_p: Tensor,
               min_p: Tensor, programs: int, cfg: dict) -> dict:
    """The kernel arguments of a :class:`LogitRows` for logits ``[B, rows, V]``: ``vocab_mask`` bool or uint8
    ``[B * rows, V]`` (request-major) or ``[B, rows, V]``, any strides but the last dim's (None: all allowed);
    the parameters ``[B * rows]``; the scratch of ``programs`` programs for row config ``cfg``."""
    mask, mask_strides = None, (0, 0)
    if vocab_mask is not None:
        mask = last_dim_contiguous(vocab_mask)
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mask_strides = (mask.stride(0) * logits.shape[1], mask.stride(0)) if mask.dim() == 2 else strides(mask)
    fscratch, iscratch = row_scratch(programs, cfg, logits.device)
    temperature, top_k, top_p, min_p = row_parameters(temperature, top_k, top_p, min_p)
    return dict(vocab_mask_ptr=mask, vocab_mask_stride_b=mask_strides[0], vocab_mask_stride_row=mask_strides[1],
                temperature_ptr=temperature, top_k_ptr=top_k, top_p_ptr=top_p, min_p_ptr=min_p, fscratch_ptr=fscratch,
                iscratch_ptr=iscratch)


# the kernel arguments of logit_rows for a kernel reading probabilities
NO_LOGIT_ROWS = dict(vocab_mask_ptr=None, vocab_mask_stride_b=0, vocab_mask_stride_row=0, temperature_ptr=None,
                     top_k_ptr=None, top_p_ptr=None, min_p_ptr=None, fscratch_ptr=None, iscratch_ptr=None)


def check_randomness(op: str, method: str, seed, u_accept: Tensor | None, u_sample: Tensor | None,
                     needs_accept: bool, accept_methods: str) -> bool:
    """Whether the uniforms come from Philox (``seed`` given); raises when they do not and ``method``
    lacks ``u_sample`` (all but greedy) or ``u_accept`` (``needs_accept``, for ``accept_methods``)."""
    philox = seed is not None
    if not philox and method != "greedy" and (u_sample is None or (needs_accept and u_accept is None)):
        raise ValueError(f"{op}: method {method!r} needs seed, or u_sample (and u_accept{accept_methods})")
    return philox


def stand_in(dtype: torch.dtype, device) -> Tensor:
    """An empty tensor for a pointer argument that a launch does not read: the kernel is compiled for the
    pointer's type whether or not the launch has the tensor (None would be a compile-time constant, and a
    second compiled kernel)."""
    return torch.empty(0, dtype=dtype, device=device)


def randomness(seed, offset, u_accept: Tensor | None, u_sample: Tensor | None, B: int, device) -> dict:
    """The kernel arguments of a :class:`Randomness`: with ``seed``, the Philox keys as int64 ``[B]`` (ints
    broadcast, offset None = 0), else the given uniforms as contiguous float32 with their row strides; stand-ins
    (:func:`stand_in`) for the rest."""
    floats = stand_in(torch.float32, device)
    if seed is None:
        ua = floats if u_accept is None else u_accept.float().contiguous()
        us = floats if u_sample is None else u_sample.float().contiguous()
        ints = stand_in(torch.int64, device)
        return dict(seed_ptr=ints, offset_ptr=ints, u_accept_ptr=ua, u_accept_stride=ua.stride(0), u_sample_ptr=us,
                    u_sample_stride=us.stride(0), philox=0)
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device).expand(B).contiguous()
    offset = torch.zeros_like(seed) if offset is None else (
        torch.as_tensor(offset, dtype=torch.int64, device=device).expand(B).contiguous())
    return dict(seed_ptr=seed, offset_ptr=offset, u_accept_ptr=floats, u_accept_stride=0, u_sample_ptr=floats,
                u_sample_stride=0, philox=1)


def block_size(block_v: int, V: int) -> int:
    """Vocabulary entries per block: ``block_v`` at most, the power of 2 covering ``V`` at least."""
    return min(block_v, triton.next_power_of_2(V))
