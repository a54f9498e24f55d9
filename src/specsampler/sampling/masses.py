"""Exact masses: weights held as fixed point, so that every sum over a row, every top-p cut and every draw by
inversion is the same integer whatever the order of the additions: across batches, on any device, and over a
vocabulary split into shards (docs/design.md, "Exact masses", "Vocab-parallel").

A weight ``w`` (float32, a probability or ``exp((x - max) / T)``: at most 1) has the mass ``floor(w * 2**32)``
(NaN and negatives 0, above 1 clamped to 1), an integer held in float64: the sums of a row of up to 2**21 tokens
stay below 2**53, so every partial sum is exact (and float64 runs vectorised where int64 does not). A row's sum
is the sum of its masses; a top-p cut keeps the tokens whose mass before them (in the cut's order) is below
``ceil(top_p * Z)``; a draw inverts ``t = floor(u * Z)`` over the prefix sums. A token lighter than ``2**-32`` of
the row's scale is never drawn (a 24-bit uniform resolves ``2**-24`` of a row in any case).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .scratch import SCRATCH

MASS_BITS = 32
_CHUNK = 256  # columns per chunk in the two-step inversion of wide rows
_SCRATCH_FROM = 1 << 16  # masses of fewer values are allocated (a scratch lookup costs more than the pages)
_ONE = float(2**MASS_BITS)
# 2**-32 as 0-d tensors: an operand given as a Python float is wrapped in a tensor by every call (a few us on the CPU,
# where the generation loop's short rows spend their time in such per-call costs); a CPU scalar serves every device
_UNIT32 = torch.tensor(2.0**-MASS_BITS)
_UNIT64 = torch.tensor(2.0**-MASS_BITS, dtype=torch.float64)
ROW_MASSES = "row masses (float32)"  # the scratch of row_mass's masses, free again once it returns
_ZERO32, _ONE32, _SCALE32 = np.float32(0.0), np.float32(1.0), np.float32(_ONE)


def masses(w: Tensor, scratch: str | None = None) -> Tensor:
    """Masses of float weights in [0, 1] (any shape): ``floor(w * 2**32)``, NaN and negatives 0; integers in
    float64. ``scratch``: build them in the named scratch buffers (a temporary the caller does not keep)."""
    w = w.float()
    scratch = scratch if w.numel() >= _SCRATCH_FROM else None
    f32 = None if scratch is None else SCRATCH.get(scratch + " (float32)", w.shape, torch.float32, w.device)
    # w * 2**32 and its floor are exact in float32 (a power-of-two scale; from 2**24 on a float32 is an integer)
    m = scaled_masses(torch.nan_to_num(w, nan=0.0, out=f32).clamp_(0.0, 1.0))
    return m.double() if scratch is None else SCRATCH.get(scratch, w.shape, torch.float64, w.device).copy_(m)


def scaled_masses(w: Tensor, z: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``floor(fl(w / z) * 2**32)`` float32 (in place in ``w`` unless ``out``), for ``w / z`` non-negative or NaN:
    one pass, as ``trunc(w / (z * 2**-32))`` (scaling by a power of two commutes with rounding; a quotient below
    float32's normal range has mass 0 either way; trunc is floor on non-negatives). ``z``: float32 ``[R, 1]``, or
    None for 1."""
    scale = _UNIT32 if z is None else z * 2.0**-MASS_BITS
    return torch.div(w, scale, rounding_mode="trunc", out=w if out is None else out)


def as_weight(mass: Tensor) -> Tensor:
    """float32 weight of a mass (a sum's: rounded once)."""
    return (mass * _UNIT64).float()  # mass / 2**32, exactly


