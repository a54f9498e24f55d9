"""The filters on rows: temperature (the weights ``exp((x - top) / T)``), top-k and greedy on candidates,
top-p and min-p on ordered candidates, min-p alone on dense rows, and the renormalisation.

The rules: docs/design.md, "Sampling"; top-p alone: :mod:`.nucleus`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ..params import RowParams
from .distributions import Part, _take
from .greedy import nan_as_minus_inf
from .masses import (
    _CHUNK,
    MASS_BITS,
    ROW_MASSES,
    chunk_sum_bounds,
    chunk_sums,
    divide_by_,
    draw_in_bounds,
    masses,
    normalised_masses,
    odd_masses,
    row_mass,
    top_p_target,
)
from .rounding import grid_length, in_vector_body
from .scratch import SCRATCH
from .topk import ordered_prefix

_TINY = torch.finfo(torch.float32).tiny
_LOG2E = math.log2(math.e)


def masked_logits(x: Tensor, allowed: Tensor) -> Tensor:
    """``x`` with every token not ``allowed`` (bool, broadcastable to ``x``) at -inf: a new tensor in ``x``'s dtype,
    by a select (on CPU 2.5-3.5x faster than ``masked_fill`` of the negated mask)."""
    return torch.where(allowed, x, float("-inf"))


def _rows_where(mask: Tensor) -> Tensor | None:
    return None if bool(mask.all()) else mask.nonzero()[:, 0]


def _take_params(rp: RowParams, rows: Tensor | None) -> RowParams:
    return rp if rows is None else rp.take(rows)


def _within(outer: Tensor | None, inner: Tensor | None) -> Tensor | None:
    """Rows ``inner`` of the subset ``outer``, as indices into the full batch."""
    if inner is None:
        return outer
    return inner if outer is None else outer[inner]


def _weights(vals: Tensor, top: Tensor, temperature: Tensor, logits: bool, *, shared: bool = False,
             out: Tensor | None = None) -> Tensor:
    """Unnormalised probabilities, at most 1: ``exp((x - top) / T)`` for logits, else x (negative or NaN
    probabilities count as 0) times the power of two that brings the row's largest into [0.5, 1) (exact: the
    masses of :mod:`.masses` need weights in [0, 1]); a new tensor, or at the start of ``out`` (a flat float32
    buffer of at least :func:`~.rounding.grid_length` of the values, which the exponential overwrites).

    From logits, computed as ``2 ** ((x - top) * c)`` with ``c = log2(e) / T`` (float32): a
    subtraction, a multiply (not fused: ATen fuses them in its vectorised loop only, so a
    value's rounding would depend on its place in the tensor, which differs on a shard) and a
    base-2 exponential, which costs half of ``exp`` on CPU. Subtracting first keeps every exponent within a
    rounding of its own size (``x * c - top * c`` rounded each product by up to half a unit of ``top * c``: a
    weight off by up to a factor of 2 where ``|top * c|`` neared ``2**24``), and at most 0 (a weight at most 1).
    The exponential runs over whole iterations of ATen's vectorised loop on every thread
    (:func:`~.rounding.grid_length`, see :func:`in_vector_body`), so that a row's values round the same whatever
    rows come before it.
    top: float32 ``[r, 1]``, the row maximum; a row whose maximum is not finite has no mass.
    temperature: float32 ``[r]``; ``shared``: every row's is the same (a scalar multiply, faster, with the same
    arithmetic).
    """
    if not logits:
        return probability_weights(vals, _clean_top(vals) if vals.numel() else None, out)
    c = _scale(temperature)
    w = _exp2_weights(vals, float(c[0]) if shared and c.numel() else c, top, out)
    finite = torch.isfinite(top)
    if bool(finite.all()):  # every row holds numbers (the usual case): done in one check
        return w
    return w.masked_fill_(~finite, 0.0)  # rows without mass


def probability_weights(vals: Tensor, top: Tensor | None, out: Tensor | None = None) -> Tensor:
    """:func:`_weights` of probability rows ``vals`` float ``[r, C]``: ``top``, their :func:`_clean_top` (None: the
    rows are cleaned first, NaN and +inf counting 0 and negatives 0). Clean rows are scaled in one pass, where
    cleaning takes two more over every value."""
    w = _in_buffer(vals, out)[0]
    if not w.numel():
        return w
    if top is not None:
        return _scale_to_unit(vals, top, w)
    return _scale_to_unit_(torch.nan_to_num(vals, nan=0.0, posinf=0.0, out=w).clamp_(min=0.0))


def _clean_top(vals: Tensor) -> Tensor | None:
    """On CPU, each row's largest value (``[r, 1]``) of probability rows ``vals`` float ``[r, C]`` (C >= 1) whose
    every value is finite and at least 0 (the usual case: such rows need no cleaning); None where some value is NaN
    (it makes its row's minimum NaN), infinite or negative, and on a device (no host sync to decide)."""
    if vals.device.type != "cpu":
        return None
    top = vals.amax(-1, keepdim=True)
    return top if bool(torch.isfinite(top).all() & (vals.amin(-1) >= 0).all()) else None


def _unit_divisor(top: Tensor) -> Tensor | None:
    """float32 ``[r, 1]``: the power of two ``z`` by which each row whose largest value is ``top`` (``[r, 1]``,
    finite, at least 0) divides into [0.5, 1) (the rows ``w / z`` are the weights of :func:`_scale_to_unit`, by the
    same single rounding); None unless every ``z * 2**-32`` is a normal float32, as the masses of ``w / z`` taken in
    one pass need (:func:`specsampler.sampling.masses.sample_by_inversion`)."""
    ex = torch.frexp(top).exponent
    return _power_of_two(ex) if bool(((ex >= -94) & (ex <= 127)).all()) else None


def _power_of_two(e: Tensor) -> Tensor:
    """float32 ``2**e`` of int32 exponents ``e`` in [-126, 127] (normal floats), from their bit patterns."""
    return ((e + 127) << 23).view(torch.float32)


def _scale_to_unit_(w: Tensor) -> Tensor:
    """:func:`_scale_to_unit` of ``w`` in place."""
    return _scale_to_unit(w, w.amax(-1, keepdim=True), w)


def _scale_to_unit(w: Tensor, top: Tensor, out: Tensor) -> Tensor:
    """Rows of ``w`` float32 ``[r, C]`` (finite, non-negative; ``top`` ``[r, 1]`` their largest) times the power of
    two that brings each row's largest into [0.5, 1), into ``out``: ``ldexp(w, e)``. Where every ``2**e`` is a
    normal float32 (each row's largest normal, the usual case) a multiply by it, which rounds the exact product once
    as ``ldexp`` does, at a fiftieth of ATen's ``ldexp`` on CPU (elsewhere ``ldexp``: no host sync to decide)."""
    e = -torch.frexp(top).exponent
    if w.device.type == "cpu" and bool((e.abs() <= 126).all()):
        return torch.mul(w, _power_of_two(e), out=out)
    return torch.ldexp(w, e, out=out)


def _scale(temperature: Tensor) -> Tensor:
    """float32 ``[r, 1]``: ``c = log2(e) / T`` of temperatures float32 ``[r]``."""
    return torch.full_like(temperature, _LOG2E).div_(temperature)[:, None]


def _in_buffer(vals: Tensor, out: Tensor | None) -> tuple[Tensor, Tensor]:
    """A tensor shaped as ``vals`` at the start of ``out`` (or a new buffer; at least :func:`grid_length` of the
    values), and the buffer of that length (whole iterations of ATen's vectorised loops, on every thread)."""
    n = vals.numel()
    whole = grid_length(n)
    buf = torch.empty(whole, device=vals.device) if out is None else out[:whole]
    assert buf.numel() == whole, "a weights buffer shorter than grid_length(values)"
    return buf[:n].view(vals.shape), buf


def _exp2_weights(vals: Tensor, c: Tensor | float, top: Tensor, out: Tensor | None) -> Tensor:
    """:func:`_weights` of logits ``vals`` ``[r, C]`` below their rows' finite maxima ``top`` ``[r, 1]``:
    ``2 ** ((x - top) * c)``, in [0, 1] (``x - top`` rounds to at most 0), in ``out`` (or new)."""
    w, buf = _in_buffer(vals, out)
    torch.sub(vals, top, out=w).mul_(c)
    buf.exp2_()  # the few values past n are not read
    return w


def _normalise_(w: Tensor) -> Tensor:
    """Divide each row (weights in [0, 1]) by its exact sum (:mod:`.masses`), in place; rows without mass
    become 0."""
    return divide_by_(w, row_mass(w, keepdim=True))


def prefix_keep(w: Tensor, ids: Tensor, target: Tensor, m: Tensor | None = None) -> Tensor:
    """bool ``[r, C]``: the candidates in the smallest prefix of the (weight desc, id asc) order whose exact
    mass reaches ``target`` float64 ``[r]`` (:mod:`.masses`): those with less than ``target`` before them.

    w: float32 ``[r, C]`` weights in [0, 1]; ids: int64 ``[r, C]``, distinct in a row (any order); m: their
    masses when the caller has them."""
    m = masses(w) if m is None else m
    keep = (m.cumsum(-1) - m) < target[:, None]  # rows already in that order (candidates in logit order, the usual)
    if w.shape[1] < 2:
        return keep
    # the others, ordered first (each row alone: its neighbours' order costs it nothing); weights of 0 (underflowed,
    # far below the top) may lie in any order: they come after every positive one, the mass before each is the row's,
    # and none is kept either way
    tied = (w[:, 1:] == w[:, :-1]) & (w[:, 1:] > 0)
    unordered = ((w[:, 1:] > w[:, :-1]) | (tied & (ids[:, 1:] < ids[:, :-1]))).any(-1)
    if bool(unordered.any()):
        r = unordered.nonzero()[:, 0]
        w_r, ids_r = w[r], ids[r]
        by_id = ids_r.argsort(dim=-1)
        order = by_id.gather(1, torch.sort(w_r.gather(1, by_id), dim=-1, descending=True, stable=True).indices)
        m_r = masses(w_r.gather(1, order))
        keep[r] = torch.empty_like(keep[r]).scatter_(1, order, (m_r.cumsum(-1) - m_r) < target[r, None])
    return keep


def _cut_candidates(w: Tensor, ids: Tensor, rp: RowParams, z: Tensor | None = None) -> Tensor:
    """top-p (against the mass ``z`` float64 ``[r]``, default the candidates' own) and min-p on candidates.

    w: float32 ``[r, C]`` in (logit desc, id asc) order (the first the largest), ids: their ids. Returns the
    kept weights.
    """
    return _cut_with_mass(w, ids, rp, z)[0]


def _cut_with_mass(w: Tensor, ids: Tensor, rp: RowParams, z: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`_cut_candidates`, also returning the kept weights' row masses float64 ``[r, 1]`` (the candidates'
    masses are taken once, for the cut and the normalisation alike)."""
    m = masses(w)
    keep = None
    if not rp.all_equal("top_p", 1):
        z = m.sum(-1) if z is None else z  # the exact row mass (row_mass)
        keep = (rp.top_p >= 1)[:, None] | prefix_keep(w, ids, top_p_target(rp.top_p, z), m)
    if not rp.all_equal("min_p", 0):  # min-p 0 keeps every weight (all in [0, 1])
        above = w >= rp.min_p[:, None] * w[:, :1]
        keep = above if keep is None else keep & above
    if keep is None:
        return w.clone(), m.sum(-1, keepdim=True)
    return torch.where(keep, w, 0.0), torch.where(keep, m, 0.0).sum(-1, keepdim=True)


def _candidate_weights(vals: Tensor, temperature: Tensor, logits: bool, shared: bool = False) -> Tensor:
    """:func:`_weights` of candidates ``[r, C]`` in (logit desc, id asc) order (the first the row's top). C is
    the widest row's of the batch: the exponential's rounding does not see it, as every value is in the vector
    body of :func:`_weights`'s buffer. ``shared``: every row's temperature is the same."""
    return _weights(vals, vals[:, :1], temperature, logits, shared=shared)


def _part_in_id_order(rows: Tensor | None, ids: Tensor, weights: Tensor, mass: Tensor | None = None,
                      fallback: Tensor | None = None) -> Part:
    """The candidates ``ids`` with their kept ``weights`` (in (logit desc, id asc) order: the kept
    ones first), normalised in that order, where a row's sum does not see how many candidates
    the widest row of the batch took, then put in id order. ``mass``: the kept weights' row masses
    ``[r, 1]`` when the caller has them (:func:`_cut_with_mass`). A row without mass holds its ``fallback``
    (int64 ``[r]``; default 0) as every id: its draw (:class:`Part`)."""
    ids, perm = ids.sort(dim=-1)
    mass = row_mass(weights, keepdim=True) if mass is None else mass
    ids = torch.where(mass > 0, ids, 0 if fallback is None else fallback[:, None])
    return Part(rows, ids, divide_by_(weights, mass).gather(1, perm))


def keep_at_least_(w: Tensor, threshold: Tensor) -> Tensor:
    """``w`` float32 ``[r, C]`` (no NaN) times ``w >= threshold`` (float32 ``[r, 1]``), in place: min-p's cut. On CPU
    in NumPy, the same products: ATen's CPU comparison and multiply by its bools cost 3x NumPy's there."""
    if w.device.type == "cpu" and w.dtype == torch.float32 and threshold.dtype == torch.float32:
        wn = w.numpy()
        np.multiply(wn, wn >= threshold.numpy(), out=wn)
        return w
    return w.mul_(w >= threshold)


def _min_p_normalise_(w: Tensor, rp: RowParams, w_max: Tensor, rows: Tensor | None,
                      mass: Tensor | None = None) -> Tensor:
    """min-p (threshold ``min_p * w_max``, with ``w_max`` ``[r, 1]`` taken at ``rows``) and
    renormalisation, in place. ``mass``: float64 ``[r]``, the rows' masses when the caller has them (a top-p
    cut's kept mass; summed again where min-p drops tokens)."""
    if not rp.all_equal("min_p", 0):
        keep_at_least_(w, rp.min_p[:, None] * _take(w_max, rows))
        mass = None
    return _normalise_(w) if mass is None else divide_by_(w, mass[:, None])


def _bounded_part(rows, x, rp, greedy, logits, min_candidates, columns: Tensor | None = None) -> Part:
    """Greedy and top-k rows: their k (1 for greedy) most likely tokens. ``columns``: int64 ``[r, C]``, the token
    ids of ``x``'s columns, increasing (default: ``0 .. C - 1``)."""
    shared = rp.shared  # every row's parameters, known on the host: no reads of the tensors
    mixed = shared is None or (logits and shared.temperature == 0)  # greedy rows among them
    if not mixed:  # every row top-k: shared.top_k of them
        keep_n = k = int(shared.top_k)
        temperature = rp.temperature
    else:
        keep_n = torch.where(greedy, 1, rp.top_k)
        temperature, k = torch.where(greedy, 1.0, rp.temperature), int(keep_n.max())
    n = max(min_candidates, k)
    vals, ids = ordered_prefix(x, n)
    if not logits and n:  # NaN and +inf probabilities weigh 0 (probability_weights): they lead the order, where
        # they took a candidate's place; such rows are ordered again with them as the 0 they weigh
        _order_again(x, vals, ids, (vals.isnan() | (vals == float("inf"))).any(-1),
                     lambda rows: torch.nan_to_num(rows, nan=0.0, posinf=0.0))
    if logits and mixed and n:  # the greedy choice never takes a NaN (greedy.greedy_ids): NaN leads a
        _order_again(x, vals, ids, greedy & vals[:, 0].isnan(), nan_as_minus_inf)  # row holding one: again without
    if columns is not None:
        ids = columns.gather(1, ids)
    w = _candidate_weights(vals, temperature, logits, shared=isinstance(keep_n, int))
    if not isinstance(keep_n, int) or keep_n < w.shape[1]:  # candidates past a row's k: weight 0
        keep_n = keep_n if isinstance(keep_n, int) else keep_n[:, None]
        w = torch.where(torch.arange(w.shape[1], device=x.device) < keep_n, w, 0.0)
    # a row without mass draws 0 (as a dense row does), a greedy row its argmax (as greedy rows alone do): whatever
    # candidates the batch's largest k leaves it (promise 3)
    fallback = torch.where(greedy, ids[:, 0], 0) if logits and mixed and n else None
    part = _cut_part_on_cpu(rows, ids, w, rp, fallback) if w.device.type == "cpu" else None
    return part if part is not None else _part_in_id_order(rows, ids, *_cut_with_mass(w, ids, rp), fallback)


def _order_again(x: Tensor, vals: Tensor, ids: Tensor, redo: Tensor, read: Callable[[Tensor], Tensor]) -> None:
    """Order the rows ``redo`` (bool ``[r]``) of ``x`` again, as ``read`` gives their values, into their places of
    ``ordered_prefix``'s ``vals`` and ``ids`` (``[r, n]``, in place); only those rows are read again."""
    if bool(redo.any()):
        rows = redo.nonzero()[:, 0]
        vals[rows], ids[rows] = ordered_prefix(read(x[rows]), vals.shape[1])


def _cut_part_on_cpu(rows: Tensor | None, ids: Tensor, w: Tensor, rp: RowParams,
                     fallback: Tensor | None = None) -> Part | None:
    """``_part_in_id_order(rows, ids, *_cut_with_mass(w, ids, rp), fallback)`` on CPU, the same arithmetic in
    NumPy: on a few dozen candidates a row its ops cost a fraction of ATen's, and each is exact (integers in float64,
    one float32 division), so the numbers are the same (tested). None where a weight is NaN (a temperature so small
    that ``log2(e) / T`` overflows): NaN orders otherwise in NumPy's sorts.

    w: float32 ``[r, C]``, weights in [0, 1] in (logit desc, id asc) order; ids: int64, distinct in a row."""
    wn, idn = w.numpy(), ids.numpy()
    if np.isnan(wn).any():
        return None
    m = np.floor(np.clip(wn, 0.0, 1.0) * np.float32(2.0**MASS_BITS)).astype(np.float64)  # masses.masses
    keep = None
    if not rp.all_equal("top_p", 1):  # prefix_keep against masses.top_p_target
        top_p = rp.top_p.numpy()
        z = m.sum(-1)
        target = np.minimum(np.ceil(top_p.astype(np.float64) * z), z)[:, None]
        a, b = wn[:, :-1], wn[:, 1:]
        # not in (weight desc, id asc) order (weights of 0 in any order: as in prefix_keep)
        if ((b > a) | ((b == a) & (b > 0) & (idn[:, 1:] < idn[:, :-1]))).any():
            by_id = np.argsort(idn, axis=-1)
            order = np.take_along_axis(by_id, np.argsort(-np.take_along_axis(wn, by_id, -1), -1, kind="stable"), -1)
            m_in_order = np.take_along_axis(m, order, -1)
            keep = np.empty(wn.shape, dtype=bool)
            np.put_along_axis(keep, order, np.cumsum(m_in_order, -1) - m_in_order < target, -1)
        else:
            keep = np.cumsum(m, -1) - m < target
        keep |= (top_p >= 1)[:, None]
    if not rp.all_equal("min_p", 0):
        above = wn >= rp.min_p.numpy()[:, None] * wn[:, :1]
        keep = above if keep is None else keep & above
    kept, mass = (wn, m) if keep is None else (np.where(keep, wn, np.float32(0.0)), np.where(keep, m, 0.0))
    mass = mass.sum(-1, keepdims=True)
    # masses.divide_by_: the row's mass as a float32 weight (rounded once), rows without mass 0
    probs = kept / np.where(mass > 0, (mass / 2.0**MASS_BITS).astype(np.float32), np.float32(np.inf))
    by_id = np.argsort(idn, axis=-1) + np.arange(idn.shape[0])[:, None] * idn.shape[1]  # flat indices, in id order
    ids_by_id = np.where(mass > 0, idn.reshape(-1)[by_id], 0 if fallback is None else fallback.numpy()[:, None])
    return Part(rows, torch.from_numpy(ids_by_id), torch.from_numpy(probs.reshape(-1)[by_id]))


def _plain_part(rows, x, rp, logits) -> Part:
    """Rows with neither top-k nor top-p: dense, with min-p."""
    w, _ = _plain_weights(x, x.amax(-1, keepdim=True), rp, logits)
    return Part(rows, None, _normalise_(w))


def _plain_weights(x: Tensor, top: Tensor, rp: RowParams, logits: bool, w_max: Tensor | None = None,
                   out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The kept weights of plain rows ``x`` ``[r, C]`` (temperature from their tops ``[r, 1]``, then min-p against
    each row's largest weight, or against ``w_max`` ``[r, 1]`` when given: columns of rows), and that largest weight
    (None without min-p). ``out``: :func:`_weights`'s buffer."""
    w = _weights(x, top, rp.temperature, logits, shared=rp.shared is not None, out=out)
    if rp.all_equal("min_p", 0):
        return w, None
    w_max = w.amax(-1, keepdim=True) if w_max is None else w_max
    return keep_at_least_(w, rp.min_p[:, None] * w_max), w_max


def sample_plain(x: Tensor, rp: RowParams, u: Tensor, step: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The draws of plain rows of logits (temperature and min-p) and their log-probabilities, without keeping
    their distributions: the tokens and log-probabilities of ``process(x, rp, logits=True)`` (:func:`_plain_part`)
    sampled by inversion of ``u``, the same numbers.

    x: float32 ``[R, V]``, or the rows ``rows`` (int64 ``[r]``) of it, read in place (a batch's other rows are of
    other kinds); rp: the rows' parameters; u: float32 ``[R]`` (``[r]``). Returns int64 ``[R]`` and float32 ``[R]``.
    The passes over every value (the weights, the exact row mass, sums of the normalised chunks' masses) run
    ``step`` rows at a time in reused buffers (fresh pages cost more than the passes, and a block stays in the
    CPU's caches), with few other ops a block; then every row's draw is located at once from the chunks' bounds
    (:func:`.masses.draw_in_bounds`), the probabilities at the columns it reads recomputed from the logits: the
    same elementwise arithmetic, so the same values. Rows without a finite maximum (see :func:`_weights`) are redone
    whole after the blocks.
    """
    V = x.shape[1]
    R = x.shape[0] if rows is None else rows.numel()
    shared = rp.shared is not None
    c = _scale(rp.temperature)
    top = x.new_empty(R, 1)
    mass = torch.empty(R, 1, dtype=torch.float64, device=x.device)
    sums = torch.empty(R, -(-V // _CHUNK), dtype=torch.float64, device=x.device)
    w_max = None if rp.all_equal("min_p", 0) else x.new_empty(R, 1)
    for s in range(0, R, step):
        e = min(R, s + step)
        block = x[s:e] if rows is None else torch.index_select(
            x, 0, rows[s:e], out=SCRATCH.get("plain rows", (e - s, V), x.dtype, x.device))
        torch.amax(block, -1, keepdim=True, out=top[s:e])
        out = SCRATCH.get("weights", (grid_length(block.numel()),), torch.float32, x.device)
        # rows without a finite maximum: redone below
        w = _exp2_weights(block, float(c[0]) if shared else c[s:e], top[s:e], out)
        if w_max is not None:
            keep_at_least_(w, rp.min_p[s:e, None] * torch.amax(w, -1, keepdim=True, out=w_max[s:e]))
        mass[s:e] = row_mass(w, keepdim=True, unit=True)
        f = SCRATCH.get(ROW_MASSES, w.shape, torch.float32, x.device)  # free again once row_mass returns
        sums[s:e] = chunk_sums(normalised_masses(w, mass[s:e], f))
    no_top = ~torch.isfinite(top)[:, 0]  # NaN or infinite
    if bool(no_top.any()):
        redo = no_top.nonzero()[:, 0]
        w, row_max = _plain_weights(x[_within(rows, redo)], top[redo], rp.take(redo), True)
        if w_max is not None:  # (None where none of these rows has min-p: a number all the same)
            w_max[redo] = w.amax(-1, keepdim=True) if row_max is None else row_max
        mass[redo] = row_mass(w, keepdim=True)
        sums[redo] = chunk_sums(masses(divide_by_(w, mass[redo])).float())
    lo, hi = chunk_sum_bounds(sums)
    odd = odd_masses(mass)  # drawn exactly (normalised_masses does not apply; never from logits: the top weighs 1)
    lo.masked_fill_(odd, float("nan"))

    def probs(sel: Tensor | None, cols: Tensor | None) -> Tensor:
        """The probabilities of rows ``sel`` (None: all) at columns int64 ``[R, n]`` (None: every column)."""
        src = _within(rows, sel)  # the rows of x
        vals = _take(x, src) if cols is None else x.gather(1, cols) if src is None else x[src[:, None], cols]
        w, _ = _plain_weights(vals, _take(top, sel), _take_params(rp, sel), True,
                              None if w_max is None else _take(w_max, sel))
        return divide_by_(w, _take(mass, sel))

    tokens = draw_in_bounds(lo, hi, u, V, lambda cols: masses(probs(None, cols)),
                            lambda rows: masses(probs(rows, None)))
    return tokens, in_vector_body(torch.log, probs(None, tokens[:, None])[:, 0])
