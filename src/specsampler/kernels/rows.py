"""Processed distributions of rows of logits inside Triton kernels, without sorting the vocabulary.

The rules are those of :func:`specsampler.logits_to_probs` (DESIGN.md): vocab mask, temperature
(0 = greedy), top-k, top-p on the top-k-renormalised distribution, min-p, renormalise; "order"
is (logit desc, id asc). One row and its parameters are described by six scalars:

=========  =======  ===============================================================================
m          float32  the row's largest allowed logit, or 0 when it has none (the row then has no mass)
inv_t      float32  1 / temperature (1 for greedy rows)
tau        float32  with ``id_cut`` (int32): the last token kept by top-k and top-p, in order. A token
                    ``i`` with logit ``x`` is in that prefix iff ``x > tau or (x == tau and i <= id_cut)``;
                    no cut is ``(-inf, V)``; a greedy row's is ``(max logit, argmax)``
w_min      float32  min-p: a token is kept only if its weight ``>= w_min`` (= min_p; 0 for greedy rows)
z          float32  the kept mass: the sum of the kept weights (0 when the row has no mass)
=========  =======  ===============================================================================

The weight of token ``i`` is ``exp((x_i - m) * inv_t)`` when kept, else 0 (:func:`kept_weights`);
its processed probability is ``weight / z``. The draw (:func:`draw`) is by inversion of one
uniform ``u``: the first id, in id order, whose cumulative kept weight exceeds ``u * z``, but
never past the last id of positive weight (a row without mass draws id 0).

API for kernels (every function is ``@triton.jit``; ``logits_row`` / ``mask_row`` point at one
row, the mask as uint8, True = allowed; ``HAS_MASK`` says whether there is one):

- ``describe_row(logits_row, mask_row, V, temperature, top_k, top_p, min_p, fscratch_row,
  iscratch_row, <constexprs>) -> (m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w)``:
  the descriptor, plus, when ``in_regs`` (greedy rows and rows whose kept set was found among at
  most ``CAND`` candidates: the usual top-k / small nucleus case), the kept tokens in registers:
  ``cand_ids`` int32 ``[CAND]`` in increasing id order, padded with 2**31 - 1, and their weights
  ``cand_w`` float32 ``[CAND]`` (0 at the padding). Otherwise the per-chunk kept masses are in
  ``fscratch_row`` for :func:`draw`. Reads the row once in the common cases (greedy, plain
  temperature, top-k <= CAND with or without top-p, a nucleus among the 64-ish most likely tokens);
  min-p without top-k/top-p takes a second pass, a large nucleus (or top-k > CAND) a few more.
- ``describe_row_in_parts(..., part_m_row, part_arg_row, parts, <constexprs>)``: the same, when a first
  kernel (``scan_parts``, host side; ``parts_per_row`` says when) has done pass 1 over the row in
  ``parts`` programs: small batches would otherwise leave most SMs idle while each program reads its row
  alone. Bit for bit the same descriptor (the same per-chunk code, over whole tiles).
- ``kept_weights(x, ids, m, inv_t, tau, id_cut, w_min)``: the kept weights of a block of logits
  (``load_logits`` loads one, -inf where masked or past V). Processed probabilities = ``/ z``:
  this is what residuals ``max(p - q, 0)`` in chain/tree verification are built from.
- ``token_weight(logits_row, mask_row, V, token, m, inv_t, tau, id_cut, w_min, HAS_MASK)``: the kept
  weight of one token id (0 when out of range), e.g. ``p(x)`` in an acceptance test is this ``/ z``.
- ``draw(u, m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w, logits_row, mask_row, V,
  fscratch_row, HAS_MASK, CHUNK, NCH_P2) -> (token int32, its kept weight)``.
- ``invert(w, t) -> (index, weight)`` inverts one block of weights (first cumulative sum > t, but not
  past the last positive weight, else 0); residual draws can use it block by block.

Scratch (``row_scratch``): per program, reused row after row: ``fscratch`` float32 ``[3 * NCH_P2]``
(chunk maxima, chunk sums of exp relative to the chunk maximum, kept chunk masses) and ``iscratch``
int64 ``[2 * CAND]`` (packed candidates, then the kept tokens for their sort by id; chunk ids). The
functions put ``tl.debug_barrier`` around it: call them from uniform control flow (a branch on row-level
scalars is fine). ``row_config(V)`` gives the constexprs; pass them by name (``**cfg``) to the kernel and
on to ``describe_row`` / ``draw``.

How (invariants are commented in the code): pass 1 takes the row max and argmax and stores the
maxima (and, where needed, exp-sums) of chunks of ``CHUNK`` tokens. Top-k: the k-th largest logit
is at least the k-th largest chunk maximum ``c``; only the tokens ``>= c`` of the chunks whose
maximum is ``>= c`` are gathered (a few thousand reads), sorted in registers as packed 64-bit
(logit key, id) pairs (in the fewest of 64, 128 or 256 slots that hold them), and cut (top-p, min-p)
there. Top-p alone first tries the same with (at least) the ``NUCLEUS`` most likely tokens; a nucleus
not among them is found by a 16-ary search over the logits' order keys (one pass per step, each counting
mass and tokens above 16 pivots, evenly spaced in value while the range spans several binades, from a
bound below which the tokens cannot hold ``1 - top_p`` of the mass) until at most ``CAND`` tokens remain
undecided, which are then gathered and sorted (or, when they all tie, a pass over the ties in id order
picks the cut).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_NO_ID = tl.constexpr(2**31 - 1)  # padding id: after every token id
_INT32_MIN = tl.constexpr(-(2**31))  # below every order key
_INT32_MAX = tl.constexpr(2**31 - 1)
_EMPTY = tl.constexpr(-(2**63))  # an empty candidate slot: after every packed candidate (descending)
_NO_CAND = tl.constexpr((2**31 - 1) << 32)  # a kept-token slot without a token (id order): id _NO_ID, weight 0
_UNDERFLOW = tl.constexpr(110.0)  # exp(-110) rounds to 0 in float32: logits below m - 110 T weigh nothing
_WIDE_KEYS = tl.constexpr(1 << 24)  # a key range over more than two binades: pivots go by value

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
    in that without spilling (``tests/helpers/compile_kernels.py`` shows it). 1: no limit. Read once, when the
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
    """The scratch of ``programs`` programs: float32 ``[programs, 3 * NCH_P2]``, int64 ``[programs, 2 * CAND]``."""
    return (
        torch.empty(programs, 3 * cfg["NCH_P2"], dtype=torch.float32, device=device),
        torch.empty(programs, 2 * cfg["CAND"], dtype=torch.int64, device=device),
    )


def parts_per_row(rows: int, V: int, cfg: dict, device: torch.device) -> int:
    """Parts that pass 1 over each of ``rows`` rows is split into (:func:`scan_parts`), 0 for none: on a
    GPU, as many as fill its SMs' program slots (:data:`PROGRAMS_PER_SM` each), at most one per tile and
    :data:`MAX_PARTS`, when that is at least 2. One program per row reads a row at the rate one SM draws,
    so a small batch (sampling at B=1 or 64 of a 132-SM GPU, a chain's 5 rows at B=1) would leave most
    of the GPU idle. Off a GPU (the interpreter), never."""
    if device.type != "cuda":
        return 0
    slots = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    parts = min(slots // max(rows, 1), triton.cdiv(V, cfg["BLOCK_CHUNKS"] * cfg["CHUNK"]), MAX_PARTS.value)
    return parts if parts >= 2 else 0


def scan_parts(logits: torch.Tensor, strides: tuple[int, int], mask: torch.Tensor, mask_strides: tuple[int, int],
               num_drafts: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor,
               fscratch: torch.Tensor, rows: int, K1: int, parts: int | None, has_mask: bool, cfg: dict,
               greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pass 1 over ``rows`` rows, each split into ``parts`` programs (0 to :data:`MAX_PARTS`; None:
    :func:`parts_per_row`): row ``r`` is
    row ``r % K1`` of request ``r // K1`` (``strides``: of the request and row dimensions of ``logits``,
    and of ``mask``; with ``num_drafts``, int ``[rows / K1]``, only rows up to it); its parameters are at
    index ``r`` (``greedy``: every row is greedy, the parameters are not read). Leaves the chunk results in
    each row's ``fscratch`` row; returns the parts' maxima, float32 and int32 ``[rows * parts]``, and
    ``parts``, for ``describe_row_in_parts`` / ``first_pass`` (``parts`` 0: launches nothing, the tensors
    are empty)."""
    V = logits.shape[-1]
    parts = parts_per_row(rows, V, cfg, logits.device) if parts is None else parts
    part_m = torch.empty(rows * parts, dtype=torch.float32, device=logits.device)
    part_arg = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    if parts == 0:
        return part_m, part_arg, parts
    _scan_parts_kernel[(rows, parts)](
        logits, mask, logits if num_drafts is None else num_drafts, temperature, top_k, part_m, part_arg, fscratch,
        K1, V, parts, *strides, *mask_strides, GREEDY=greedy, HAS_ND=num_drafts is not None, HAS_MASK=has_mask,
        CHUNK=cfg["CHUNK"], BLOCK_CHUNKS=cfg["BLOCK_CHUNKS"], NCH_P2=cfg["NCH_P2"], **launch_options(8),
        enable_fp_fusion=False)  # compiled as the kernels that finish the pass are
    return part_m, part_arg, parts


# ----------------------------------------------------------------------------- elements


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


@triton.jit
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


@triton.jit
def _scan_parts_kernel(
    logits_ptr, mask_ptr, nd_ptr, temperature_ptr, top_k_ptr, part_m_ptr, part_arg_ptr, fscratch_ptr,
    K1, V, parts, stride_lb, stride_lk, stride_mb, stride_mk,
    GREEDY: tl.constexpr, HAS_ND: tl.constexpr, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr,
):
    """Program (r, s): pass 1 over part s of row r (row i = r % K1 of request b = r // K1; with ``HAS_ND``
    only rows i <= num_drafts[b]): the chunk results into the row's scratch, (max, argmax) at
    ``part_*[r * parts + s]``. Parts are runs of whole tiles, in order. ``GREEDY``: every row is greedy
    (the parameters are not read)."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b = r // K1
    i = r % K1
    if (i <= tl.minimum(tl.maximum(tl.load(nd_ptr + b), 0), K1 - 1)) if HAS_ND else (i >= 0):
        sampled, inv_t, _, top_k_on, _, _ = row_settings(V, 0.0 if GREEDY else tl.load(temperature_ptr + r),
                                                         0 if GREEDY else tl.load(top_k_ptr + r), 1.0, 0.0)
        tile = BLOCK_CHUNKS * CHUNK
        per = tl.cdiv(tl.cdiv(V, tile), parts) * tile
        lo = tl.minimum(s * per, V)
        m, arg = scan_part(logits_ptr + b * stride_lb + i * stride_lk, mask_ptr + b * stride_mb + i * stride_mk, V,
                           lo, tl.minimum(lo + per, V), inv_t, sampled & (top_k_on == 0),
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


@triton.jit
def kept_mass(logits_row, mask_row, V, m, inv_t, tau, id_cut, w_min, write, fscratch_row,
              HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr):
    """A pass summing the kept weights: returns z; if ``write``, stores each chunk's kept mass at
    ``fscratch_row[2 * NCH_P2 + c]``."""
    n_chunks = tl.cdiv(V, CHUNK)
    local = tl.arange(0, BLOCK_CHUNKS)
    tile = local[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    z = 0.0
    for start in tl.range(0, V, BLOCK_CHUNKS * CHUNK, num_stages=STAGES):
        offs = start + tile
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        mass = tl.sum(kept_weights(x, offs, m, inv_t, tau, id_cut, w_min), axis=1)
        if write:
            chunk = start // CHUNK + local
            tl.store(fscratch_row + 2 * NCH_P2 + chunk, mass, mask=chunk < n_chunks)
        z += tl.sum(mass, axis=0)
    return z


# ----------------------------------------------------------------------------- candidates in registers


@triton.jit
def append_candidates(iscratch_row, n, sel, key, ids, CAND: tl.constexpr):
    """Append the selected entries of a 2-D tile to the candidate list at ``iscratch_row[n:CAND]`` as
    packed int64 ``key << 32 | (2**31 - 1 - id)``, larger = earlier in order (the low word is computed
    as ``id ^ (2**31 - 1)``); returns the new count (which may exceed CAND: entries past it are dropped)."""
    s = sel.to(tl.int32)
    per_row = tl.sum(s, axis=1)
    pos = n + (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(s, axis=1) - 1
    packed = (key.to(tl.int64) << 32) | (ids ^ _INT32_MAX).to(tl.int64)
    tl.store(iscratch_row + pos, packed, mask=sel & (pos < CAND))
    return n + tl.sum(per_row, axis=0)


@triton.jit
def _sort_in_place(iscratch_row, n, pad, SIZE: tl.constexpr, DESCENDING: tl.constexpr):
    """Sort ``iscratch_row[:n]`` (int64, ``n <= SIZE``) in place, in registers of ``SIZE`` slots."""
    j = tl.arange(0, SIZE)
    v = tl.sort(tl.load(iscratch_row + j, mask=j < n, other=pad), descending=DESCENDING)
    tl.debug_barrier()  # every thread has loaded before any stores
    tl.store(iscratch_row + j, v, mask=j < n)


@triton.jit
def sorted_prefix(iscratch_row, n, pad, DESCENDING: tl.constexpr, CAND: tl.constexpr):
    """``iscratch_row[:n]`` (int64, ``n <= CAND``, stored before a barrier) sorted, then ``pad`` (which sorts
    after them): ``[CAND]``; rewrites ``iscratch_row[:n]``. Sorted in ``CAND / 4`` or ``CAND / 2`` slots when
    ``n`` fits, then read back at full size: a sort's steps and barriers grow with its size (sm_90, 8 warps,
    loading, sorting and storing 64 int64: 248 instructions, 2 barriers; 256: 456 and 17), and a top-k of
    50 or its kept tokens nearly always fit in 64."""
    if n <= CAND // 4:
        _sort_in_place(iscratch_row, n, pad, CAND // 4, DESCENDING)
    elif n <= CAND // 2:
        _sort_in_place(iscratch_row, n, pad, CAND // 2, DESCENDING)
    else:
        _sort_in_place(iscratch_row, n, pad, CAND, DESCENDING)
    tl.debug_barrier()
    j = tl.arange(0, CAND)
    return tl.load(iscratch_row + j, mask=j < n, other=pad)


@triton.jit
def sorted_candidates(iscratch_row, n, CAND: tl.constexpr):
    """The first ``n`` packed candidates, sorted in order (logit desc, id asc), then empty slots;
    unpacked: (ids int32, logits float32) ``[CAND]``."""
    packed = sorted_prefix(iscratch_row, n, _EMPTY, True, CAND)
    ids = (packed & _INT32_MAX).to(tl.int32) ^ _INT32_MAX
    return ids, key_value((packed >> 32).to(tl.int32))


@triton.jit
def top_candidates(logits_row, mask_row, V, k, fscratch_row, iscratch_row, HAS_MASK: tl.constexpr,
                   CHUNK: tl.constexpr, NCH_P2: tl.constexpr, GROUP: tl.constexpr, CAND: tl.constexpr):
    """Gather the k most likely tokens (and the next ones down to a bound) using pass 1's chunk maxima.

    Returns (c_key, n, ok): every token with order key >= c_key is gathered into the candidate list
    (n of them), and the k-th largest logit is >= c_key, so the candidates are the n most likely
    tokens. ok: the list holds them all (n <= CAND).
    """
    n_chunks = tl.cdiv(V, CHUNK)
    c = tl.arange(0, NCH_P2)
    valid = c < n_chunks
    ck = tl.where(valid, order_key(tl.load(fscratch_row + c, mask=valid, other=float("-inf"))), _INT32_MIN)
    # bisection for a bound lo at or below the k-th largest chunk maximum; invariant: n_lo = #chunks with
    # key >= lo >= k (or lo is the minimum), and the k-th largest is <= hi. Stops once at most `enough` chunks
    # are >= lo: k, or up to a gather step's GROUP while that is a sixteenth of the row's chunks at most (the
    # bound then stays in the row's top tail, so about as few tokens reach it; half the steps at k=50)
    lo = tl.min(ck, axis=0).to(tl.int64)
    hi = tl.max(ck, axis=0).to(tl.int64)
    n_lo = n_chunks
    enough = tl.maximum(k, tl.minimum(GROUP, n_chunks // 16))
    while (lo < hi) & (n_lo > enough):
        mid = lo + (hi - lo + 1) // 2
        n_mid = tl.sum((ck >= mid).to(tl.int32), axis=0)
        up = n_mid >= k
        lo = tl.where(up, mid, lo)
        n_lo = tl.where(up, n_mid, n_lo)
        hi = tl.where(up, hi, mid - 1)
    flagged = valid & (ck >= lo)
    n_flagged = tl.sum(flagged.to(tl.int32), axis=0)
    # k flagged chunks each hold a token >= their smallest maximum: the k-th largest logit is >= it
    c_key = tl.where(n_flagged >= k, tl.min(tl.where(flagged, ck, _INT32_MAX), axis=0), _INT32_MIN)
    pos = tl.cumsum(flagged.to(tl.int32), axis=0) - 1
    tl.store(iscratch_row + CAND + pos, c.to(tl.int64), mask=flagged & (pos < CAND))
    tl.debug_barrier()
    n_read = tl.where(n_flagged <= CAND, n_flagged, 0)  # too many chunks: the caller falls back
    g = tl.arange(0, GROUP)
    n = 0
    for start in range(0, n_read, GROUP):
        cid = tl.load(iscratch_row + CAND + start + g, mask=start + g < n_read, other=n_chunks).to(tl.int32)
        ids = cid[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        x = load_logits(logits_row, mask_row, ids, V, HAS_MASK)
        n = append_candidates(iscratch_row, n, (ids < V) & (order_key(x) >= c_key), order_key(x), ids, CAND)
    tl.debug_barrier()
    return c_key, n, (n_flagged <= CAND) & (n <= CAND)


@triton.jit
def cut_candidates(ids, x, limit, m, inv_t, own_mass, top_p, w_min, z_all, iscratch_row, CAND: tl.constexpr):
    """Top-p and min-p among the first ``limit`` candidates (in order): the top-k set, or (top-p alone)
    the most likely tokens. The top-p target is ``top_p`` times their own mass if ``own_mass``, else
    times ``z_all``, the row's mass. The kept tokens are sorted by id in ``iscratch_row`` (rewritten).

    Returns (reached, tau, id_cut, z, cand_ids, cand_w): reached = the prefix reaching the target lies
    among the candidates (always with own_mass or top_p >= 1); the kept tokens in id order.
    """
    j = tl.arange(0, CAND)
    live = j < limit
    w = tl.where(live, tl.exp((x - m) * inv_t), 0.0)
    cum = tl.cumsum(w, axis=0)
    mass = tl.sum(tl.where(j == limit - 1, cum, 0.0), axis=0)
    target = top_p * tl.where(own_mass, mass, z_all)
    # keep candidate j iff the mass strictly before it is < target: j <= #(cum < target)
    last = tl.where(top_p < 1.0, tl.minimum(tl.sum((live & (cum < target)).to(tl.int32), axis=0), limit - 1),
                    limit - 1)
    keep = (j <= last) & (w >= w_min)
    kept_w = tl.where(keep, w, 0.0)
    tau = tl.sum(tl.where(j == last, x, 0.0), axis=0)
    id_cut = tl.sum(tl.where(j == last, ids, 0), axis=0)
    # the kept tokens in id order, each with its weight (non-negative float32 bits, below 2**31), sorted from
    # the start of the scratch (a NaN logit, first in order, is not kept: the kept ones are packed there)
    packed = (ids.to(tl.int64) << 32) | kept_w.to(tl.int32, bitcast=True).to(tl.int64)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # the candidates have been read
    tl.store(iscratch_row + pos, packed, mask=keep)
    tl.debug_barrier()
    packed = sorted_prefix(iscratch_row, tl.sum(keep.to(tl.int32), axis=0), _NO_CAND, False, CAND)
    cand_ids = (packed >> 32).to(tl.int32)
    cand_w = (packed & _INT32_MAX).to(tl.int32).to(tl.float32, bitcast=True)
    reached = (top_p >= 1.0) | (mass >= target)
    return reached, tau, id_cut, tl.sum(kept_w, axis=0), cand_ids, cand_w


# ----------------------------------------------------------------------------- search for a pivot


@triton.jit
def _contribution(x, ids, m, inv_t, by_count, tau0, id0):
    """Each token's contribution to a prefix's size: 1 (by_count) or its weight, inside the prefix
    (tau0, id0), else 0."""
    w = tl.where(by_count, 1.0, tl.exp((x - m) * inv_t))
    return tl.where(in_prefix(x, ids, tau0, id0), w, 0.0)


@triton.jit
def _above_pivots(logits_row, mask_row, V, m, inv_t, by_count, tau0, id0, pivots,
                  HAS_MASK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """One pass: for each pivot key, the contribution and the number of prefix tokens with key >= it.

    Summed per token slot of the block and across the slots once, after the pass: an iteration then needs no
    exchange between warps (two reductions of NPIV values per block made the pass issue-bound, several times
    slower than the row's read); keys are compared as int32 (the pivots lie between two keys)."""
    piv = pivots.to(tl.int32)[:, None]
    s = tl.zeros([NPIV, SEARCH_BLOCK], tl.float32)  # pivots first: each thread compares its tokens with all
    cnt = tl.zeros([NPIV, SEARCH_BLOCK], tl.int32)
    for start in tl.range(0, V, SEARCH_BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, SEARCH_BLOCK)
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        w = tl.where(by_count, 1.0, tl.exp((x - m) * inv_t))
        # a token outside the prefix (or past the row) takes the least key, below every pivot (each above the
        # search's lower bound, itself a key): it adds to no sum, with no test per pivot
        key = tl.where(in_prefix(x, offs, tau0, id0) & (offs < V), order_key(x), _INT32_MIN)
        above = key[None, :] >= piv
        s += tl.where(above, w[None, :], 0.0)
        cnt += above.to(tl.int32)
    return tl.sum(s, axis=1), tl.sum(cnt, axis=1)


@triton.jit
def _tie_cut(logits_row, mask_row, V, m, inv_t, by_count, target, s_hi, tau, tau0, id0,
             HAS_MASK: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """The id of the first token (in id order) at exactly ``tau`` in the prefix (tau0, id0) where
    ``s_hi`` plus the ties' running contribution reaches ``target``; V if none does (all ties kept)."""
    carry = s_hi
    id_cut = V
    start = 0
    while (start < V) & (id_cut == V):
        offs = start + tl.arange(0, SEARCH_BLOCK)
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        tie = (x == tau) & (offs < V)
        c = tl.where(tie, _contribution(x, offs, m, inv_t, by_count, tau0, id0), 0.0)
        tie = tie & in_prefix(x, offs, tau0, id0)
        cum = carry + tl.cumsum(c, axis=0)
        id_cut = tl.min(tl.where(tie & (cum >= target), offs, V), axis=0)
        carry += tl.sum(c, axis=0)
        start += SEARCH_BLOCK
    return id_cut


@triton.jit
def select_pivot(logits_row, mask_row, V, m, inv_t, by_count, target, tau0, id0, lo, hi, iscratch_row,
                 HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, CAND: tl.constexpr,
                 SEARCH_BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """The end (tau, id_cut) of the smallest prefix of the order, within the prefix (tau0, id0), whose
    contribution (tokens if ``by_count``, else weights) reaches ``target``; several passes.

    lo, hi: int64 order keys with: the tokens with key >= lo contribute >= target, and the end's key
    is <= hi. (When rounding breaks the first, the whole prefix (tau0, id0) above lo is kept.)
    """
    # invariant: S(lo) >= target > S(hi + 1) = s_hi, S(k) = contribution of the tokens with key >= k;
    # the end's key is in [lo, hi]; n_lo, n_hi: the numbers of tokens with key >= lo, > hi.
    s_hi = 0.0
    n_hi = 0
    n_lo = _INT32_MAX  # unknown until a pivot reaches the target
    lo = tl.minimum(lo, hi)
    j = tl.arange(0, NPIV) + 1
    while (hi > lo) & (n_lo - n_hi > CAND):
        pivots = lo + ((hi - lo) * j + NPIV - 1) // NPIV  # in (lo, hi], the last one = hi
        # a range over several binades (or across 0) in even steps of value: even steps of key would spend
        # most pivots on the many binades of small values, about a pass more on a wide nucleus
        v_lo = key_value(lo)
        v_hi = key_value(hi)
        by_value = (hi - lo > _WIDE_KEYS) & (v_lo > float("-inf")) & (v_hi < float("inf"))
        v_lo = tl.where(by_value, v_lo, 0.0)
        step = tl.where(by_value, v_hi, 0.0) / NPIV - v_lo / NPIV  # no overflow
        by_value_pivots = tl.minimum(tl.maximum(order_key(v_lo + step * j.to(tl.float32)).to(tl.int64), lo + 1), hi)
        pivots = tl.where(by_value & (j < NPIV), by_value_pivots, pivots)
        s, cnt = _above_pivots(logits_row, mask_row, V, m, inv_t, by_count, tau0, id0, pivots,
                               HAS_MASK, SEARCH_BLOCK, NPIV)
        reach = s >= target
        lo = tl.max(tl.where(reach, pivots, lo), axis=0)
        n_lo = tl.min(tl.where(reach, cnt, n_lo), axis=0)
        s_hi = tl.max(tl.where(reach, s_hi, s), axis=0)  # S at the smallest pivot short of the target
        n_hi = tl.max(tl.where(reach, n_hi, cnt), axis=0)
        hi = tl.min(tl.where(reach, hi, pivots - 1), axis=0)
    tau = key_value(lo)
    id_cut = V
    if n_lo - n_hi <= CAND:
        # the undecided tokens (key in [lo, hi]) fit in registers: gather, sort, cut
        local = tl.arange(0, BLOCK_CHUNKS)
        tile = local[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        n = 0
        tl.debug_barrier()  # earlier candidates may still be read
        for start in tl.range(0, V, BLOCK_CHUNKS * CHUNK, num_stages=STAGES):
            offs = start + tile
            x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
            key = order_key(x)
            sel = (offs < V) & in_prefix(x, offs, tau0, id0) & (key >= lo) & (key <= hi)
            n = append_candidates(iscratch_row, n, sel, key, offs, CAND)
        tl.debug_barrier()
        ids, x = sorted_candidates(iscratch_row, n, CAND)
        jc = tl.arange(0, CAND)
        c = tl.where(jc < n, _contribution(x, ids, m, inv_t, by_count, tau0, id0), 0.0)
        cum = s_hi + tl.cumsum(c, axis=0)
        last = tl.maximum(tl.minimum(tl.sum(((jc < n) & (cum < target)).to(tl.int32), axis=0), n - 1), 0)
        tau = tl.sum(tl.where(jc == last, x, 0.0), axis=0)
        id_cut = tl.sum(tl.where(jc == last, ids, 0), axis=0)
    else:
        # lo == hi: more than CAND tokens tie at the end's logit; cut the ties in id order
        id_cut = _tie_cut(logits_row, mask_row, V, m, inv_t, by_count, target, s_hi, tau, tau0, id0,
                          HAS_MASK, SEARCH_BLOCK)
    return tau, id_cut


# ----------------------------------------------------------------------------- the descriptor and the draw


@triton.jit
def describe_row(logits_row, mask_row, V, temperature, top_k, top_p, min_p, fscratch_row, iscratch_row,
                 HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr,
                 CAND: tl.constexpr, NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                 NPIV: tl.constexpr):
    """The processed distribution of one row (see the module docstring).

    temperature float32 (0 = greedy), top_k int (<= 0 or >= V: off), top_p float32 (>= 1: off),
    min_p float32: scalars. Returns (m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w).
    """
    return describe_row_in_parts(logits_row, mask_row, V, temperature, top_k, top_p, min_p, fscratch_row,
                                 iscratch_row, fscratch_row, iscratch_row, 0, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2,
                                 CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)


@triton.jit
def describe_row_in_parts(logits_row, mask_row, V, temperature, top_k, top_p, min_p, fscratch_row, iscratch_row,
                          part_m_row, part_arg_row, parts, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr, CAND: tl.constexpr,
                          NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                          NPIV: tl.constexpr):
    """:func:`describe_row`, where ``parts > 0`` says that :func:`scan_parts` has done pass 1 (the chunk
    results in ``fscratch_row``, the parts' maxima at ``part_m_row`` / ``part_arg_row``); bit for bit the
    same descriptor."""
    sampled, inv_t, k, top_k_on, top_p_on, w_min = row_settings(V, temperature, top_k, top_p, min_p)
    tl.debug_barrier()  # the scratch may still be read for a previous row
    row_max, arg = first_pass(logits_row, mask_row, V, inv_t, sampled & (top_k_on == 0), fscratch_row, part_m_row,
                              part_arg_row, parts, HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
    tl.debug_barrier()
    has_mass = (row_max > float("-inf")) & (row_max < float("inf"))
    m = tl.where(has_mass, row_max, 0.0)
    max_key = order_key(row_max).to(tl.int64)
    # greedy: the prefix is the argmax alone
    j = tl.arange(0, CAND)
    tau = row_max
    id_cut = arg
    z = tl.where(has_mass, 1.0, 0.0)
    in_regs = 1
    cand_ids = tl.where(j == 0, arg, _NO_ID)
    cand_w = tl.where(j == 0, z, 0.0)
    if sampled:
        tau = float("-inf")
        id_cut = V
        in_regs = 0
        z_all = 0.0
        if top_k_on == 0:  # the row's mass; plain rows (no cut) also keep the chunk masses for the draw
            z_all = masses_from_sums(fscratch_row, V, m, inv_t, (top_p_on == 0) & (w_min <= 0.0), CHUNK, NCH_P2)
        if top_k_on | top_p_on:
            # the top-k set, or the most likely tokens for a nucleus, in registers
            c_key, n, ok = top_candidates(logits_row, mask_row, V, tl.where(top_k_on, k, NUCLEUS), fscratch_row,
                                          iscratch_row, HAS_MASK, CHUNK, NCH_P2, GROUP, CAND)
            if ok:
                ids, x = sorted_candidates(iscratch_row, n, CAND)
                reached, r_tau, r_id_cut, r_z, r_ids, r_w = cut_candidates(
                    ids, x, tl.where(top_k_on, k, n), m, inv_t, top_k_on, top_p, w_min, z_all, iscratch_row, CAND)
                if reached:
                    tau = r_tau
                    id_cut = r_id_cut
                    z = r_z
                    in_regs = 1
                    cand_ids = r_ids
                    cand_w = r_w
            if in_regs == 0:
                if top_k_on:
                    tau, id_cut = select_pivot(logits_row, mask_row, V, m, inv_t, True, k.to(tl.float32),
                                               float("-inf"), V, c_key.to(tl.int64), max_key, iscratch_row,
                                               HAS_MASK, CHUNK, BLOCK_CHUNKS, CAND, SEARCH_BLOCK, NPIV)
                    if top_p_on:
                        z_k = kept_mass(logits_row, mask_row, V, m, inv_t, tau, id_cut, 0.0, False, fscratch_row,
                                        HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
                        tau, id_cut = select_pivot(logits_row, mask_row, V, m, inv_t, False, top_p * z_k, tau,
                                                   id_cut, order_key(tau).to(tl.int64), max_key, iscratch_row,
                                                   HAS_MASK, CHUNK, BLOCK_CHUNKS, CAND, SEARCH_BLOCK, NPIV)
                else:
                    # a large nucleus. Tokens below m - s T weigh at most e^-s each: with s = ln(V / (1 - top_p)) + 1
                    # they hold at most (1 - top_p) / e of the row's mass z (>= 1, the largest token's weight), so
                    # S(lo) >= top_p z with a margin far above rounding when 1 - top_p >= 1e-3 (else s = 110:
                    # below, every weight rounds to 0); a tighter bracket saves the search passes
                    spread = tl.where(top_p <= 0.999, tl.log(V / (1.0 - top_p)) + 1.0, _UNDERFLOW)
                    lo = order_key(m - (1.0 / inv_t) * tl.minimum(spread, _UNDERFLOW)).to(tl.int64)
                    tau, id_cut = select_pivot(logits_row, mask_row, V, m, inv_t, False, top_p * z_all,
                                               float("-inf"), V, lo, max_key, iscratch_row,
                                               HAS_MASK, CHUNK, BLOCK_CHUNKS, CAND, SEARCH_BLOCK, NPIV)
        if in_regs == 0:
            if top_k_on | top_p_on | (w_min > 0.0):
                z = kept_mass(logits_row, mask_row, V, m, inv_t, tau, id_cut, w_min, True, fscratch_row,
                              HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
            else:
                z = z_all  # masses_from_sums stored the chunk masses
            tl.debug_barrier()
        # a row without mass (its maximum not finite, or a NaN among the kept weights) keeps no token, as in
        # the reference: else its draw would weigh exp(x) from m = 0, a log-probability far above 0
        keeps = has_mass & (z == z)
        tau = tl.where(keeps, tau, float("inf"))
        id_cut = tl.where(keeps, id_cut, -1)
        z = tl.where(keeps, z, 0.0)
        cand_w = tl.where(keeps, cand_w, 0.0)
    return m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w


@triton.jit
def find_chunk(fscratch_row, V, t, CHUNK: tl.constexpr, NCH_P2: tl.constexpr):
    """The chunk holding the draw at cumulative mass ``t`` (the first whose cumulative kept mass exceeds
    t, else the last with mass, else 0) and the mass to go inside it (inf when none exceeded t)."""
    c = tl.arange(0, NCH_P2)
    mass = tl.load(fscratch_row + 2 * NCH_P2 + c, mask=c < tl.cdiv(V, CHUNK), other=0.0)
    cum = tl.cumsum(mass, axis=0)
    first = tl.min(tl.where(cum > t, c, NCH_P2), axis=0)
    last = tl.max(tl.where(mass > 0, c, -1), axis=0)
    before = tl.sum(tl.where(c < first, mass, 0.0), axis=0)
    found = first < NCH_P2
    return tl.where(found, first, tl.maximum(last, 0)), tl.where(found, t - before, float("inf"))


@triton.jit
def draw(u, m, inv_t, tau, id_cut, w_min, z, in_regs, cand_ids, cand_w, logits_row, mask_row, V, fscratch_row,
         HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, NCH_P2: tl.constexpr):
    """Draw from a described row by inversion of the uniform ``u``; returns (token int32 in [0, V),
    its kept weight). Rows in registers draw there; the others read one chunk."""
    t = u * z
    token = 0
    weight = 0.0
    if in_regs != 0:
        cum = tl.cumsum(cand_w, axis=0)
        j = tl.arange(0, cand_w.shape[0])
        # first cumulative weight > t, but not past the last positive weight (0 when none)
        idx = tl.minimum(tl.sum((cum <= t).to(tl.int32), axis=0),
                         tl.sum((cum < tl.max(cum, axis=0)).to(tl.int32), axis=0))
        token = tl.sum(tl.where(j == idx, cand_ids, 0), axis=0)
        weight = tl.sum(tl.where(j == idx, cand_w, 0.0), axis=0)
    else:
        chunk, t_in = find_chunk(fscratch_row, V, t, CHUNK, NCH_P2)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        x = load_logits(logits_row, mask_row, offs, V, HAS_MASK)
        idx, weight = invert(kept_weights(x, offs, m, inv_t, tau, id_cut, w_min), t_in)
        token = chunk * CHUNK + idx
    return tl.where((token >= 0) & (token < V), token, 0), weight