def row_mass(w: Tensor, keepdim: bool = False, unit: bool = False) -> Tensor:
    """float64 ``[...]``: the mass of each row of weights ``[..., C]`` (an exact integer). ``unit``: every weight is
    in [0, 1] or NaN already (no clamp: one pass fewer)."""
    w = w.float()
    if w.numel() < _SCRATCH_FROM or w.dim() == 0:
        return masses(w).sum(-1, keepdim=keepdim)
    # the masses with NaN kept (one pass fewer than masses()): a row holding a NaN sums to NaN and is redone
    f = SCRATCH.get(ROW_MASSES, w.shape, torch.float32, w.device)
    f = scaled_masses(w, out=f) if unit else scaled_masses(torch.clamp(w, 0.0, 1.0, out=f))
    z = SCRATCH.get("row masses", w.shape, torch.float64, w.device).copy_(f).sum(-1, keepdim)
    nan = z.isnan()
    if bool(nan.any()):
        z[nan] = masses(w[nan.squeeze(-1) if keepdim else nan]).sum(-1)
    return z


def nonnegative_rows(w: Tensor) -> Tensor:
    """bool ``[...]``: whether each row of ``w`` ``[..., C]`` holds no value below 0 and no NaN (a row of no columns
    holds none), from each row's minimum: one read without a temporary, several times cheaper than a comparison of
    every value."""
    if not w.shape[-1]:
        return torch.ones(w.shape[:-1], dtype=torch.bool, device=w.device)
    return w.amin(-1) >= 0  # NaN propagates to the minimum


def has_mass(w: Tensor, keepdim: bool = False) -> Tensor:
    """bool ``[...]``: whether each row of ``w`` ``[..., C]`` has a mass above 0, without summing: a mass
    ``floor(w * 2**32)`` is at least 1 exactly where ``w >= 2**-32`` (NaN: not)."""
    if w.shape[-1] == 0:
        return w.new_zeros(w.shape[:-1] + ((1,) if keepdim else ()), dtype=torch.bool)
    top = w.amax(-1, keepdim=keepdim)  # a maximum is one read (a comparison of every value costs more)
    out = top >= 1 / _ONE
    nan = top.isnan()  # a NaN hides the maximum of the others: compare those rows value by value
    if bool(nan.any()):
        out[nan] = (w[nan.squeeze(-1) if keepdim else nan] >= 1 / _ONE).any(-1)
    return out


def divide_by(w: Tensor, mass: Tensor) -> Tensor:
    """``w / weight(mass)`` per row (``mass`` broadcastable to ``w``), 0 where the mass is 0."""
    z = as_weight(mass)
    return torch.where(mass > 0, w / torch.where(mass > 0, z, 1.0), 0.0)


def divide_by_(w: Tensor, mass: Tensor) -> Tensor:
    """:func:`divide_by` in place (a row without mass becomes 0 where its weights are finite)."""
    return w.div_(torch.where(mass > 0, as_weight(mass), float("inf")))


def normalise(w: Tensor) -> Tensor:
    """Rows ``[..., C]`` divided by their exact sums (a new tensor; rows without mass all 0)."""
    return divide_by(w, row_mass(w, keepdim=True))


def top_p_target(top_p: Tensor, mass: Tensor) -> Tensor:
    """The mass a top-p prefix must reach, ``ceil(top_p * Z)`` (float64), at most ``Z``."""
    return torch.minimum(torch.ceil(top_p.double() * mass), mass)


def draw_target(u: Tensor, mass: Tensor) -> Tensor:
    """The cumulative mass a draw of ``u`` in [0, 1) passes, ``floor(u * Z)`` (float64), in ``[0, Z - 1]`` (0
    when Z is 0)."""
    t = torch.floor(u.double().clamp(0.0, 1.0) * mass)
    return torch.minimum(t, mass - 1).clamp_(min=0)


def invert(cum: Tensor, t: Tensor) -> Tensor:
    """int64 ``[R]``: in each row of inclusive prefix sums ``cum`` ``[R, C]`` (masses), the first column whose sum
    exceeds ``t`` ``[R]`` (a column of positive mass when ``t`` is below the row's mass; else the last column
    of positive mass; 0 for a row without mass)."""
    C = cum.shape[1]
    idx = torch.searchsorted(cum, t[:, None].contiguous(), right=True)
    last = torch.searchsorted(cum, cum[:, -1:].contiguous(), right=False)
    return torch.minimum(idx, last).clamp_(0, max(C - 1, 0))[:, 0]


