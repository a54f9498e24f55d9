"""Triton kernels of :func:`specsampler.sample_from_logits` and :func:`specsampler.sample`.

One program per row; small batches on a GPU split each row's first pass over several programs before
(:func:`specsampler.kernels.rows.scan_parts`), with the same results. The randomness is one uniform per
row (:mod:`specsampler.rng`): either drawn in the kernel from Philox at ``(seed, offset)``, stream
``STREAM_SAMPLE``, draw index ``index`` (the row's flat position inside its request), or given
precomputed (``u``), for ``torch.Generator`` / ``None`` streams drawn by the caller as the reference
draws them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import SAMPLE, TINY, aligned_rows, last_dim_contiguous, row_parameters, stand_in
from .describe import describe_row_in_parts, draw, find_chunk, unpack_candidates
from .philox import philox_uniform
from .rows import (
    STAGES,
    invert,
    launch_options,
    row_config,
    row_scratch,
    row_stride,
    scan_parts,
)


@triton.jit
def _row_uniform(row, seed_ptr, offset_ptr, index_ptr, u_ptr, philox):
    """The uniform of one row: Philox at (seed, offset, index) of the row (``philox`` != 0), or u[row]."""
    u = tl.full((), 0.0, tl.float32)
    if philox != 0:
        seed = tl.load(seed_ptr + row)
        offset = tl.load(offset_ptr + row)
        index = tl.load(index_ptr + row)
        u = tl.max(philox_uniform(seed, offset, index, SAMPLE), axis=0)
    else:
        u = tl.load(u_ptr + row)
    return u


@triton.jit(do_not_specialize=["logits_stride", "vocab_mask_stride", "philox", "parts"],
            do_not_specialize_on_alignment=["temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seed_ptr",
                                            "offset_ptr", "index_ptr", "u_ptr", "tokens_ptr", "logprobs_ptr",
                                            "part_m_ptr", "part_arg_ptr"])
def _sample_from_logits_kernel(
    logits_ptr,  # float32/bf16/fp16 [R, V], last dim contiguous
    logits_stride,
    vocab_mask_ptr,  # uint8 [R, V], last dim contiguous (HAS_MASK), else None
    vocab_mask_stride,
    temperature_ptr,  # float32 [R] (0 = greedy)
    top_k_ptr,  # int64 [R]
    top_p_ptr,  # float32 [R]
    min_p_ptr,  # float32 [R]
    seed_ptr,  # int64 [R] (philox; else a stand-in, not read)
    offset_ptr,  # int64 [R] (philox; else a stand-in)
    index_ptr,  # int64 [R] (philox; else a stand-in)
    u_ptr,  # float32 [R] (without philox; else a stand-in)
    philox,  # 1: the uniforms come from Philox keys; 0: from u
    tokens_ptr,  # out int64 [R]
    logprobs_ptr,  # out float32 [R]
    fscratch_ptr,  # float32 [R, 3 * NCH_P2]: rows.row_scratch
    iscratch_ptr,  # int64 [R, 3 * CAND]
    part_m_ptr,  # float32 [R * parts]: pass 1's part maxima (rows.scan_parts)
    part_arg_ptr,  # int32 [R * parts]: their ids
    parts,  # parts per row of pass 1 (0: none)
    V,  # vocabulary size
    HAS_MASK: tl.constexpr,  # vocab_mask_ptr is given
    ALIGNED: tl.constexpr,  # the row strides are multiples of 16 (aligned_rows)
    CHUNK: tl.constexpr,  # the row functions' constexprs (rows.row_config)
    BLOCK_CHUNKS: tl.constexpr,
    NCH_P2: tl.constexpr,
    CAND: tl.constexpr,
    NUCLEUS: tl.constexpr,
    GROUP: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    NPIV: tl.constexpr,
):
    """One program per row: its descriptor (:func:`specsampler.kernels.describe.describe_row_in_parts`), then one
    draw (:func:`specsampler.kernels.describe.draw`); reference :func:`specsampler.sampling.ops.sample_from_logits`
    (``process``, then ``sample_by_inversion``)."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * row_stride(logits_stride, ALIGNED)
    # never read as a mask without one
    mask_row = vocab_mask_ptr + row * row_stride(vocab_mask_stride, ALIGNED) if HAS_MASK else logits_row
    fscratch_row = fscratch_ptr + row * (3 * NCH_P2)
    iscratch_row = iscratch_ptr + row * (3 * CAND)
    cand_row = iscratch_row + 2 * CAND
    m, inv_t, tau, id_cut, w_min, z, in_regs = describe_row_in_parts(
        logits_row, mask_row, V, tl.load(temperature_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row),
        tl.load(min_p_ptr + row), fscratch_row, iscratch_row, cand_row, part_m_ptr + row * parts,
        part_arg_ptr + row * parts, parts, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK,
        NPIV)
    tl.debug_barrier()  # the kept tokens stored by all threads
    cand_ids, cand_w = unpack_candidates(cand_row, CAND)
    u = _row_uniform(row, seed_ptr, offset_ptr, index_ptr, u_ptr, philox)
    token, weight = draw(u, m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w, logits_row, mask_row, V,
                         fscratch_row, HAS_MASK, CHUNK, NCH_P2)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, tl.log(weight / tl.maximum(z, TINY)))


