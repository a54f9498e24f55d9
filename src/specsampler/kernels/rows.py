"""Rows of logits inside Triton kernels: reading them, and the first pass of their description (:mod:`.describe`).

Host side: the launch settings every kernel shares (:data:`STAGES`, :data:`PROGRAMS_PER_SM`, :func:`launch_options`),
the row functions' constexprs and scratch (:func:`row_config`, :func:`row_scratch`), and pass 1 split over several
programs for small batches (:func:`scan_parts`). In kernels (``logits_row`` / ``mask_row`` point at one row, the
mask as uint8, True = allowed; ``HAS_MASK`` says whether there is one): a block of logits (:func:`load_logits`, -inf
where masked or past V), order keys, the kept weights of a described row (:func:`kept_weights`,
:func:`token_weight`), inversion within a block (:func:`invert`), pass 1 (the row's max and argmax, each chunk's
maximum and sum) and the chunk masses a draw reads.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 2048  # chunk maxima of one row are handled as one register tensor of at most this size
MAX_PARTS = tl.constexpr(128)  # parts pass 1 over a row may be split into (scan_parts)


def pipeline_stages() -> int:
    """Tiles in flight in the passes over rows (``SPECSAMPLER_PIPELINE_STAGES``, default 4).

    A pass that streams a row tile by tile (``tl.range(..., num_stages=STAGES)``) is software-pipelined by
    the compiler: each tile is copied asynchronously (``cp.async``) ``STAGES - 1`` iterations ahead of its use,
    so a program keeps that many tiles of loads in flight instead of waiting for every tile in turn (one
    program per request reads its rows alone: without this, a pass waits a memory latency per tile). 1 turns
    it off. Read once, when the kernels are imported; the interpreter ignores it.
    """
    raw = os.environ.get("SPECSAMPLER_PIPELINE_STAGES", "4")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"SPECSAMPLER_PIPELINE_STAGES: expected an integer >= 1, got {raw!r}")
    return int(raw)


STAGES = tl.constexpr(pipeline_stages())

REGISTERS_PER_SM = 65536  # 32-bit registers of one SM (compute capabilities 7.0 to 10.0)


def programs_per_sm() -> int:
    """Programs of one kernel that fit on an SM together (``SPECSAMPLER_PROGRAMS_PER_SM``, default 2).

    A program alone on its SM leaves the SM's memory pipe idle whenever it computes rather than streams
    (the search for a row's cut, its sorts); a second program there streams meanwhile. An SM holds two
    8-warp programs when each thread uses at most 128 registers (:func:`launch_options`): the kernels fit
    in that without spilling (``benchmarks/compile.py`` shows it). 1: no limit. Read once, when the
    kernels are imported; the interpreter ignores it.
    """
    raw = os.environ.get("SPECSAMPLER_PROGRAMS_PER_SM", "2")
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 4:
        raise ValueError(f"SPECSAMPLER_PROGRAMS_PER_SM: expected an integer from 1 to 4, got {raw!r}")
    return int(raw)


PROGRAMS_PER_SM = programs_per_sm()


def launch_options(num_warps: int) -> dict:
    """``num_warps`` and the register limit per thread (``maxnreg``) that lets :data:`PROGRAMS_PER_SM`
    programs of that many warps share an SM (none when the 255-register maximum already does). The
    limit changes register allocation only, never the arithmetic: results are the same bit for bit."""
    regs = REGISTERS_PER_SM // (PROGRAMS_PER_SM * num_warps * 32) // 8 * 8  # allocated in units of 8
    return dict(num_warps=num_warps) if regs >= 255 else dict(num_warps=num_warps, maxnreg=regs)


def aligned_strides(*strides: int) -> bool:
    """Whether the row strides are all multiples of 16: a kernel's ``ALIGNED`` (:func:`row_stride`). Strides and
    sizes are run-time kernel arguments, not specialised on, so that a kernel is compiled once whatever the
    batch, chain or tree shape; this flag keeps what the compiler would have learnt from them for the loads.
    For a model's logits (fixed V, rows contiguous) it is fixed."""
    return all(s % 16 == 0 for s in strides)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_config(V: int, *, chunk: int = 64, cand: int = 256, nucleus: int = 64, block: int = 2048) -> dict:
    """Constexprs of the row functions for a vocabulary of V tokens.

    chunk: tokens per chunk (a power of 2; raised so that a row has at most 2048 chunks).
    cand: candidates sorted in registers (a power of 2): top-k up to about this is found in registers.
    nucleus: tokens a top-p-only row first looks for its nucleus among (at most ``cand``).
    block: tokens per tile of a pass over the row.
    """
    chunk = max(chunk, _next_pow2(-(-V // MAX_CHUNKS)))
    nch_p2 = _next_pow2(-(-V // chunk))
    return dict(
        CHUNK=chunk,
        BLOCK_CHUNKS=max(1, block // chunk),
        NCH_P2=nch_p2,
        CAND=cand,
        NUCLEUS=min(nucleus, cand),
        # chunks gathered per step of top_candidates (each step waits for two dependent loads and exchanges
        # positions between warps): a top-k of up to cand / 4 (50 of 256: 64 chunks, 4096 tokens) in one step
        GROUP=max(1, min(cand // 4, 4096 // chunk, nch_p2)),
        SEARCH_BLOCK=256,
        NPIV=16,
    )


def row_scratch(programs: int, cfg: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scratch of ``programs`` programs: float32 ``[programs, 3 * NCH_P2]``, int64 ``[programs, 3 * CAND]``
    (candidates and their sorts in ``[:2 * CAND]``, a described row's kept tokens in ``[2 * CAND:]``)."""
    return (
        torch.empty(programs, 3 * cfg["NCH_P2"], dtype=torch.float32, device=device),
        torch.empty(programs, 3 * cfg["CAND"], dtype=torch.int64, device=device),
    )


def multiprocessors(device: torch.device) -> int | None:
    """The streaming multiprocessors of a CUDA device, None for any other (the interpreter): the launchers'
    size decisions (:func:`parts_per_row`, the chain's rows in parallel) are functions of it."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def parts_per_row(rows: int, V: int, cfg: dict, device: torch.device) -> int:
    """Parts that pass 1 over each of ``rows`` rows is split into (:func:`scan_parts`), 0 for none: on a
    GPU, as many as fill its SMs' program slots (:data:`PROGRAMS_PER_SM` each), at most one per tile and
    :data:`MAX_PARTS`, when that is at least 2. One program per row reads a row at the rate one SM draws,
    so a small batch (sampling at B=1 or 64 of a 132-SM GPU, a chain's 5 rows at B=1) would leave most
    of the GPU idle. Off a GPU (the interpreter), never."""
    sms = multiprocessors(device)
    if sms is None:
        return 0
    slots = PROGRAMS_PER_SM * sms
    parts = min(slots // max(rows, 1), triton.cdiv(V, cfg["BLOCK_CHUNKS"] * cfg["CHUNK"]), MAX_PARTS.value)
    return parts if parts >= 2 else 0


def scan_parts(logits: torch.Tensor, strides: tuple[int, int], vocab_mask: torch.Tensor | None,
               mask_strides: tuple[int, int], num_drafts: torch.Tensor | None, temperature: torch.Tensor,
               top_k: torch.Tensor, fscratch: torch.Tensor, rows: int, K1: int, parts: int | None, cfg: dict,
               greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pass 1 over ``rows`` rows, each split into ``parts`` programs (0 to :data:`MAX_PARTS`; None:
    :func:`parts_per_row`): row ``r`` is row ``r % K1`` of request ``r // K1`` (``strides``: of the request
    and row dimensions of ``logits``, and ``mask_strides`` of ``vocab_mask``, uint8 or None; with
    ``num_drafts``, int ``[rows / K1]``, only rows up to it); its parameters are at index ``r`` (``greedy``:
    every row is greedy, the parameters are not read). Leaves the chunk results in each row's ``fscratch``
    row; returns the parts' maxima, float32 and int32 ``[rows * parts]``, and ``parts``, for
    ``describe_row_in_parts`` / ``first_pass`` (``parts`` 0: launches nothing, the tensors are empty)."""
    V = logits.shape[-1]
    parts = parts_per_row(rows, V, cfg, logits.device) if parts is None else parts
    part_m = torch.empty(rows * parts, dtype=torch.float32, device=logits.device)
    part_arg = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    if parts == 0:
        return part_m, part_arg, parts
    _scan_parts_kernel[(rows, parts)](
        logits_ptr=logits, logits_stride_b=strides[0], logits_stride_row=strides[1], vocab_mask_ptr=vocab_mask,
        vocab_mask_stride_b=mask_strides[0], vocab_mask_stride_row=mask_strides[1], num_drafts_ptr=num_drafts,
        temperature_ptr=None if greedy else temperature, top_k_ptr=None if greedy else top_k, part_m_ptr=part_m,
        part_arg_ptr=part_arg, fscratch_ptr=fscratch, K1=K1, V=V, parts=parts, GREEDY=greedy,
        HAS_ND=num_drafts is not None, HAS_MASK=vocab_mask is not None,
        ALIGNED=aligned_strides(*strides, *mask_strides), CHUNK=cfg["CHUNK"],
        BLOCK_CHUNKS=cfg["BLOCK_CHUNKS"], NCH_P2=cfg["NCH_P2"], **launch_options(8),
        enable_fp_fusion=False)  # compiled as the kernels that finish the pass are
    return part_m, part_arg, parts


# ----------------------------------------------------------------------------- elements


@triton.jit
def row_stride(stride, ALIGNED: tl.constexpr):
    """A row stride, a run-time argument, known to the compiler as a multiple of 16 when ``ALIGNED``
    (:func:`aligned_strides`): rows then start 16-element aligned, and their passes are vectorised and
    pipelined (``cp.async`` needs aligned rows). Written ``(stride // 16) * 16``, the same value, which the
    compiler's alignment analysis reads (``tl.multiple_of`` marks no argument)."""
    if ALIGNED:
        stride = (stride // 16) * 16
    return stride


@triton.jit
def load_logits(logits_row, mask_row, offs, V, HAS_MASK: tl.constexpr):
    """float32 logits at ``offs`` (any shape), -inf where masked out or ``offs >= V``."""
    inside = offs < V
    x = tl.load(logits_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        allowed = tl.load(mask_row + offs, mask=inside, other=0)
        x = tl.where(allowed != 0, x, float("-inf"))
    return x


@triton.jit
def order_key(x):
    """int32 key of float32 values, increasing with the value (-0.0 and +0.0 share key 0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def key_value(key):
    """The float32 value of an order key (inverse of :func:`order_key`)."""
    key = key.to(tl.int32)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def in_prefix(x, ids, tau, id_cut):
    """Whether tokens are in the prefix of the order (logit desc, id asc) that ends at (tau, id_cut)."""
    return (x > tau) | ((x == tau) & (ids <= id_cut))


@triton.jit
def kept_weights(x, ids, m, inv_t, tau, id_cut, w_min):
    """Kept weight of tokens ``ids`` with logits ``x`` (same shape): ``exp((x - m) * inv_t)``, or 0 when
    outside the top-k/top-p prefix, under min-p, masked (-inf) or NaN."""
    w = tl.exp((x - m) * inv_t)
    return tl.where(in_prefix(x, ids, tau, id_cut) & (w >= w_min), w, 0.0)


@triton.jit
def token_weight(logits_row, mask_row, V, token, m, inv_t, tau, id_cut, w_min, HAS_MASK: tl.constexpr):
    """Kept weight of one token id (a scalar; 0 when it is not in ``[0, V)``)."""
    offs = tl.where((token >= 0) & (token < V), token, V).to(tl.int32) + tl.zeros([1], tl.int32)
    x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
    return tl.sum(kept_weights(x, offs, m, inv_t, tau, id_cut, w_min), axis=0)


@triton.jit
def invert(w, t):
    """Inversion within one 1-D block of weights: the first index whose cumulative weight exceeds ``t``,
    but not past the last positive weight (0 when there is none); returns (index int32, its weight)."""
    j = tl.arange(0, w.shape[0])
    cum = tl.cumsum(w, axis=0)
    first = tl.min(tl.where(cum > t, j, w.shape[0]), axis=0)
    last = tl.max(tl.where(w > 0, j, -1), axis=0)
    idx = tl.where(last < 0, 0, tl.minimum(first, last))
    return idx, tl.sum(tl.where(j == idx, w, 0.0), axis=0)


# ----------------------------------------------------------------------------- pass 1 and chunk masses


@triton.jit
def row_settings(V, temperature, top_k, top_p, min_p):
    """A row's parameters as the row functions use them: (sampled, inv_t, k, top_k_on, top_p_on, w_min).
    Pass 1 needs the chunk sums of a sampled row without top-k (``sampled & ~top_k_on``)."""
    sampled = temperature != 0.0
    inv_t = 1.0 / tl.where(sampled, temperature, 1.0)
    k = tl.minimum(tl.maximum(top_k, 0), V).to(tl.int32)
    top_k_on = sampled & (k > 0) & (k < V)
    top_p_on = sampled & (top_p < 1.0)
    w_min = tl.where(sampled, min_p, 0.0)
    return sampled, inv_t, k, top_k_on, top_p_on, w_min


@triton.jit
def scan_row(logits_row, mask_row, V, inv_t, need_sums, fscratch_row,
             HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr):
    """Pass 1: the row's max logit and argmax (lowest id among ties); stores each chunk's maximum at
    ``fscratch_row[c]`` and, if ``need_sums``, ``sum exp((x - chunk max) * inv_t)`` at ``[NCH_P2 + c]``."""
    m, arg = scan_part(logits_row, mask_row, V, 0, V, inv_t, need_sums, fscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS,
                       NCH_P2)
    return m, tl.where(arg < V, arg, 0)


@triton.jit(noinline=True)
def scan_part(logits_row, mask_row, V, lo, hi, inv_t, need_sums, fscratch_row,
              HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr):
    """Pass 1 over the tokens ``[lo, hi)`` of a row (``lo`` a multiple of the tile, ``BLOCK_CHUNKS * CHUNK``;
    ``hi`` too, or V): stores what :func:`scan_row` stores for the chunks there, computed tile by tile as it
    does, so bit for bit the same; returns their max logit (-inf if none) and its lowest id (0 when the max
    is -inf)."""
    n_chunks = tl.cdiv(V, CHUNK)
    local = tl.arange(0, BLOCK_CHUNKS)
    tile = local[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    # per tile row (a chunk in each tile): the largest logit so far and its lowest id; reduced across the
    # tile once, after the pass, so that an iteration needs no exchange between warps beyond the stores
    slot_max = tl.full([BLOCK_CHUNKS], float("-inf"), tl.float32)
    slot_arg = tl.zeros([BLOCK_CHUNKS], tl.int32)
    for start in tl.range(lo, hi, BLOCK_CHUNKS * CHUNK, num_stages=STAGES):
        offs = start + tile
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        cmax = tl.max(x, axis=1)
        chunk = start // CHUNK + local
        tl.store(fscratch_row + chunk, cmax, mask=chunk < n_chunks)
        if need_sums:
            base = tl.where(cmax > float("-inf"), cmax, 0.0)
            csum = tl.sum(tl.exp((x - base[:, None]) * inv_t), axis=1)
            tl.store(fscratch_row + NCH_P2 + chunk, csum, mask=chunk < n_chunks)
        carg = tl.min(tl.where(x == cmax[:, None], offs, V), axis=1)
        slot_arg = tl.where(cmax > slot_max, carg, slot_arg)  # strictly larger: an earlier chunk keeps its tie
        slot_max = tl.maximum(slot_max, cmax)
    m = tl.max(slot_max, axis=0)
    return m, tl.min(tl.where(slot_max == m, slot_arg, V), axis=0)


@triton.jit
def combine_parts(part_m_row, part_arg_row, parts, V):
    """A row's max logit and argmax from its ``parts`` (at most ``MAX_PARTS``) results of :func:`scan_part`,
    as :func:`scan_row` returns them (the lowest id among the parts holding the max)."""
    j = tl.arange(0, MAX_PARTS)
    pm = tl.load(part_m_row + j, mask=j < parts, other=float("-inf"))
    pa = tl.load(part_arg_row + j, mask=j < parts, other=V)
    m = tl.max(pm, axis=0)
    arg = tl.min(tl.where(pm == m, pa, V), axis=0)
    return m, tl.where(arg < V, arg, 0)


@triton.jit
def first_pass(logits_row, mask_row, V, inv_t, need_sums, fscratch_row, part_m_row, part_arg_row, parts,
               HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr):
    """Pass 1 of a row, as :func:`scan_row` returns it: combined from the ``parts`` that :func:`scan_parts`
    scanned before (``parts > 0``), else scanned here."""
    if parts > 0:
        row_max, arg = combine_parts(part_m_row, part_arg_row, parts, V)
    else:
        row_max, arg = scan_row(logits_row, mask_row, V, inv_t, need_sums, fscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS,
                                NCH_P2)
    return row_max, arg


@triton.jit(do_not_specialize=["logits_stride_b", "logits_stride_row", "vocab_mask_stride_b", "vocab_mask_stride_row",
                               "K1", "parts"],
            do_not_specialize_on_alignment=["num_drafts_ptr", "temperature_ptr", "top_k_ptr", "part_m_ptr",
                                            "part_arg_ptr"])
def _scan_parts_kernel(
    logits_ptr,  # float32/bf16/fp16 [B, K1, V] (or [R, V]), last dim contiguous
    logits_stride_b,
    logits_stride_row,
    vocab_mask_ptr,  # uint8, rows as the logits' (HAS_MASK), else None
    vocab_mask_stride_b,
    vocab_mask_stride_row,
    num_drafts_ptr,  # int [B] (HAS_ND), else None
    temperature_ptr,  # float32 [rows] (not GREEDY), else None
    top_k_ptr,  # int64 [rows] (not GREEDY), else None
    part_m_ptr,  # out float32 [rows * parts]: each part's max logit
    part_arg_ptr,  # out int32 [rows * parts]: its lowest id
    fscratch_ptr,  # out float32 [rows, 3 * NCH_P2]: row_scratch, the chunk results
    K1,  # rows per request
    V,  # vocabulary size
    parts,  # parts per row
    GREEDY: tl.constexpr,  # every row is greedy (the parameters are not read)
    HAS_ND: tl.constexpr,  # num_drafts_ptr is given
    HAS_MASK: tl.constexpr,  # vocab_mask_ptr is given
    ALIGNED: tl.constexpr,  # the strides are multiples of 16 (aligned_strides)
    CHUNK: tl.constexpr,  # row_config's
    BLOCK_CHUNKS: tl.constexpr,
    NCH_P2: tl.constexpr,
):
    """Program (r, s): pass 1 over part s of row r (row i = r % K1 of request b = r // K1; with ``HAS_ND``
    only rows i <= num_drafts[b]): the chunk results into the row's scratch, (max, argmax) at
    ``part_*[r * parts + s]``, as :func:`scan_row` computes them for the whole row. Parts are runs of whole
    tiles, in order."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b = r // K1
    i = r % K1
    if (i <= tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K1 - 1)) if HAS_ND else (i >= 0):
        sampled, inv_t, _, top_k_on, _, _ = row_settings(V, 0.0 if GREEDY else tl.load(temperature_ptr + r),
                                                         0 if GREEDY else tl.load(top_k_ptr + r), 1.0, 0.0)
        tile = BLOCK_CHUNKS * CHUNK
        per = tl.cdiv(tl.cdiv(V, tile), parts) * tile
        lo = tl.minimum(s * per, V)
        logits_row = logits_ptr + b * row_stride(logits_stride_b, ALIGNED) + i * row_stride(logits_stride_row, ALIGNED)
        # without a mask the logits row, never read as one
        mask_row = (vocab_mask_ptr + b * row_stride(vocab_mask_stride_b, ALIGNED)
                    + i * row_stride(vocab_mask_stride_row, ALIGNED)) if HAS_MASK else logits_row
        m, arg = scan_part(logits_row, mask_row, V, lo, tl.minimum(lo + per, V), inv_t, sampled & (top_k_on == 0),
                           fscratch_ptr + r * (3 * NCH_P2), HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
        tl.store(part_m_ptr + r * parts + s, m)
        tl.store(part_arg_ptr + r * parts + s, arg)


@triton.jit
def masses_from_sums(fscratch_row, V, m, inv_t, write, CHUNK: tl.constexpr, NCH_P2: tl.constexpr):
    """The chunk masses of a row before any cut, from pass 1's chunk sums: returns their total; if
    ``write`` (a row without cut), stores them at ``fscratch_row[2 * NCH_P2 + c]`` for the draw."""
    c = tl.arange(0, NCH_P2)
    valid = c < tl.cdiv(V, CHUNK)
    cmax = tl.load(fscratch_row + c, mask=valid, other=float("-inf"))
    csum = tl.load(fscratch_row + NCH_P2 + c, mask=valid, other=0.0)
    mass = tl.where(valid, csum * tl.exp((cmax - m) * inv_t), 0.0)
    if write:
        tl.store(fscratch_row + 2 * NCH_P2 + c, mass, mask=valid)
    return tl.sum(mass, axis=0)


@triton.jit(noinline=True)
def kept_mass(logits_row, mask_row, V, m, inv_t, tau, id_cut, w_min, fscratch_row,
              HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr):
    """A pass summing the kept weights: returns z; stores each chunk's kept mass at
    ``fscratch_row[2 * NCH_P2 + c]`` (for the draw)."""
    n_chunks = tl.cdiv(V, CHUNK)
    local = tl.arange(0, BLOCK_CHUNKS)
    tile = local[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    z = 0.0
    for start in tl.range(0, V, BLOCK_CHUNKS * CHUNK, num_stages=STAGES):
        offs = start + tile
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        mass = tl.sum(kept_weights(x, offs, m, inv_t, tau, id_cut, w_min), axis=1)
        chunk = start // CHUNK + local
        tl.store(fscratch_row + 2 * NCH_P2 + chunk, mass, mask=chunk < n_chunks)
        z += tl.sum(mass, axis=0)
    return z