def sample_by_inversion(weights: Tensor, u: Tensor, unit: bool = False, z: Tensor | None = None) -> Tensor:
    """Index of the first column whose cumulative mass exceeds ``floor(u * Z)``, per row.

    weights: float32 ``[R, C]`` in [0, 1] (need not be normalised; ``unit``: known to hold no value outside
    [0, 1], which spares wide rows a clamp); u: float32 ``[R]`` in [0, 1). ``z``: float32 ``[R, 1]``, powers of
    two whose ``z * 2**-32`` are normal floats: draw from the rows ``weights / z`` instead, each value in [0, 1]
    (wide rows' masses are then taken from ``weights`` in one pass, without the quotients').
    Returns int64 ``[R]`` in ``[0, C)``: never a column without mass when the row has mass; 0 otherwise.
    Wide rows are located from float32 sums of their masses with a certified error bound, and the exact masses
    are summed of one chunk of 256 columns per row; a row where the bound leaves two columns possible (or that
    holds a NaN) is inverted over all its exact masses (:func:`_invert_masses`): the same column either way.
    """
    R, C = weights.shape
    if C == 0 or R == 0:
        return torch.zeros(R, dtype=torch.int64, device=weights.device)
    if C >= 4 * _CHUNK:
        return _draw_certified(weights, u, unit, z)[0]
    return _invert_few(weights if z is None else weights / z, u)


def _invert_few(weights: Tensor, u: Tensor) -> Tensor:
    """:func:`sample_by_inversion` of rows under 1024 columns: over all their exact masses. int64 ``[R]``."""
    cum = masses(weights, "draw masses").cumsum(-1)
    z = cum[:, -1]
    return torch.where(z > 0, _first_above(cum, draw_target(u, z)), 0)  # t < Z: a column of positive mass


def sample_processed(weights: Tensor, u: Tensor) -> Tensor:
    """:func:`sample_by_inversion` of rows that every row has mass in and no value outside [0, 1] (no NaN), with u in
    [0, 1) (the library's uniforms): the same column without the steps only other rows need (a clamp of the weights
    and of u, a row without mass, the end ``t = Z``: ``u Z < Z`` rounds below Z in float64, Z < 2**42). Rows of a short
    vocabulary processed in few ops (:func:`specsampler.sampling.ops._process_small`) are such rows. int64 ``[R]``."""
    cum = prefix_masses(weights)
    return _first_above(cum, u.double().mul_(cum[:, -1]))  # integer sums exceed u Z exactly where they exceed its floor


def prefix_masses(w: Tensor, scratch: Tensor | None = None) -> Tensor:
    """float64 ``[R, C]``: the inclusive prefix sums of the masses of weights ``w`` float32 ``[R, C]``, each in
    [0, 1] (no NaN): exact integers, in two operations (the masses in ``scratch``, a float32 ``[R, C]`` the caller
    no longer needs, or a new tensor; converted to float64 as they are summed)."""
    return torch.cumsum(scaled_masses(w, out=torch.empty_like(w) if scratch is None else scratch), -1,
                        dtype=torch.float64)


def invert_few_on_cpu(weights: Tensor, u: Tensor) -> Tensor:
    """:func:`sample_by_inversion` of rows under 1024 columns on CPU, :func:`_invert_few`'s steps in NumPy: the same
    masses and target (exact integers in float64), tested equal. Cheaper on a batch's candidate parts (a few dozen
    values a row, many rows), and on a lone row in isolation (60 us against 140 over 256 values); but on a lone row of
    a short vocabulary between a model's forwards ATen's steps are (measured in the generation loop: library share
    +2-3%), so only the candidate parts take it. int64 ``[R]``."""
    # fmax drops NaN (and negatives) to 0 and fmin clamps at 1: masses()'s clamp in two calls; the scale is exact
    m = np.floor(np.fmin(np.fmax(weights.float().numpy(), _ZERO32), _ONE32) * _SCALE32)
    cum = np.cumsum(m, -1, dtype=np.float64)
    z = cum[:, -1:]
    t = np.floor(np.minimum(np.maximum(u.numpy(), _ZERO32), _ONE32).astype(np.float64)[:, None] * z)
    t = np.maximum(np.minimum(t, z - 1), 0)  # draw_target's
    # the first column whose cumulative mass exceeds t (t < Z: one of positive mass); a row without mass: 0
    return torch.from_numpy(np.where(z[:, 0] > 0, (cum <= t).sum(-1), 0))