def _randomness(seed, offset, index, u, device) -> dict:
    """The kernels' randomness arguments: Philox keys (``seed``, ``offset``, ``index``, int64) or the uniforms
    ``u`` (float32), and ``philox``; stand-ins for the side not given (one compiled kernel serves both)."""
    if (u is None) == (seed is None or offset is None or index is None):
        raise ValueError("expected either seed, offset and index (int64 [R]) or u (float32 [R])")
    if u is None:
        return dict(seed_ptr=seed.long().contiguous(), offset_ptr=offset.long().contiguous(),
                    index_ptr=index.long().contiguous(), u_ptr=stand_in(torch.float32, device), philox=1)
    ints = stand_in(torch.int64, device)
    return dict(seed_ptr=ints, offset_ptr=ints, index_ptr=ints, u_ptr=u.float().contiguous(), philox=0)


def sample_from_logits(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    vocab_mask: Tensor | None = None,
    seed: Tensor | None = None,
    offset: Tensor | None = None,
    index: Tensor | None = None,
    u: Tensor | None = None,
    *,
    chunk: int = 64,
    cand: int = 256,
    tile: int = 2048,
    num_warps: int = 8,
    parts: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Process each row of logits and draw one token by inversion (the kernel of
    :func:`specsampler.sample_from_logits` for ``num_logprobs=0``).

    Args:
        logits: float32/bf16/fp16 ``[R, V]``, rows contiguous (any row stride).
        temperature: float32 ``[R]`` (0 = greedy); top_k: int64 ``[R]`` (<= 0 or >= V: off);
            top_p: float32 ``[R]`` (>= 1: off); min_p: float32 ``[R]``.
        vocab_mask: bool ``[R, V]`` (True = allowed; any row stride, so an expanded mask is not copied), or None.
        seed, offset: int64 ``[R]``, the Philox key and counter offset of each row's request;
            index: int64 ``[R]``, the row's draw index (its flat position inside the request).
        u: float32 ``[R]`` in [0, 1): precomputed uniforms, instead of seed/offset/index.
        chunk, cand, tile, num_warps: tuning (see :func:`specsampler.kernels.rows.row_config`, whose ``block``
            is ``tile``).
        parts: split each row's first pass over this many programs (a first kernel,
            :func:`specsampler.kernels.rows.scan_parts`) before one program per row finishes it; 0: one program
            per row throughout; None: :func:`specsampler.kernels.rows.parts_per_row` (small batches on a GPU).
            The results are the same bit for bit.
    Returns:
        tokens int64 ``[R]`` in ``[0, V)``; logprobs float32 ``[R]``, the log of each token's
        processed probability (-inf for a row without an allowed finite logit, which draws 0).
    """
    R, V = logits.shape
    logits = last_dim_contiguous(logits)
    tokens = torch.empty(R, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(R, dtype=torch.float32, device=logits.device)
    randomness = _randomness(seed, offset, index, u, logits.device)
    if R == 0:
        return tokens, logprobs
    cfg = row_config(V, chunk=chunk, cand=cand, block=tile)
    fscratch, iscratch = row_scratch(R, cfg, logits.device)
    mask = None if vocab_mask is None else last_dim_contiguous(vocab_mask).view(torch.uint8)
    mask_stride = 0 if mask is None else mask.stride(0)
    temperature, top_k, top_p, min_p = row_parameters(temperature, top_k, top_p, min_p)
    part_m, part_arg, parts = scan_parts(logits, (logits.stride(0), 0), mask, (mask_stride, 0), None, temperature,
                                         top_k, fscratch, R, 1, parts, cfg)
    _sample_from_logits_kernel[(R,)](
        logits_ptr=logits, logits_stride=logits.stride(0), vocab_mask_ptr=mask, vocab_mask_stride=mask_stride,
        temperature_ptr=temperature, top_k_ptr=top_k, top_p_ptr=top_p, min_p_ptr=min_p, **randomness,
        tokens_ptr=tokens, logprobs_ptr=logprobs, fscratch_ptr=fscratch, iscratch_ptr=iscratch, part_m_ptr=part_m,
        part_arg_ptr=part_arg, parts=parts, V=V, HAS_MASK=mask is not None,
        ALIGNED=aligned_rows(logits, mask), **launch_options(num_warps), **cfg,
        enable_fp_fusion=False,  # rounded as the chain and tree kernels round it: target_only's draws are these
    )
    return tokens, logprobs


@triton.jit(do_not_specialize=["probs_stride", "philox"],
            do_not_specialize_on_alignment=["seed_ptr", "offset_ptr", "index_ptr", "u_ptr", "tokens_ptr"])
def _sample_kernel(
    probs_ptr,  # float [R, V], last dim contiguous: non-negative weights
    probs_stride,
    seed_ptr,  # int64 [R] (philox; else a stand-in, not read)
    offset_ptr,  # int64 [R] (philox; else a stand-in)
    index_ptr,  # int64 [R] (philox; else a stand-in)
    u_ptr,  # float32 [R] (without philox; else a stand-in)
    philox,  # 1: the uniforms come from Philox keys; 0: from u
    tokens_ptr,  # out int64 [R]
    fscratch_ptr,  # float32 [R, 3 * NCH_P2]: the chunk masses at [2 * NCH_P2:]
    V,  # vocabulary size
    ALIGNED: tl.constexpr,  # the row stride is a multiple of 16 (aligned_rows)
    CHUNK: tl.constexpr,  # rows.row_config's
    BLOCK_CHUNKS: tl.constexpr,
    NCH_P2: tl.constexpr,
):
    """One program per row: a draw by inversion from the weights (reference
    :func:`specsampler.sampling.masses.sample_by_inversion`), a pass for the chunk masses, then one chunk."""
    row = tl.program_id(0).to(tl.int64)
    probs_row = probs_ptr + row * row_stride(probs_stride, ALIGNED)
    fscratch_row = fscratch_ptr + row * (3 * NCH_P2)
    n_chunks = tl.cdiv(V, CHUNK)
    local = tl.arange(0, BLOCK_CHUNKS)
    tile = local[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    # pass 1: the mass of each chunk (negative and NaN entries weigh 0), where find_chunk reads it
    total = 0.0
    for start in tl.range(0, V, BLOCK_CHUNKS * CHUNK, num_stages=STAGES):
        offs = start + tile
        w = tl.load(probs_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        mass = tl.sum(tl.where(w > 0.0, w, 0.0), axis=1)
        chunk = start // CHUNK + local
        tl.store(fscratch_row + 2 * NCH_P2 + chunk, mass, mask=chunk < n_chunks)
        total += tl.sum(mass, axis=0)
    tl.debug_barrier()
    u = _row_uniform(row, seed_ptr, offset_ptr, index_ptr, u_ptr, philox)
    chunk, t_in = find_chunk(fscratch_row, V, u * total, CHUNK, NCH_P2)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    w = tl.load(probs_row + offs, mask=offs < V, other=0.0).to(tl.float32)
    idx, _ = invert(tl.where(w > 0.0, w, 0.0), t_in)
    tl.store(tokens_ptr + row, (chunk * CHUNK + idx).to(tl.int64))


def sample(
    probs: Tensor,
    seed: Tensor | None = None,
    offset: Tensor | None = None,
    index: Tensor | None = None,
    u: Tensor | None = None,
    *,
    chunk: int = 64,
    num_warps: int = 8,
) -> Tensor:
    """One categorical draw per row by inversion (the kernel of :func:`specsampler.sample`).

    Args:
        probs: float ``[R, V]`` (a last dim that is not contiguous is copied); non-negative weights, need not be
            normalised (negative and NaN entries weigh 0: the reference leaves such rows unspecified).
        seed, offset, index: int64 ``[R]`` (Philox, as in :func:`sample_from_logits`), or
        u: float32 ``[R]``, precomputed uniforms.
        chunk, num_warps: tuning.
    Returns:
        int64 ``[R]`` in ``[0, V)``: the first id whose cumulative weight exceeds ``u * total``, not past
        the last positive weight (0 for a row without mass).
    """
    R, V = probs.shape
    probs = last_dim_contiguous(probs)  # the kernel steps one element per token
    cfg = row_config(V, chunk=chunk)
    tokens = torch.empty(R, dtype=torch.int64, device=probs.device)
    fscratch = torch.empty(R, 3 * cfg["NCH_P2"], dtype=torch.float32, device=probs.device)  # as row_scratch's
    randomness = _randomness(seed, offset, index, u, probs.device)
    if R == 0:
        return tokens
    _sample_kernel[(R,)](probs_ptr=probs, probs_stride=probs.stride(0), **randomness, tokens_ptr=tokens,
                         fscratch_ptr=fscratch, V=V, ALIGNED=aligned_rows(probs), CHUNK=cfg["CHUNK"],
                         BLOCK_CHUNKS=cfg["BLOCK_CHUNKS"], NCH_P2=cfg["NCH_P2"], **launch_options(num_warps))
    return tokens
