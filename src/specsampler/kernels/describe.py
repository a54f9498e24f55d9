"""A row of logits processed by its parameters, inside Triton kernels: its descriptor and its draw.

The rules are those of :func:`specsampler.sampling.processing.process` (the reference): vocab mask, temperature
(0 = greedy), top-k, top-p on the top-k-renormalised distribution, min-p, renormalise. :func:`describe_row` gives
a row's descriptor (a few scalars, and the kept tokens in registers when they are few) without sorting the
vocabulary, reading the row once in the common cases (:mod:`.rows` for pass 1, :mod:`.cut` for the end of the
top-k / top-p prefix); :func:`draw` draws from it by inversion, as
:func:`specsampler.sampling.masses.sample_by_inversion` draws from the reference's probabilities.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cut import cut_candidates, pack_kept, select_pivot, sorted_candidates, top_candidates, unpack_kept
from .rows import (
    first_pass,
    invert,
    kept_mass,
    kept_weights,
    load_logits,
    masses_from_sums,
    order_key,
    row_settings,
)

_NO_ID = tl.constexpr(2**31 - 1)  # padding id: after every token id
_UNDERFLOW = tl.constexpr(110.0)  # exp(-110) rounds to 0 in float32: logits below m - 110 T weigh nothing


@triton.jit
def describe_row(logits_row, mask_row, V, temperature, top_k, top_p, min_p, fscratch_row, iscratch_row, cand_out,
                 HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr,
                 CAND: tl.constexpr, NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                 NPIV: tl.constexpr):
    """The processed distribution of one row: its descriptor.

    temperature float32 (0 = greedy), top_k int (<= 0 or >= V: off), top_p float32 (>= 1: off),
    min_p float32: scalars. Returns (m, inv_t, tau, id_cut, w_min, z, in_regs) and stores the kept tokens at
    ``cand_out`` (int64 ``[CAND]``, read by :func:`unpack_candidates`).

    "Order" is (logit desc, id asc). One row and its parameters are described by six scalars:

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

    The descriptor's scalars are ``m, inv_t, tau, id_cut, w_min, z``; when ``in_regs`` (greedy rows and rows
    whose kept set was found among at most ``CAND`` candidates: the usual top-k / small nucleus case), the kept
    tokens are at ``cand_out``, which :func:`unpack_candidates` turns into registers: ``cand_ids`` int32 ``[CAND]``
    in increasing id order, padded with 2**31 - 1, and their weights ``cand_w`` float32 ``[CAND]`` (0 at the
    padding). Otherwise the per-chunk kept masses are in
    ``fscratch_row`` for :func:`draw`. Reads the row once in the common cases (greedy, plain temperature, top-k <=
    CAND with or without top-p, a nucleus among the 64-ish most likely tokens); min-p without top-k/top-p takes a
    second pass, a large nucleus (or top-k > CAND) a few more. :func:`describe_row_in_parts` does the same after
    :func:`specsampler.kernels.rows.scan_parts` has done pass 1 in several programs.

    Scratch (:func:`specsampler.kernels.rows.row_scratch`): per program, reused row after row: ``fscratch`` float32
    ``[3 * NCH_P2]`` (chunk maxima, chunk sums of exp relative to the chunk maximum, kept chunk masses) and
    ``iscratch`` int64, its first ``2 * CAND`` (packed candidates, then the kept tokens for their sort by id; chunk
    ids). The functions put ``tl.debug_barrier`` around it: call them from uniform control flow (a branch on
    row-level scalars is fine). ``rows.row_config(V)`` gives the constexprs; pass them by name (``**cfg``) to the
    kernel and on to ``describe_row`` / ``draw``. Not inlined (:func:`describe_row_in_parts`): one copy of the
    function serves every place a kernel describes a row, which keeps compiling a kernel to seconds.

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
    return describe_row_in_parts(logits_row, mask_row, V, temperature, top_k, top_p, min_p, fscratch_row,
                                 iscratch_row, cand_out, fscratch_row, iscratch_row, 0, HAS_MASK, CHUNK, BLOCK_CHUNKS,
                                 NCH_P2, CAND, NUCLEUS, GROUP, SEARCH_BLOCK, NPIV)


@triton.jit(noinline=True)
def describe_row_in_parts(logits_row, mask_row, V, temperature, top_k, top_p, min_p, fscratch_row, iscratch_row,
                          cand_out, part_m_row, part_arg_row, parts, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_CHUNKS: tl.constexpr, NCH_P2: tl.constexpr, CAND: tl.constexpr,
                          NUCLEUS: tl.constexpr, GROUP: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                          NPIV: tl.constexpr):
    """:func:`describe_row`, where ``parts > 0`` says that :func:`specsampler.kernels.rows.scan_parts` has done
    pass 1 (the chunk results in ``fscratch_row``, the parts' maxima at ``part_m_row`` / ``part_arg_row``); bit
    for bit the same descriptor."""
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
                # a search over the row: top-k by count, then (with top-p) by mass within the top-k prefix; a
                # large nucleus by mass. The nucleus's bound: tokens below m - s T weigh at most e^-s each: with
                # s = ln(V / (1 - top_p)) + 1 they hold at most (1 - top_p) / e of the row's mass z (>= 1, the
                # largest token's weight), so S(lo) >= top_p z with a margin far above rounding when
                # 1 - top_p >= 1e-3 (else s = 110: below, every weight rounds to 0); a tighter bracket saves
                # the search passes
                spread = tl.where(top_p <= 0.999, tl.log(V / (1.0 - top_p)) + 1.0, _UNDERFLOW)
                nucleus_lo = order_key(m - (1.0 / inv_t) * tl.minimum(spread, _UNDERFLOW)).to(tl.int64)
                target = tl.where(top_k_on, k.to(tl.float32), top_p * z_all)
                lo = tl.where(top_k_on, c_key.to(tl.int64), nucleus_lo)
                tau0 = tau
                id0 = id_cut
                for step in range(tl.where(top_k_on & top_p_on, 2, 1)):
                    if step == 1:  # top-p within the top-k prefix found by the first step
                        target = top_p * kept_mass(logits_row, mask_row, V, m, inv_t, tau, id_cut, 0.0, fscratch_row,
                                                   HAS_MASK, CHUNK, BLOCK_CHUNKS, NCH_P2)
                        lo = order_key(tau).to(tl.int64)
                        tau0 = tau
                        id0 = id_cut
                    tau, id_cut = select_pivot(logits_row, mask_row, V, m, inv_t, top_k_on & (step == 0), target, tau0,
                                               id0, lo, max_key, iscratch_row, HAS_MASK, CHUNK, BLOCK_CHUNKS, CAND,
                                               SEARCH_BLOCK, NPIV)
        if in_regs == 0:
            if top_k_on | top_p_on | (w_min > 0.0):
                z = kept_mass(logits_row, mask_row, V, m, inv_t, tau, id_cut, w_min, fscratch_row, HAS_MASK, CHUNK,
                              BLOCK_CHUNKS, NCH_P2)
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
    tl.store(cand_out + j, pack_kept(cand_ids, cand_w))
    return m, inv_t, tau, id_cut, w_min, z, in_regs


@triton.jit
def unpack_candidates(cand_row, CAND: tl.constexpr):
    """The kept tokens that :func:`describe_row` stored at ``cand_row`` (int64 ``[CAND]``,
    :func:`specsampler.kernels.cut.pack_kept`): (cand_ids int32, cand_w float32) ``[CAND]``."""
    return unpack_kept(tl.load(cand_row + tl.arange(0, CAND)))


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
