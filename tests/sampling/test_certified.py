"""Decisions on exact masses taken from float32 sums with certified error bounds (sampling/masses.py: bounds on
row and chunk masses, the draw by inversion; sampling/nucleus.py: the top-p target), exact only where a decision
lies within the bound: the tokens are always those of the exact masses, tested at the boundaries on purpose."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch

import specsampler as ss
import specsampler.sampling.masses as masses_module
import specsampler.sampling.nucleus as nucleus
from specsampler.sampling.masses import (
    MASS_BITS,
    chunk_mass_bounds,
    has_mass,
    mass_interval,
    masses,
    row_mass,
    sample_by_inversion,
)


def _exact_masses(row: list[float]) -> list[int]:
    """Python integers ``floor(clamp(w, 0, 1) * 2**32)`` (NaN 0): the definition, without tensors."""
    return [0 if math.isnan(v) else int(min(max(v, 0.0), 1.0) * 2**MASS_BITS) for v in row]


def _exact_draw(row: list[float], u: float) -> int:
    """The first id whose cumulative exact mass exceeds ``floor(u * Z)`` (float64, as defined), 0 without mass."""
    m = _exact_masses(row)
    z = sum(m)
    if z == 0:
        return 0
    t = min(math.floor(float(u) * z), z - 1)
    total = 0
    for i, v in enumerate(m):
        total += v
        if total > t:
            return i
    raise AssertionError


def _adversarial_rows(C: int, g: torch.Generator) -> torch.Tensor:
    """Rows whose float32 sums round the most (many values just below 1, below 2**-9 where masses floor, mixed
    scales), a row of equal powers of two (every prefix a round number) and a row of zeros."""
    near_one = 1 - torch.randint(1, 64, (C,), generator=g).float() * 2.0**-24
    tiny = torch.rand(C, generator=g) * 2.0**-12
    mixed = torch.rand(C, generator=g) ** 12
    flat = torch.full((C,), 2.0**-7)
    return torch.stack([near_one, tiny, mixed, flat, torch.zeros(C)])


@pytest.mark.parametrize("C", [16, 1000, 4099, 128256])
def test_mass_bounds_contain_the_exact_mass(C):
    g = torch.Generator().manual_seed(C)
    w = _adversarial_rows(C, g)
    exact = torch.tensor([float(sum(_exact_masses(row))) for row in w.tolist()], dtype=torch.float64)
    assert torch.equal(row_mass(w), exact)
    lo, hi = mass_interval(w)
    assert bool((lo <= exact).all() and (exact <= hi).all())
    assert bool(((hi - lo) <= 2e-6 * exact + 2 * C + 2).all())  # tight: gamma(15) and one unit per value
    lo, hi = mass_interval(w, 256)  # the coarse read
    assert bool((lo <= exact).all() and (exact <= hi).all())
    chunk_lo, chunk_hi, m = chunk_mass_bounds(w)
    assert torch.equal(m.double(), masses(w))
    chunks = torch.nn.functional.pad(masses(w), (0, -C % 256)).view(w.shape[0], -1, 256).sum(-1)
    assert bool((chunk_lo <= chunks).all() and (chunks <= chunk_hi).all())


def test_a_row_holding_nan_gets_bounds_that_decide_nothing():
    w = torch.rand(2, 3000)
    w[1, 17] = float("nan")
    lo, hi = mass_interval(w)
    assert lo[1] == 0 and hi[1] == float("inf") and math.isfinite(hi[0].item())


def test_a_mass_above_zero_is_a_weight_of_at_least_two_to_the_minus_32():
    edge = 2.0**-MASS_BITS
    w = torch.tensor([[edge, 0.0], [edge * (1 - 2**-24), 0.0], [float("nan"), -1.0], [float("inf"), 0.0],
                      [0.0, 2.0], [float("-inf"), edge / 2]])
    assert has_mass(w).tolist() == (row_mass(w) > 0).tolist() == [True, False, False, True, True, False]
    assert has_mass(w, keepdim=True).shape == (6, 1)


def _boundary_uniforms(row: list[float], n: int) -> list[float]:
    """Uniforms whose ``floor(u * Z)`` lands just below, on and just above prefix masses of ``row`` (chunk ends
    and single tokens' edges), on the 24-bit grid the Philox uniforms take."""
    m = _exact_masses(row)
    z = sum(m)
    cum, total = [], 0
    for v in m:
        total += v
        cum.append(total)
    edges = [cum[j] for j in range(255, len(cum), 256)] + [cum[j] for j in range(3, len(cum), max(1, len(cum) // 7))]
    out = []
    for e in edges[:n]:
        k = round(e / z * 2**24)
        out += [min(max(k + d, 0), 2**24 - 1) * 2.0**-24 for d in (-1, 0, 1)]
    return out


@pytest.mark.parametrize("C", [1024, 1040, 4096, 5003])
def test_wide_rows_draw_the_exact_token_at_every_boundary(C):
    # rows whose prefix masses are round numbers (each uniform here puts floor(u * Z) on or beside one), rows of
    # values where float32 sums round, out-of-range values and NaN (drawn exactly), a row without mass
    g = torch.Generator().manual_seed(C)
    rows = torch.cat([_adversarial_rows(C, g), torch.rand(3, C, generator=g) * (torch.rand(3, C, generator=g) < 0.1)])
    bad = torch.rand(2, C, generator=g)
    bad[0, 5], bad[1, 9] = float("nan"), -3.0
    bad[1, 11] = 4.0
    rows = torch.cat([rows, bad])
    ws, us = [], []
    for row in rows.tolist():
        for u in _boundary_uniforms(row, 6) if any(row) else [0.5]:
            ws.append(row)
            us.append(u)
    w, u = torch.tensor(ws), torch.tensor(us)
    want = [_exact_draw(row, uu) for row, uu in zip(ws, u.tolist())]
    assert sample_by_inversion(w, u).tolist() == want


@contextlib.contextmanager
def _counting_exact_draws():
    """The rows drawn over all their exact masses while the context is open (a list of counts, one per pass)."""
    rows, real = [], masses_module._invert_masses

    def counting(m, u):
        rows.append(m.shape[0])
        return real(m, u)

    with mock.patch.object(masses_module, "_invert_masses", counting):
        yield rows


def test_draws_of_peaked_rows_take_the_exact_pass_rarely():
    # the point of the bounds: rows like a language model's (a few likely tokens) are drawn from float32 sums and
    # one chunk's exact masses; only a draw within the bound of an edge reads every mass exactly
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 32000, generator=g) * 2.5
    probs = torch.softmax(logits, -1)
    u = torch.rand(256, generator=g)
    with _counting_exact_draws() as exact_rows:
        got = sample_by_inversion(probs, u)
    assert torch.equal(got, masses_module._invert_masses(masses(probs), u))
    assert sum(exact_rows) <= 256 // 10


def _exact_top_p(w: torch.Tensor, top_p: float) -> list[list[bool]]:
    """The kept set of the top-p rule on exact masses (Python integers) of the weights ``w`` ``[R, V]``: the
    smallest prefix of the (weight desc, id asc) order whose mass reaches ``min(ceil(top_p * Z), Z)``."""
    out = []
    for row in w.tolist():
        m = _exact_masses(row)
        z = sum(m)
        target = min(math.ceil(float(torch.tensor(top_p, dtype=torch.float32)) * z), z)
        keep, before = [False] * len(row), 0
        for i in sorted(range(len(row)), key=lambda i: (-row[i], i)):
            keep[i] = row[i] > 0 and before < target
            before += m[i]
        out.append(keep)
    return out


@pytest.mark.parametrize("V", [5000, 70000])
@pytest.mark.parametrize("edge", [-1, 0, 1])
def test_top_p_at_the_edge_of_a_prefix_keeps_the_exact_prefix(V, edge):
    # probabilities whose masses are round: top_p * Z falls on (or one float32 step beside) the mass of a prefix,
    # where bounds on Z cannot tell; the row's exact mass settles it. Rows of 5000 take the counted path, rows of
    # 70000 the estimated one (compaction above a bound, the small-nucleus head).
    probs = torch.full((2, V), 2.0**-20)
    probs[:, :40] = torch.linspace(0.25, 0.01, 40)
    probs[1, 40:200] = 2.0**-10  # a second row whose nucleus reaches into many equal tokens
    w = torch.ldexp(probs, -torch.frexp(probs.amax(-1, keepdim=True)).exponent)  # the weights process() takes
    m = masses(w)
    z = m.sum(-1)
    ordered = torch.sort(w, dim=-1, descending=True, stable=True)
    prefix = m.gather(1, ordered.indices).cumsum(-1)
    settled = []
    real = nucleus._Target._make_exact

    def counting(self, open_rows, sub):
        settled.append(int(open_rows.sum()))
        return real(self, open_rows, sub)

    for b, j in ((0, 30), (1, 150)):
        top_p = float(prefix[b, j] / z[b])
        top_p = torch.nextafter(torch.tensor(top_p, dtype=torch.float32), torch.tensor(edge * 2.0)).item() if edge \
            else torch.tensor(top_p, dtype=torch.float32).item()
        with mock.patch.object(nucleus._Target, "_make_exact", counting):
            out = ss.top_p_renorm(probs[b:b + 1], top_p)
        assert (out[0] > 0).tolist() == _exact_top_p(w[b:b + 1], top_p)[0]
    if V > nucleus._COUNT_WHOLE:
        assert sum(settled) >= 1  # the bounds did leave a row open: the exact mass decided it


def test_a_single_token_reaching_top_p_is_decided_at_the_edge():
    # the most likely token's mass exactly at top_p * Z: within the bounds, so decided on the exact mass
    probs = torch.full((1, 70000), 2.0**-22)
    probs[0, 123] = 0.5
    w = torch.ldexp(probs, -torch.frexp(probs.amax(-1, keepdim=True)).exponent)
    share = float(masses(w)[0, 123] / row_mass(w)[0])
    for top_p in (share, math.nextafter(share, 1.0), math.nextafter(share, 0.0)):
        top_p = torch.tensor(top_p, dtype=torch.float32).item()
        out = ss.top_p_renorm(probs, top_p)
        assert (out[0] > 0).tolist() == _exact_top_p(w, top_p)[0]


@pytest.mark.parametrize("tied", [2, 20])
def test_a_one_token_nucleus_is_the_lowest_id_of_the_largest_weight(tied):
    # logits a float32 step apart share the largest weight at a high temperature: the nucleus is the lowest id
    # among them, not the argmax of the logits (found among the leading logits, or by a scan when more than 8 tie)
    V, T = 70000, 100.0
    logits = torch.full((2, V), -math.inf)
    ids = torch.arange(tied) * 997 + 50
    logits[:, ids] = torch.nextafter(torch.full((tied,), 30.0), torch.tensor(0.0))
    logits[:, ids[-1]] = 30.0  # the highest logit at the highest id
    c = math.log2(math.e) / T
    w = torch.exp2(logits[0, ids] * c - 30.0 * c)
    assert bool((w == 1).all())
    out = ss.sample_from_logits(logits, ss.SamplingParams(temperature=T, top_p=0.5 / tied), ss.Philox(torch.arange(2)))
    assert out.tokens.tolist() == [50, 50]


def test_the_first_of_the_largest_weight_is_found_from_the_next_largest_logit():
    # the lowest id of the largest weight, against a scan of every weight: rows whose next largest logit weighs less
    # (in the top's chunk or another) take the argmax; ties, near ties that round to the top's weight, masked rows,
    # NaN and rows without a finite logit fall back to the leading logits or a scan
    from specsampler.sampling.filters import _weights
    from specsampler.sampling.nucleus import _first_of_largest, _max

    g = torch.Generator().manual_seed(3)
    V, L = 4096, 64
    x = torch.randn(12, V, generator=g) * 3
    x[1, 70] = x[1].max() + 1e-3  # the next largest in the top's chunk
    x[1, 71] = x[1, 70] - 1e-3
    x[2, [10, 3000]] = 40.0  # an exact tie across chunks: the lower id
    x[3, [3000, 10]] = torch.tensor([40.0, math.nextafter(40.0, 0.0)])  # a near tie at a high temperature
    x[4, :] = -math.inf
    x[4, 2500] = 1.0  # one finite logit
    x[5, :] = -math.inf  # no finite logit: no mass
    x[6, 77] = math.nan
    x[7, 5:13] = 50.0  # more than 8 tie
    x[8, [4000, 4001]] = 45.0  # the top's chunk holds the tie
    temperature = torch.tensor([1.0, 1.0, 1.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 2.0, 1.0])
    chunk_max = x.view(12, V // L, L).amax(-1)
    top, best = _max(x, chunk_max)
    w = _weights(x, top[:, None], temperature, True)
    w_max = w.gather(1, best[:, None])
    want = (w == w_max).to(torch.uint8).argmax(-1)
    assert _first_of_largest(x, w, w_max, chunk_max, best).tolist() == want.tolist()
    assert _first_of_largest(x, w, w_max, None, best).tolist() == want.tolist()
    sub = torch.tensor([7, 3, 11, 2, 8])  # some rows of the batch, read where they lie
    for cm in (chunk_max[sub], None):
        assert _first_of_largest(x, w, w_max[sub], cm, best[sub], sub).tolist() == want[sub].tolist()
    assert want[3] == 10 and want[2] == 10 and want[7] == 5  # the cases above are what they say


def _plain_logits(V: int, g: torch.Generator) -> torch.Tensor:
    """Rows of logits a plain sampler meets: spread, peaked, tied, far from zero (``top * c`` past 2**24), all
    masked, one holding NaN, one holding +inf, half masked."""
    spread = torch.randn(3, V, generator=g) * 3
    peaked = torch.randn(1, V, generator=g) * 12
    tied = torch.randint(-3, 3, (1, V), generator=g).float()
    far = torch.randn(1, V, generator=g) * 10 + 3e7
    masked = torch.full((1, V), float("-inf"))
    nan, inf = torch.randn(2, V, generator=g)
    nan[V // 3], inf[V // 2] = float("nan"), float("inf")
    half = torch.where(torch.rand(V, generator=g) < 0.5, torch.randn(V, generator=g), float("-inf"))
    return torch.cat([spread, peaked, tied, far, masked, nan[None], inf[None], half[None]])


@pytest.mark.parametrize("V", [1024, 1040, 5003])
@pytest.mark.parametrize("temperature,min_p", [(0.8, 0.0), (1.3, 0.1), (1e-30, 0.0), (1e-45, 0.05)])
def test_plain_rows_drawn_without_their_distribution_are_the_processed_draws(V, temperature, min_p):
    # sample_from_logits draws plain rows (temperature, min-p) from bounds on their chunks' normalised masses, never
    # writing the distribution: the same token and log-probability as drawing from process()'s probabilities, at
    # uniforms on the edges of the exact masses (the exact pass) and elsewhere (the bounds); 1e-30 and 1e-45 make
    # log2(e) / T huge and infinite
    from specsampler.params import SamplingParams
    from specsampler.sampling.filters import sample_plain
    from specsampler.sampling.processing import process
    from specsampler.sampling.rounding import in_vector_body

    g = torch.Generator().manual_seed(V)
    x = _plain_logits(V, g)
    rp = SamplingParams(temperature=temperature, min_p=min_p).rows("test", x.shape[0], 1, x.device, True)
    proc = process(x, rp, logits=True)
    probs = proc.dense()
    rows, us = [], []
    for r, row in enumerate(probs.tolist()):
        for u in (_boundary_uniforms(row, 4) if sum(_exact_masses(row)) else []) + torch.rand(3, generator=g).tolist():
            rows.append(r)
            us.append(u)
    idx, u = torch.tensor(rows), torch.tensor(us)
    x, rp = x[idx], rp.take(idx)
    proc = process(x, rp, logits=True)
    want = proc.sample(u)
    with _counting_exact_draws() as exact_rows:
        tokens, logprobs = sample_plain(x, rp, u, step=3)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(logprobs, in_vector_body(torch.log, proc.prob(want)), rtol=0, atol=0, equal_nan=True)
    # both ways taken: located from the bounds, and exactly at the edges (at 1e-45 no row has mass: all exact)
    assert sum(exact_rows) > 0 and (sum(exact_rows) < len(us) or temperature == 1e-45)


def test_normalised_masses_are_the_masses_of_the_normalised_weights():
    # floor(w / (z 2^-32)) for the power-of-two-scaled divisor: the masses of w / z, quotients below float32's
    # normal range included; a row of mass 0 divides to 0; a mass below 2^32 is flagged (its quotients may pass 1)
    from specsampler.sampling.masses import divide_by, normalised_masses, odd_masses

    g = torch.Generator().manual_seed(3)
    w = torch.rand(5, 3000, generator=g) ** 20
    w[:, 0] = 1.0
    w[1, 1:100] = torch.rand(99, generator=g) * 1e-38  # quotients subnormal
    w[2] = 0.0
    w[3, 1:] = 2.0**-30
    mass = row_mass(w, keepdim=True)
    got = normalised_masses(w, mass, torch.empty_like(w))
    assert torch.equal(got.double(), masses(divide_by(w, mass)))
    assert odd_masses(torch.tensor([0.0, 1.0, 2.0**32 - 1, 2.0**32], dtype=torch.float64)).tolist() == [
        False, True, True, False]


@pytest.mark.parametrize("unit", [False, True])
def test_a_draw_tells_whether_each_row_has_mass_from_its_own_bounds(unit):
    """sample_with_mass: the draw and has_mass of the same rows, the second read from the draw's chunk bounds: rows
    without mass, rows whose only weights lie just below or at 2**-32 (mass 0 and 1), a row holding a NaN with
    and without other mass, dense rows; equal to the two functions apart, and to the exact draw."""
    from specsampler.sampling.masses import sample_with_mass

    g = torch.Generator().manual_seed(11)
    C = 3000
    w = torch.rand(9, C, generator=g) ** 8
    w[0] = 0.0
    w[1] = 0.0
    w[1, 1777] = 2.0**-32 * (1 - 2**-20)  # mass 0
    w[2] = 0.0
    w[2, 2999] = 2.0**-32  # mass 1, in the last, partial chunk
    w[3, 5] = float("nan")
    w[4] = 0.0
    w[4, 17] = float("nan")  # a NaN and nothing else
    w[5] = 2.0**-33
    w[5, 256] = 3 * 2.0**-32
    if not unit:
        w[6, :10] = -1.0
        w[7, 100:200] = 5.0
    u = torch.rand(9, generator=g)
    before = w.clone()
    token, mass = sample_with_mass(w, u, unit=unit)
    assert torch.equal(w.nan_to_num(7.0), before.nan_to_num(7.0))  # the input is not modified
    assert mass.tolist() == has_mass(w).tolist() == [False, False, True, True, False, True, True, True, True]
    assert token.tolist() == sample_by_inversion(w, u).tolist()
    assert token.tolist() == [_exact_draw(r, float(v)) for r, v in zip(w.tolist(), u)]


def test_the_top_p_prefix_of_rows_out_of_weight_order_is_each_row_s_own():
    """Rows whose candidates are not in (weight desc, id asc) order (equal positive weights of distinct logits, ids
    descending) are ordered first; the batch was re-sorted whole when one row needed it (a batch of 256 rows over
    1000 tokens took 33 ms for 6 such rows). Each row now keeps the prefix of its own order, alone or in a batch."""
    from specsampler.sampling.filters import prefix_keep

    ordered = [0.5, 0.25, 0.25, 0.125, 0.0, 0.0]  # ties with ids ascending (and zeros in any id order)
    tied = [0.5, 0.25, 0.25, 0.125, 0.0, 0.0]  # the same weights, the tie's ids descending
    w = torch.tensor([ordered, tied])
    ids = torch.tensor([[0, 1, 2, 3, 5, 4], [0, 2, 1, 3, 4, 5]])
    target = torch.tensor([2.0**31 + 2.0**30, 2.0**31 + 2.0**30], dtype=torch.float64)  # half and a quarter
    keep = prefix_keep(w, ids, target)

    def exact(row: list[float], row_ids: list[int], t: float) -> list[bool]:  # (weight desc, id asc), Python ints
        m = _exact_masses(row)
        order = sorted(range(len(row)), key=lambda j: (-row[j], row_ids[j]))
        kept, before = [False] * len(row), 0
        for j in order:
            kept[j], before = before < t, before + m[j]
        return kept

    for b in range(2):
        want = exact(w[b].tolist(), ids[b].tolist(), float(target[b]))
        assert keep[b].tolist() == want == prefix_keep(w[b:b + 1], ids[b:b + 1], target[b:b + 1])[0].tolist()
    assert keep[1].tolist() == [True, False, True, False, False, False]  # id 1 (node 2) is the tie's first