def _sum_error(n: int) -> float:
    """``gamma(n - 1) = (n - 1) u / (1 - (n - 1) u)``, u = 2**-24: a float32 sum of ``n`` non-negative values,
    added in any order, lies within this factor of the exact sum (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., section 4.2)."""
    k = (n - 1) * 2.0**-24
    return k / (1 - k)


_GROUP = 16  # values per float32 sum of masses in the bounds (their error: gamma(15) < 1e-6 of the sum)


def _exact_sum_bounds(s: Tensor, g: float, widen: float) -> tuple[Tensor, Tensor]:
    """Integers ``lo <= S <= hi`` (float64) around an exact sum S of non-negative values whose computed sum ``s``
    lies within the factor ``g`` of it (:func:`_sum_error`), widened by ``widen`` for float64's own rounding."""
    return torch.ceil(s / (1 + g) * (1 - widen)), torch.floor(s / (1 - g) * (1 + widen))


def chunk_mass_bounds(w: Tensor, scratch: str | None = None, unit: bool = False,
                      z: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Bounds on the masses of the chunks of 256 columns of each row, from float32 sums of masses.

    w: float32 ``[R, C]``. Returns float64 ``lo``, ``hi`` ``[R, ceil(C / 256)]`` (integers, ``lo <= mass <=
    hi``; NaN for a chunk holding a NaN) and the masses float32 ``[R, C]`` (exact integers, NaN where ``w``
    is; in the named scratch buffer). Each chunk's masses are summed in float32 by groups of 16 values (16 apart
    in the chunk: the sums add whole slices of it, a vectorised read; consecutive in a last, partial chunk), each
    sum within ``gamma(15)`` of the exact one (:func:`_sum_error`), then the groups' bounds in float64 (exact
    integers; their bounds' float64 divisions widened by ``2**-50`` for their own rounding). ``unit``: every value
    of ``w`` is in [0, 1] or NaN already (no clamp: one pass fewer). ``z``: the masses of ``w / z`` instead
    (:func:`sample_by_inversion`'s powers of two; its quotients in [0, 1], no clamp)."""
    out = None if scratch is None or w.numel() < _SCRATCH_FROM else SCRATCH.get(scratch, w.shape, torch.float32,
                                                                                 w.device)
    if unit or z is not None:
        f = scaled_masses(w, z, out=torch.empty_like(w) if out is None else out)
    else:
        f = scaled_masses(torch.clamp(w, 0.0, 1.0, out=out))
    return (*chunk_sum_bounds(chunk_sums(f)), f)


def chunk_sums(f: Tensor) -> Tensor:
    """float64 ``[R, ceil(C / 256)]``: the chunks' float32 sums by groups of 16 of masses float32 ``f`` ``[R, C]``,
    added in float64 (exactly: integers below 2**53); bounds on the exact sums: :func:`chunk_sum_bounds`."""
    R, C = f.shape
    full = C - C % _CHUNK
    s = f[:, :full].view(R, full // _CHUNK, _GROUP, _CHUNK // _GROUP).sum(2).double().sum(-1)
    if full < C:
        tail = f[:, full:]
        whole = tail.shape[1] - tail.shape[1] % _GROUP
        sums = tail[:, :whole].unflatten(1, (whole // _GROUP, _GROUP)).sum(-1)
        if whole < tail.shape[1]:
            sums = torch.cat([sums, tail[:, whole:].sum(-1, keepdim=True)], 1)
        s = torch.cat([s, sums.double().sum(-1, keepdim=True)], 1)
    return s


def chunk_sum_bounds(s: Tensor) -> tuple[Tensor, Tensor]:
    """Integers ``lo <= M <= hi`` (float64) around the chunks' exact masses M, from :func:`chunk_sums`."""
    return _exact_sum_bounds(s, _sum_error(_GROUP), 2.0**-50)


def normalised_masses(w: Tensor, mass: Tensor, out: Tensor) -> Tensor:
    """The masses of ``divide_by(w, mass)`` (float32 ``[R, C]``, in ``out``) without that division's own pass, for
    weights ``w`` in [0, 1] (or NaN) and their rows' exact masses float64 ``[R, 1]``, each 0 or at least 2**32 (a
    weight of 1 in the row: quotients at most 1; :func:`odd_masses` are the others).

    ``z`` is the mass as a float32 weight (:func:`as_weight`); rows of mass 0 divide to 0, as :func:`divide_by`
    does (:func:`scaled_masses`)."""
    return scaled_masses(w, torch.where(mass > 0, as_weight(mass), float("inf")), out)


def odd_masses(mass: Tensor) -> Tensor:
    """bool: the row masses in ``(0, 2**32)`` (float64), where :func:`normalised_masses` does not apply (the
    quotients may pass 1, which the masses clamp)."""
    return (mass > 0) & (mass < _ONE)


def mass_interval(w: Tensor, group: int = _GROUP) -> tuple[Tensor, Tensor]:
    """Bounds ``lo <= Z <= hi`` on each row's exact mass Z, float64 ``[R]`` integers, from one read of ``w``.

    w: float32 ``[R, C]``, each value in [0, 1] or NaN (weights: a row holding a NaN gets ``[0, inf]``). The
    float32 sums of groups of ``group`` values meet their exact sums within ``gamma(group - 1)``
    (:func:`_sum_error`; 16: below 1e-6; 256: 1.5e-5), their float64
    total within ``2**-30`` (generously), and the masses' floors take less than 1 each: Z lies in
    ``[2**32 S - C, 2**32 S]``, S the exact sum of the row. A group is ``group`` values spread evenly over the
    row (the bound holds for any grouping): the sums add whole slices of the row, a vectorised read.
    """
    R, C = w.shape
    full = C - C % group
    s = w[:, :full].view(R, group, full // group).sum(1).double().sum(-1)
    if full < C:
        s = s + w[:, full:].sum(-1).double()
    lo, hi = _exact_sum_bounds(s * _ONE, _sum_error(min(C, group)), 2.0**-30)
    lo = (lo - C).clamp_(min=0)
    nan = s.isnan()
    return lo.masked_fill_(nan, 0.0), hi.masked_fill_(nan, float("inf"))


def _first_above(cum: Tensor, t: Tensor) -> Tensor:
    """int64 ``[R]``: the first column of ``cum`` ``[R, C]`` (non-decreasing) greater than ``t`` ``[R]`` (C if
    none)."""
    return torch.searchsorted(cum, t[:, None].contiguous(), right=True)[:, 0]


def _draw_certified(w: Tensor, u: Tensor, unit: bool = False, z: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`sample_by_inversion` of rows of at least 1024 columns: :func:`draw_in_bounds` over the bounds of
    :func:`chunk_mass_bounds` (``unit``, ``z``: as there) and the exact masses they come from; and the chunks' upper
    bounds' row sums float64 ``[R]``: 0 exactly where the row's mass is (a mass of 1 or more makes its group's
    float32 sum at least 1), NaN for a row holding a NaN."""
    lo, hi, m = chunk_mass_bounds(w, "draw masses", unit, z)
    token = draw_in_bounds(lo, hi, u, w.shape[1], lambda cols: m.gather(1, cols),
                           lambda rows: torch.nan_to_num(m.index_select(0, rows), nan=0.0).double())
    return token, hi.sum(-1)


def sample_with_mass(weights: Tensor, u: Tensor, unit: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`sample_by_inversion` and :func:`has_mass` of the same rows, the second from the first's pass over wide
    rows. ``unit``: every weight is in [0, 1] or NaN already (the masses need no clamp). Returns int64 ``[R]``, bool
    ``[R]``."""
    R, C = weights.shape
    if R == 0 or C < 4 * _CHUNK:
        return sample_by_inversion(weights, u), has_mass(weights)
    token, upper = _draw_certified(weights, u, unit)
    mass = upper > 0
    nan = upper.isnan()  # a row holding a NaN: compared value by value
    if bool(nan.any()):
        mass[nan] = has_mass(weights[nan])
    return token, mass


def draw_in_bounds(lo: Tensor, hi: Tensor, u: Tensor, C: int, column_masses, row_masses) -> Tensor:
    """:func:`sample_by_inversion` of rows of ``C`` columns located from bounds on their chunks' masses.

    lo, hi: float64 ``[R, ceil(C / 256)]``, ``lo <= mass <= hi`` of each chunk of 256 columns (integers; NaN: the
    row is drawn exactly); u: float32 ``[R]``. ``column_masses(cols)``: the exact masses (float, NaN where the row
    holds one) at columns int64 ``[R, 256]`` in ``[0, C)``; ``row_masses(rows)``: the exact masses float64 ``[r, C]``
    of rows int64 ``[r]`` (NaN as 0). Returns int64 ``[R]``.

    With the chunk bounds the row's mass Z lies in ``[sum lo, sum hi]`` and ``t = floor(u * Z)`` (monotone in Z)
    between the two ends' targets; the draw's chunk (the first whose prefix mass exceeds t) is known when the first
    chunk whose upper prefix exceeds the lowest t is also the first whose lower prefix exceeds the highest t. Inside
    it, the exact masses of its 256 columns give the column, known when the offset ``t - (mass before the chunk)``,
    in its interval, does not straddle a column's boundary. Rows where either is not known are inverted over all
    their exact masses (:func:`_invert_masses`): the same column either way.
    """
    low_cum, high_cum = lo.cumsum(-1), hi.cumsum(-1)
    t_low, t_high = draw_target(u, low_cum[:, -1]), draw_target(u, high_cum[:, -1])
    chunk = _first_above(high_cum, t_low)
    known = (low_cum[:, -1] > 0) & (chunk == _first_above(low_cum, t_high))  # NaN: False
    chunk = chunk.clamp_(max=lo.shape[1] - 1)
    before = (chunk - 1).clamp(min=0)[:, None]
    low_before = torch.where(chunk > 0, low_cum.gather(1, before)[:, 0], 0.0)
    high_before = torch.where(chunk > 0, high_cum.gather(1, before)[:, 0], 0.0)
    cols = chunk[:, None] * _CHUNK + torch.arange(_CHUNK, device=lo.device)
    inner = torch.where(cols < C, column_masses(cols.clamp(max=C - 1)), 0.0).double().cumsum(-1)
    col = _first_above(inner, t_low - high_before)
    known &= (col == _first_above(inner, t_high - low_before)) & (col < _CHUNK)
    token = (chunk * _CHUNK + col).clamp_(max=C - 1)
    if not bool(known.all()):
        redo = (~known).nonzero()[:, 0]
        token[redo] = _invert_masses(row_masses(redo), u[redo])
    return token


def _invert_masses(m: Tensor, u: Tensor) -> Tensor:
    """:func:`sample_by_inversion` over exact masses float64 ``[R, C]``: the masses of chunks of 256 columns,
    then inside the chunk found (the same column as over the whole row's prefix sums: the sums are exact)."""
    R, C = m.shape
    chunks = (torch.nn.functional.pad(m, (0, -C % _CHUNK)) if C % _CHUNK else m).view(R, -(-C // _CHUNK), _CHUNK)
    csum = chunks.sum(-1).cumsum(-1)
    t = draw_target(u, csum[:, -1])
    c = invert(csum, t)
    before = torch.where(c > 0, csum.gather(1, (c - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = chunks[torch.arange(R, device=m.device), c]
    return (c * _CHUNK + invert(inner.cumsum(-1), t - before)).clamp_(max=C - 1)
