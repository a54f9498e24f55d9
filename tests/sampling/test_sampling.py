import itertools
import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from naive import naive_probs
from stats import assert_counts_match

import specsampler as ss
from conftest import mc_trials
from specsampler import SamplingParams as SP

# ----------------------------------------------------------------------------- exact cases


def test_top_k_keeps_exactly_k_with_ties_to_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    probs = ss.logits_to_probs(logits, SP(top_k=3))
    assert (probs[0] > 0).nonzero()[:, 0].tolist() == [1, 2, 3]
    probs = ss.logits_to_probs(logits, SP(top_k=4))
    assert (probs[0] > 0).nonzero()[:, 0].tolist() == [1, 2, 3, 4]


def test_top_k_off_when_not_positive_or_at_least_vocab():
    logits = torch.randn(3, 9)
    dense = ss.logits_to_probs(logits)
    for k in (0, -5, 9, 100):
        torch.testing.assert_close(ss.logits_to_probs(logits, SP(top_k=k)), dense)


def test_top_k_renormalises_the_kept_mass():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    torch.testing.assert_close(ss.top_k_renorm(probs, 2), torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.5, [0]), (0.75, [0, 1]), (0.7500001, [0, 1, 2]), (0.875, [0, 1, 2]), (0.9, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_prefix_that_reaches_p(top_p, kept):
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    out = ss.top_p_renorm(probs, top_p)
    assert (out[0] > 0).nonzero()[:, 0].tolist() == kept
    torch.testing.assert_close(out[0, kept], probs[0, kept] / probs[0, kept].sum())


def test_top_p_breaks_ties_by_the_lower_id():
    probs = torch.tensor([[0.2, 0.2, 0.4, 0.2]])
    # 0.55, not 0.6: float32 0.6 lies above 0.6 and 0.4 + 0.2 below it, so exact masses keep a third token
    assert (ss.top_p_renorm(probs, 0.55)[0] > 0).nonzero()[:, 0].tolist() == [0, 2]
    assert (ss.top_p_renorm(probs, 0.7)[0] > 0).nonzero()[:, 0].tolist() == [0, 1, 2]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top-k 2 leaves {0: 0.6, 1: 0.4} of (0.3, 0.2, 0.25, 0.25)... after renormalisation
    probs = torch.tensor([[0.3, 0.2, 0.25, 0.25]])
    logits = probs.log()
    # order: 0 (0.3), 2 (0.25), 3 (0.25), 1 (0.2); top-2 = {0, 2}: 0.545, 0.455; top_p 0.5 keeps {0}
    out = ss.logits_to_probs(logits, SP(top_k=2, top_p=0.5))
    assert (out[0] > 0).nonzero()[:, 0].tolist() == [0]
    # without top-k the nucleus for 0.5 is {0, 2} (0.3 < 0.5 before token 2)
    assert (ss.logits_to_probs(logits, SP(top_p=0.5))[0] > 0).nonzero()[:, 0].tolist() == [0, 2]


def test_min_p_keeps_tokens_above_a_fraction_of_the_max():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = ss.min_p_renorm(probs, 0.2)  # threshold 0.1
    assert (out[0] > 0).nonzero()[:, 0].tolist() == [0, 1, 2]
    torch.testing.assert_close(out.sum(-1), torch.ones(1))
    assert (ss.min_p_renorm(probs, 1.0)[0] > 0).nonzero()[:, 0].tolist() == [0]


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    torch.testing.assert_close(ss.logits_to_probs(logits, SP(temperature=0.5)), torch.softmax(logits / 0.5, -1))


def test_greedy_rows_are_one_hot_at_the_lowest_argmax():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 1.0, 2.0, 2.0]])
    out = ss.logits_to_probs(logits, SP(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5))
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    res = ss.sample_from_logits(logits, SP(temperature=0.0), rng=ss.Philox(3))
    assert res.tokens.tolist() == [1, 0] and res.logprobs.tolist() == [0.0, 0.0]


_GREEDY_EDGES = [[1.0, 3.0, 3.0, 2.0], [-math.inf] * 4, [math.nan] * 4, [math.nan, 1.0, 5.0, math.nan],
                 [math.inf, 1.0, math.inf, 2.0], [-math.inf, 2.0, math.nan, math.inf],
                 [math.nan, -math.inf, -math.inf, 0.0], [-0.0, 0.0, -1.0, -0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_greedy_ids_on_cpu_follow_the_argmax_with_nan_never_chosen(dtype):
    # the CPU's argmax (through NumPy) against ATen's, NaN read as -inf: ties, infinities, signed zeros, strided rows
    from specsampler.sampling.greedy import greedy_ids, nan_as_minus_inf

    g = torch.Generator().manual_seed(0)
    edges = torch.tensor(_GREEDY_EDGES)
    wide = torch.randn(3, 5, 4099, generator=g).round()  # many ties
    wide[1, 2, 7] = math.nan
    for x in (edges, edges.t().contiguous().t(), wide, wide[:, ::2, 1:], wide[0, 0], torch.zeros(0, 5)):
        x = x.to(dtype)
        got = greedy_ids(x)
        assert got.dtype == torch.int64 and torch.equal(got, nan_as_minus_inf(x).argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rng_kind", ["philox", "generator"])
def test_greedy_sampling_gives_the_processed_rows_tokens_and_log_probabilities(dtype, rng_kind):
    # a batch of greedy rows takes the argmax without processing its rows; the same tokens and log-probabilities
    # (0, or -inf where the largest value is not finite) as the rows' processing and draw, masks applied; a
    # generator is left where the draws would have left it
    from specsampler.sampling.ops import _sample_rows

    g = torch.Generator().manual_seed(2)
    logits = torch.cat([torch.tensor(_GREEDY_EDGES).repeat(1, 600), torch.randn(4, 2400, generator=g).round()])
    mask = torch.rand(logits.shape, generator=g) > 0.3
    for vocab_mask in (None, mask):
        x = logits.to(dtype)
        rows = x.float() if vocab_mask is None else x.float().masked_fill(~vocab_mask, -math.inf)
        rp = SP(temperature=0.0).rows("test", len(x), 1, x.device, False)
        want = _sample_rows(rows, rp, torch.rand(len(x), generator=g), 0)
        rng = ss.Philox(torch.arange(len(x))) if rng_kind == "philox" else torch.Generator().manual_seed(7)
        got = ss.sample_from_logits(x, SP(temperature=0.0), rng, vocab_mask)
        assert torch.equal(got.tokens, want[0]) and torch.equal(got.logprobs, want[1])
        if rng_kind == "generator":
            after = torch.Generator().manual_seed(7)
            torch.rand((len(x), 1), generator=after)
            assert torch.equal(torch.rand(3, generator=rng), torch.rand(3, generator=after))


def test_probability_rows_are_scaled_to_their_largest_as_ldexp_scales_them():
    # the weights of probability rows: each row times the power of two that brings its largest into [0.5, 1), by a
    # multiply where that power is a normal float32, else by ldexp (subnormal maxima); values above 1, results
    # that round into the subnormals, rows of zeros
    from specsampler.sampling.filters import _scale_to_unit_

    g = torch.Generator().manual_seed(0)
    w = torch.rand(8, 300, generator=g) * 10.0 ** torch.randint(-40, 6, (8, 1), generator=g).float()
    w[0, :3] = torch.tensor([3.0, 1e-44, 1e-38])
    w[1] = 0.0
    w[2, :3], w[2, 3:] = torch.tensor([1e-40, 0.0, 2e-40]), 0.0
    for rows in (w, w[:2], w[2:3]):
        want = torch.ldexp(rows, -torch.frexp(rows.amax(-1, keepdim=True)).exponent)
        assert torch.equal(_scale_to_unit_(rows.clone()), want)
        if rows.shape[0] == 2:
            assert ((want[0] > 0) & (want[0] < torch.finfo(torch.float32).tiny)).any()  # rounded into the subnormals


def test_probability_weights_skip_the_cleaning_only_where_it_changes_nothing():
    # rows of finite values at least 0 are scaled as they are; a row with NaN, an infinity or a negative value is
    # cleaned first (NaN and +inf count 0, negatives 0): either way the values of cleaning every row, bit for bit,
    # whatever the rows beside it (the check covers the whole batch: one unclean row cleans them all)
    from specsampler.sampling.filters import _scale_to_unit_, _weights

    g = torch.Generator().manual_seed(1)
    clean = torch.rand(4, 300, generator=g) * 10.0 ** torch.randint(-40, 3, (4, 1), generator=g).float()
    clean[0, :3] = torch.tensor([-0.0, 0.0, 1e-44])
    clean[1] = 0.0
    unclean = []
    for value in (math.nan, math.inf, -1e-30):  # each alone in a batch: each must be seen
        rows = clean.clone()
        rows[2, 4] = value
        unclean.append(rows)
    for rows in (clean, *unclean, torch.cat([clean, *unclean]), clean.half()):
        want = _scale_to_unit_(torch.nan_to_num(rows.float(), nan=0.0, posinf=0.0).clamp_(min=0.0))
        got = _weights(rows, None, None, False)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros included
        assert torch.equal(ss.sample(rows, ss.Philox(torch.arange(len(rows)))),
                           ss.sample(want, ss.Philox(torch.arange(len(rows)))))


def test_wide_probability_rows_draw_from_masses_taken_without_their_weights():
    # sample() of clean rows takes the weights' masses from the rows themselves (divided by the power of two z that
    # scales them): the masses of the weights exactly, the same tokens as drawing from the weights; where z * 2**-32
    # is not a normal float (maxima below 2**-95 or at 2**127 and above) the weights are formed first
    from specsampler.rng import STREAM_SAMPLE, uniform
    from specsampler.sampling.filters import _clean_top, _scale_to_unit_, _unit_divisor
    from specsampler.sampling.masses import chunk_mass_bounds, sample_by_inversion, scaled_masses

    g = torch.Generator().manual_seed(2)
    rows = torch.rand(6, 1100, generator=g) ** 8
    rows[0] *= 1e-28  # largest in [2**-94, 2**-93): z * 2**-32 = 2**-126, the least normal
    rows[1] = 0.0
    rows[2, ::3] = 0.0
    rows[3] *= 3e38
    rows[4] *= 1e-30
    rows[5, 7] = 1e-45  # a subnormal weight: mass 0 either way
    for batch, usable in ((rows[:3], True), (rows[5:], True), (rows[3:4], False), (rows[4:5], False)):
        want = _scale_to_unit_(batch.clone())
        z = _unit_divisor(_clean_top(batch))
        assert (z is not None) == usable
        if usable:
            assert torch.equal(batch / z, want)
            assert torch.equal(chunk_mass_bounds(batch, z=z)[2], scaled_masses(want.clone()))
        u = uniform(ss.Philox(torch.arange(len(batch))), "sample", len(batch), 1, STREAM_SAMPLE,
                    batch.device).reshape(-1)
        got = ss.sample(batch, ss.Philox(torch.arange(len(batch))))
        assert torch.equal(got, sample_by_inversion(want, u))


def test_min_p_cut_keeps_values_at_its_threshold_and_computes_aten_s_products():
    # keep_at_least_ (min-p's cut, in NumPy on CPU) gives the products w * (w >= threshold) that ATen gives, in
    # place: values equal to the threshold kept, signed zeros as the product leaves them, strided rows, and rows of
    # another dtype (ATen's path)
    from specsampler.sampling.filters import keep_at_least_

    g = torch.Generator().manual_seed(3)
    w = torch.rand(5, 70, generator=g)
    w[0, :4] = torch.tensor([-0.0, 0.0, 0.25, 0.2500001])
    threshold = torch.tensor([[0.25], [0.0], [1.0], [0.5], [0.9]])
    w[3, 10] = 0.5
    for rows, t in ((w, threshold), (w.t().contiguous().t(), threshold), (w[:, ::2], threshold),
                    (w.double(), threshold.double())):
        want = rows.clone().mul_(rows >= t)
        got = rows.clone()
        assert keep_at_least_(got, t) is got
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert w[0, 2] == 0.25 and keep_at_least_(w.clone(), threshold)[0, 2] == 0.25


def test_vocab_mask_applies_before_everything_else():
    logits = torch.tensor([[9.0, 1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[False, True, True, True, False]])
    assert ss.logits_to_probs(logits, SP(temperature=0.0), mask).argmax().item() == 3
    out = ss.logits_to_probs(logits, SP(top_k=2), mask)
    assert (out[0] > 0).nonzero()[:, 0].tolist() == [2, 3]
    out = ss.logits_to_probs(logits, None, mask)
    assert out[0, 0] == 0 and out[0, 4] == 0
    torch.testing.assert_close(out[0, 1:4], torch.softmax(logits[0, 1:4], -1))


@pytest.mark.parametrize("params", [SP(top_p=0.9), SP(top_k=5), SP(top_k=5, top_p=0.9), SP(min_p=0.2), SP()])
def test_a_row_with_every_token_masked_has_no_mass_whatever_the_filters(params):
    V = 200  # wide enough for the nucleus search (more than 64 tokens)
    logits = torch.randn(2, V)
    mask = torch.ones(2, V, dtype=torch.bool)
    mask[1] = False
    probs = ss.logits_to_probs(logits, params, mask)
    assert probs[1].sum() == 0 and probs[0].sum().item() == pytest.approx(1.0)
    out = ss.sample_from_logits(logits, params, ss.Philox(1), mask)
    assert out.tokens[1].item() == 0 and out.logprobs[1].item() == float("-inf") and out.logprobs[0] > -float("inf")


def test_vocab_mask_broadcasts_over_positions():
    logits = torch.randn(2, 3, 6)
    mask = torch.tensor([True, False, True, True, False, True])
    out = ss.logits_to_probs(logits, vocab_mask=mask)
    assert (out[..., ~mask] == 0).all()


def test_per_request_parameters_equal_separate_calls():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50)
    params = SP(
        temperature=torch.tensor([0.0, 0.7, 1.3, 1.0]),
        top_k=torch.tensor([0, 5, 0, 20]),
        top_p=torch.tensor([1.0, 0.8, 0.6, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.1, 0.05]),
    )
    together = ss.logits_to_probs(logits, params)
    for b in range(4):
        alone = ss.logits_to_probs(
            logits[b : b + 1],
            SP(params.temperature[b].item(), int(params.top_k[b]), params.top_p[b].item(), params.min_p[b].item()),
        )
        torch.testing.assert_close(together[b : b + 1], alone)


@pytest.mark.parametrize("V", [50, 4096])
@pytest.mark.parametrize("params", [SP(temperature=0.0), SP(0.8, top_k=7), SP(0.8, top_p=0.9), SP(1.0, top_p=0.5),
                                    SP(1.3, min_p=0.1), SP(0.7, top_k=20, top_p=0.8, min_p=0.05), SP(1.0)])
def test_scalar_parameters_draw_what_the_same_parameters_as_tensors_draw(params, V):
    """Scalars let processing pick its path on the host; tensors make it read them: same draws."""
    B = 6
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(V)) * 3
    as_tensors = SP(*(torch.full((B,), getattr(params, f)) for f in ("temperature", "top_k", "top_p", "min_p")))
    rng = lambda: ss.Philox(torch.arange(B))  # noqa: E731
    for a, b in zip(ss.sample_from_logits(logits, params, rng(), num_logprobs=3),
                    ss.sample_from_logits(logits, as_tensors, rng(), num_logprobs=3)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ss.logits_to_probs(logits, params), ss.logits_to_probs(logits, as_tensors),
                               rtol=0, atol=0)


def test_low_precision_logits_are_processed_in_float32():
    logits = torch.randn(3, 40)
    for dtype in (torch.bfloat16, torch.float16):
        out = ss.logits_to_probs(logits.to(dtype), SP(top_p=0.9))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ss.logits_to_probs(logits.to(dtype).float(), SP(top_p=0.9)))


def test_inputs_are_not_modified():
    logits = torch.randn(3, 2, 30)
    before = logits.clone()
    mask = torch.rand(3, 2, 30) > 0.3
    ss.logits_to_probs(logits, SP(temperature=0.5, top_k=4, top_p=0.9, min_p=0.1), mask)
    ss.sample_from_logits(logits, SP(top_p=0.7), rng=ss.Philox(1), vocab_mask=mask, num_logprobs=3)
    probs = torch.softmax(logits, -1)
    pb = probs.clone()
    ss.top_k_renorm(probs, 3), ss.top_p_renorm(probs, 0.5), ss.min_p_renorm(probs, 0.2), ss.sample(probs)
    assert torch.equal(logits, before) and torch.equal(probs, pb)


def test_nucleus_larger_than_the_first_candidate_block_is_exact():
    # a flat distribution: the nucleus needs hundreds of tokens (beyond the first 64 candidates)
    torch.manual_seed(1)
    logits = torch.randn(3, 3000) * 0.1
    out = ss.logits_to_probs(logits, SP(top_p=0.5))
    for b in range(3):
        ref, _ = naive_probs(logits[b].double().tolist(), top_p=0.5)
        assert ((out[b] > 0) == torch.tensor(ref).gt(0)).all()
    assert (out > 0).sum(-1).min() > 500


# ----------------------------------------------------------------------------- properties

rows = st.integers(2, 12).flatmap(
    lambda V: st.lists(st.lists(st.integers(-3, 3), min_size=V, max_size=V), min_size=1, max_size=4)
)


@settings(max_examples=150, deadline=None)
@given(
    rows=rows,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_k=st.integers(-1, 13),
    top_p=st.sampled_from([0.05, 0.3, 0.5, 0.77, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
    masked=st.booleans(),
)
def test_logits_to_probs_matches_the_rule_exactly(rows, temperature, top_k, top_p, min_p, masked):
    logits = torch.tensor(rows, dtype=torch.float32) * 0.7
    mask = None
    if masked:
        mask = torch.ones_like(logits, dtype=torch.bool)
        mask[:, ::3] = False
        mask[:, -1] = True
    out = ss.logits_to_probs(logits, SP(temperature, top_k, top_p, min_p), mask)
    for b, row in enumerate(logits.double().tolist()):
        ref, margin = naive_probs(row, temperature, top_k, top_p, min_p, None if mask is None else mask[b].tolist())
        assume(margin > 1e-5)
        assert out[b].sum().item() == pytest.approx(1.0, abs=1e-5)
        assert ((out[b] > 0) == torch.tensor(ref).gt(0)).all(), (out[b], ref)
        torch.testing.assert_close(out[b].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6, rtol=1e-5)


@settings(max_examples=150, deadline=None)
@given(rows=rows, top_k=st.integers(-1, 13), top_p=st.sampled_from([0.1, 0.5, 0.8, 1.0]),
       min_p=st.sampled_from([0.0, 0.3]))
def test_renorm_filters_match_the_rule_exactly(rows, top_k, top_p, min_p):
    probs = torch.tensor(rows, dtype=torch.float32).add(4.0)  # unnormalised, positive, with ties
    for fn, kw in ((ss.top_k_renorm, dict(top_k=top_k)), (ss.top_p_renorm, dict(top_p=top_p)),
                   (ss.min_p_renorm, dict(min_p=min_p))):
        out = fn(probs, next(iter(kw.values())))
        for b, row in enumerate(probs.double().tolist()):
            ref, margin = naive_probs(row, is_probs=True, **kw)
            assume(margin > 1e-5)
            assert ((out[b] > 0) == torch.tensor(ref).gt(0)).all()
            torch.testing.assert_close(out[b].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    V=st.integers(65, 400),
    spread=st.sampled_from([0, 1, 2, 5]),
    top_p=st.sampled_from([0.1, 0.5, 0.77, 0.95, 0.999]),
    min_p=st.sampled_from([0.0, 0.02]),
    seed=st.integers(0, 2**16),
)
def test_large_nuclei_match_the_rule_exactly(V, spread, top_p, min_p, seed):
    # flat rows with many exact ties: the nucleus exceeds the first candidates and is cut by radix select
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-spread, spread + 1, (3, V), generator=g).float() * 0.05
    out = ss.logits_to_probs(logits, SP(temperature=1.0, top_p=top_p, min_p=min_p))
    for b, row in enumerate(logits.double().tolist()):
        ref, margin = naive_probs(row, 1.0, 0, top_p, min_p)
        assume(margin > 1e-5)
        assert ((out[b] > 0) == torch.tensor(ref).gt(0)).all()
        torch.testing.assert_close(out[b].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    V=st.sampled_from([2048, 4104, 20480]),
    kind=st.sampled_from(["ties", "normal", "peaked", "masked"]),
    top_p=st.sampled_from([0.3, 0.9, 0.999]),
    min_p=st.sampled_from([0.0, 0.001]),
    probs_in=st.booleans(),
    counted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_nuclei_of_wide_vocabularies_match_the_rule_exactly(V, kind, top_p, min_p, probs_in, counted, seed):
    # wide rows take the nucleus search (counted whole, or as in rows longer than _COUNT_WHOLE
    # estimated; compaction, radix cut, dense fallback): the first rows vary the distribution's
    # shape, then one token alone reaches top-p, a small nucleus, a flat row (the nucleus
    # exceeds any compaction: cut densely) and a row without a finite logit
    import specsampler.sampling.nucleus as search

    with mock.patch.object(search, "_COUNT_WHOLE", V if counted else 0):
        _check_wide_nuclei(V, kind, top_p, min_p, probs_in, seed)


def _check_wide_nuclei(V, kind, top_p, min_p, probs_in, seed):
    g = torch.Generator().manual_seed(seed)
    logits = {"ties": torch.randint(-3, 4, (3, V), generator=g).float() * 0.5,
              "normal": torch.randn(3, V, generator=g) * 2,
              "peaked": torch.randn(3, V, generator=g) * 6,
              "masked": torch.randn(3, V, generator=g).masked_fill(torch.rand(3, V, generator=g) < 0.7, -math.inf),
              }[kind]
    one, small = torch.zeros(V), torch.randn(V, generator=g)
    one[V // 3] = 30.0
    small[torch.randperm(V, generator=g)[:20]] += 12.0
    rows = torch.cat([logits, one[None], small[None], torch.zeros(1, V), torch.full((1, V), -math.inf)])
    if probs_in:
        rows = torch.softmax(rows, -1).nan_to_num(0.0)
        out = ss.min_p_renorm(ss.top_p_renorm(rows, top_p), min_p) if min_p else ss.top_p_renorm(rows, top_p)
    else:
        out = ss.logits_to_probs(rows, SP(temperature=0.7, top_p=top_p, min_p=min_p))
    for b, row in enumerate(rows.double().tolist()):
        if b == rows.shape[0] - 1:  # no mass: nothing kept
            assert not out[b].isnan().any() and not out[b].any()
            continue
        if probs_in:
            ref, margin = naive_probs(row, 1.0, 0, top_p, 0.0, is_probs=True)
            if min_p:  # applied after renormalisation, as a separate call
                ref, _ = naive_probs(ref, 1.0, 0, 1.0, min_p, is_probs=True)
        else:
            ref, margin = naive_probs(row, 0.7, 0, top_p, min_p)
        if margin < 1e-5:  # within float rounding of the boundary
            continue
        assert ((out[b] > 0) == torch.tensor(ref).gt(0)).all(), (b, int((out[b] > 0).sum()), sum(r > 0 for r in ref))
        torch.testing.assert_close(out[b].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6, rtol=1e-4)


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 12),
    L=st.sampled_from([4, 8, 32]),
    chunks=st.integers(14, 40),
    spread=st.sampled_from([1, 3, 1000]),
    finite=st.integers(0, 25),
    seed=st.integers(0, 2**16),
)
def test_top_candidates_from_chunk_maxima_are_the_exact_ordered_prefix(n, L, chunks, spread, finite, seed):
    from specsampler.sampling.topk import _ordered_prefix_by_chunks

    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-spread, spread + 1, (5, chunks * L), generator=g).float()
    scores[0, : L * 3] = -float("inf")  # masked tokens
    scores[1] = 0.0  # one big tie: every chunk reaches the bound
    allowed = torch.randperm(chunks * L, generator=g)[:finite]
    scores[2] = scores[2].where(torch.zeros(chunks * L, dtype=torch.bool).index_fill_(0, allowed, True), -float("inf"))
    vals, ids = _ordered_prefix_by_chunks(scores, n, L)
    for b in range(5):
        expected = sorted(range(scores.shape[1]), key=lambda i: (-float(scores[b, i]), i))[:n]
        assert ids[b].tolist() == expected
        assert vals[b].tolist() == scores[b, expected].tolist()


@pytest.mark.parametrize("n", [1, 5, 64])
def test_ties_at_the_cut_of_a_whole_row_top_k_go_to_the_lowest_ids(n):
    # the tied rows' lowest ids are found from the rows' starts, read further only where too few tie there: ties
    # early (a mask's -inf, a flat row), late (past the first reads), NaN leading, -0.0 tying with 0.0
    from specsampler.sampling.topk import _ordered_prefix_of_rows

    V = 20000
    g = torch.Generator().manual_seed(n)
    scores = torch.randint(-3, 4, (8, V), generator=g).float()
    scores[0] = -float("inf")
    scores[0, torch.randperm(V, generator=g)[:3]] = torch.tensor([2.0, 5.0, 2.0])  # a mask leaving 3 tokens
    scores[1] = 0.0  # flat
    scores[2] = torch.arange(V, dtype=torch.float32)
    scores[2, V - 9000:] = 7.5  # the tie only at the end, past 8 times the first read
    scores[2, V - 1] = 1e6
    scores[3, 4000] = float("nan")
    scores[4] = -1.0
    scores[4, ::2] = -0.0
    scores[4, [5, 77, 19001]] = 0.0
    scores[5] = scores[5].clamp(max=0)  # many ties at 0 throughout
    vals, ids = _ordered_prefix_of_rows(scores, n)
    for b in range(8):
        row = scores[b].tolist()
        expected = sorted(range(V), key=lambda i: (0 if math.isnan(row[i]) else 1, -row[i] if row[i] == row[i]
                                                    else 0, i))[:n]
        assert ids[b].tolist() == expected, b
        torch.testing.assert_close(vals[b], scores[b, expected], rtol=0, atol=0, equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    L=st.sampled_from([4, 8, 64]),
    chunks=st.integers(14, 60),
    spread=st.sampled_from([0, 2, 1000]),
    seed=st.integers(0, 2**16),
)
def test_the_chunk_search_on_cpu_equals_the_tensor_ops(n, L, chunks, spread, seed):  # NumPy's steps, ATen's
    from specsampler.sampling.topk import _prefix_among_chunks, _prefix_among_chunks_on_cpu

    assume(4 * (n + 2) <= chunks)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-spread, spread + 1, (7, chunks * L), generator=g).float()
    scores[0, : L * 3] = -float("inf")  # masked tokens
    scores[1, ::5] = -0.0  # ties of signed zeros
    scores[2, [1, L + 2]] = float("nan")
    scores[3, [0, 5 * L]] = float("inf")
    scores[4] = -float("inf")
    scores[4, : n - 1] = 1.0  # fewer than n finite
    scores[5] = scores[5] * 1e-3 + torch.randn(chunks * L, generator=g)
    view = scores.view(7, chunks, L)
    want = _prefix_among_chunks(view, view.amax(-1), n)
    got = _prefix_among_chunks_on_cpu(view, view.amax(-1), n)
    assert torch.equal(got[2], want[2])  # the rows falling back to a whole-row top-k
    ok = ~want[2]
    assert torch.equal(got[1][ok], want[1][ok])
    assert torch.equal(got[0][ok].view(torch.int32), want[0][ok].view(torch.int32))  # bit for bit


@pytest.mark.parametrize("seed", range(12))
def test_the_top_k_cut_on_cpu_equals_the_tensor_ops(seed):  # NumPy's steps, ATen's: the same Part bit for bit
    from specsampler.params import RowParams
    from specsampler.sampling.filters import _cut_part_on_cpu, _cut_with_mass, _part_in_id_order

    g = torch.Generator().manual_seed(seed)
    r, C = 9, [1, 2, 50, 64, 130][seed % 5]
    x = torch.randn(r, C, generator=g) * (1 + seed % 4) * 3
    if seed % 3 == 0:
        x = torch.randint(-2, 3, (r, C), generator=g).float()  # ties: equal weights, ids out of order
    ids = torch.stack([torch.randperm(10_000, generator=g)[:C] for _ in range(r)])
    vals, order = x.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    w = torch.exp2(vals - vals[:, :1]).clamp(max=1.0)
    w[1, C // 2:] = 0.0  # a row's k below the candidates': zeros after it
    w[2] = 0.0  # no mass
    if seed % 4 == 1:  # out of (weight desc, id asc) order
        w[3] = w[3].flip(0)
    top_p = torch.rand(r, generator=g).clamp(min=0.05)
    top_p[0] = 1.0
    min_p = torch.rand(r, generator=g) * (seed % 2) * 0.3
    for shared in (None, SP(top_p=0.7)):
        rp = RowParams(torch.ones(r), torch.full((r,), C), top_p if shared is None else torch.full((r,), 0.7),
                       min_p if shared is None else torch.zeros(r), shared)
        for fallback in (None, ids[:, 0]):  # the token a row without mass draws: 0, or (greedy rows) its first
            want = _part_in_id_order(None, ids, *_cut_with_mass(w, ids, rp), fallback)
            got = _cut_part_on_cpu(None, ids, w, rp, fallback)
            assert torch.equal(got.ids, want.ids)
            assert torch.equal(got.probs.view(torch.int32), want.probs.view(torch.int32))
            assert (got.ids[2] == (0 if fallback is None else fallback[2])).all()
    w[4, 0] = float("nan")
    assert _cut_part_on_cpu(None, ids, w, rp) is None  # NaN: the tensor ops


@pytest.mark.parametrize("C", [2, 3, 50, 700, 1023])
def test_the_draw_of_few_candidates_on_cpu_equals_the_tensor_ops(C):  # NumPy's steps, ATen's
    from specsampler.sampling.masses import _invert_few, draw_target, invert, invert_few_on_cpu, masses

    g = torch.Generator().manual_seed(C)
    for _ in range(40):
        p = torch.rand(16, C, generator=g) ** 4 * 1.2 - 0.1  # values below 0 and above 1 too
        p[p.abs() < 0.3] = 0.0
        p[0] = 0.0  # no mass
        p[1, 0] = float("nan")
        p[2] = p[2] / p[2].sum()
        p[3, -1], p[4, 0] = float("inf"), -float("inf")
        u = torch.rand(16, generator=g)
        u[:3] = torch.tensor([0.0, 1 - 2**-24, 1.0])
        cum = masses(p).cumsum(-1)
        want = invert(cum, draw_target(u, cum[:, -1]))  # the definition over the prefix sums
        assert torch.equal(invert_few_on_cpu(p, u), want) and torch.equal(_invert_few(p, u), want)
        assert torch.equal(invert_few_on_cpu(p[5:6], u[5:6]), want[5:6])  # a lone row


@pytest.mark.parametrize("V", [7, 5000, 128256])
def test_an_empty_ordered_prefix(V):
    from specsampler.sampling.processing import ordered_prefix

    vals, ids = ordered_prefix(torch.randn(3, V), 0)
    assert vals.shape == ids.shape == (3, 0) and ids.dtype == torch.int64


def test_top_candidates_from_chunk_maxima_put_nan_first():  # as torch.topk does
    from specsampler.sampling.topk import _ordered_prefix_by_chunks

    scores = torch.arange(160, dtype=torch.float32).repeat(3, 1)
    scores[1, 7] = float("nan")
    scores[2, [3, 90]] = float("nan")
    vals, ids = _ordered_prefix_by_chunks(scores, 4, 8)
    assert ids.tolist() == [[159, 158, 157, 156], [7, 159, 158, 157], [3, 90, 159, 158]]
    assert vals[1, 0].isnan() and vals[1, 1:].tolist() == [159.0, 158.0, 157.0]


@pytest.mark.parametrize("shape, density", [((64, 20000), 0.02), ((16, 65536), 0.3), ((3, 16), 0.5), ((7, 8), 1.0),
                                            ((4, 24), 0.0), ((0, 8), 0.1), ((2, 13), 0.4), ((3, 0), 0.5)])
@pytest.mark.parametrize("compare", ["ge", "eq"])
def test_positions_equal_nonzero_of_the_comparison(shape, density, compare):  # on CPU through NumPy
    from specsampler.sampling.topk import _positions

    g = torch.Generator().manual_seed(shape[1])
    x = torch.randint(0, 1000, shape, generator=g, dtype=torch.int32)
    bound = torch.randint(0, 1000, (shape[0], 1), generator=g, dtype=torch.int32)
    if compare == "eq":
        x = torch.where(torch.rand(shape, generator=g) < density, bound, x + 1000)
    else:
        bound = torch.full_like(bound, int(1000 * (1 - density)))
    want = getattr(torch, compare)(x, bound).nonzero(as_tuple=True)
    want = (want[0] * shape[1] + want[1], *want)
    for got, floats in ((_positions(compare, x, bound), False), (_positions(compare, x.float(), bound.float()), True)):
        for got_t, want_t in zip(got, want, strict=True):
            assert got_t.dtype == torch.int64 and torch.equal(got_t, want_t), (compare, floats)


def test_radix_cut_orders_ties_inside_the_crossing_bin_by_position():
    from specsampler.sampling.processing import cut_to_mass

    # equal weights within one bin: the cut must keep the lowest positions
    w = torch.tensor([[1.0, 0.25, 0.25, 0.25, 0.25, 0.5, 0.25]])
    def mass(x):
        return torch.tensor([float(int(x * 2**32))], dtype=torch.float64)

    kept = cut_to_mass(w, mass(1.925))  # exact masses: 1, 0.5, then 0.25 x2
    assert kept.gt(0).nonzero()[:, 1].tolist() == [0, 1, 2, 5]
    assert w.gt(0).all()  # a new result: w only read
    inplace = w.clone()
    assert cut_to_mass(inplace, mass(1.925), out=inplace) is inplace and torch.equal(inplace, kept)
    kept = cut_to_mass(w, mass(2.75))
    assert torch.equal(kept, w)
    kept = cut_to_mass(w, mass(3.0))  # never reached: everything kept
    assert torch.equal(kept, w)
    # weights of one bin that differ in their low bits are ordered by weight first
    w = torch.tensor([[0.30000001, 0.3, 0.30000004, 0.1]])
    kept = cut_to_mass(w, mass(0.4))  # 0.30000004 then 0.30000001
    assert kept.gt(0).nonzero()[:, 1].tolist() == [0, 2]


def _assert_cut(w: torch.Tensor, target: torch.Tensor, kept: torch.Tensor, kept_mass: torch.Tensor) -> None:
    """``kept`` keeps, unchanged, exactly the smallest prefix of each row's (weight desc, position asc) order
    whose exact mass (Python integers of ``floor(w * 2**MASS_BITS)``) reaches ``target`` (all of it if none does);
    ``kept_mass`` is the exact mass of the kept tokens."""
    from specsampler.sampling.masses import MASS_BITS

    assert torch.equal(torch.where(kept > 0, w, 0.0), kept)
    for row, t, k, km in zip(w.tolist(), target.tolist(), kept, kept_mass.tolist()):
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))
        mass = [int(row[i] * 2**MASS_BITS) for i in order]
        before = [sum(mass[:j]) for j in range(len(mass))]
        expected = [bool(row[i] > 0) and before[j] < t for j, i in enumerate(order)]
        assert [bool(k[i] > 0) for i in order] == expected
        assert km == sum(m for m, e in zip(mass, expected) if e)


def _cut(w: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The radix cut and its kept mass; the public :func:`cut_to_mass` gives the same cut."""
    from specsampler.sampling.nucleus import _cut
    from specsampler.sampling.processing import cut_to_mass

    kept, mass = _cut(w, target)
    assert torch.equal(cut_to_mass(w, target), kept)
    return kept, mass


@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.one_of(st.just(0.0), st.integers(-60, 0).map(lambda e: 2.0 ** e),
                           st.floats(1e-3, 1.0), st.sampled_from([0.25, 0.5, 0.3])), min_size=1, max_size=200),
        min_size=1, max_size=4),
    fractions=st.lists(st.floats(0.01, 1.2), min_size=4, max_size=4),
)
def test_radix_cut_keeps_the_smallest_prefix_reaching_the_target(rows, fractions):
    C = max(len(r) for r in rows)
    w = torch.tensor([r + [0.0] * (C - len(r)) for r in rows], dtype=torch.float32)
    total = (w.double() * 2**32).floor().sum(-1)
    target = (total * torch.tensor(fractions[: len(rows)], dtype=torch.float64)).floor()
    _assert_cut(w, target, *_cut(w, target))


@pytest.mark.parametrize("case", ["one bin", "far below the largest"])
def test_radix_cut_splits_a_crowded_crossing_bin(case):
    # thousands of tokens pending after the first digit: split by the later digits, also far below
    # the largest weight
    g = torch.Generator().manual_seed(0)
    if case == "one bin":  # 5000 weights in [0.99, 1): one bin of the first digit
        w = 0.99 + torch.rand(3, 5000, generator=g) / 100
        mass = (w.double() * 2**32).floor().sum(-1)
        target = (mass * torch.tensor([0.3, 0.5, 0.999], dtype=torch.float64)).floor()
    else:  # 1.0, then tokens 20 to 22 octaves below whose mass the target needs (further below: no mass)
        w = torch.exp2(-20 - 2 * torch.rand(3, 5000, generator=g))
        w[:, 17] = 1.0
        target = torch.full((3,), 2.0**32 + 2**14, dtype=torch.float64)
    kept, mass = _cut(w, target)
    _assert_cut(w, target, kept, mass)
    assert (kept > 0).sum() > 3 and ((kept > 0).sum(-1) < 5000).all()


def test_radix_cut_of_rows_whose_crossing_bin_ties_keeps_the_smallest_prefix():
    # thousands of equal weights pending (a flat row, a flat tail below a few larger ones, weights below the
    # masses' unit): kept by count in position order; the target on, just past and just short of a multiple of
    # their mass; a row of unequal pending tokens beside them still split by its digits
    g = torch.Generator().manual_seed(1)
    w = torch.full((6, 3000), 0.3)
    w[1, [5, 2000]] = 0.9  # two heavier tokens, then the flat rest
    w[2] = 2.0**-40  # no mass at all
    w[3] = 0.99 + torch.rand(3000, generator=g) / 100  # unequal: split by the later digits
    m = float(int(0.3 * 2**32))
    target = torch.tensor([1000 * m, 2 * int(0.9 * 2**32) + 17 * m + 1, 5.0, 0.0, 999 * m - 1, 4000 * m],
                          dtype=torch.float64)
    target[3] = ((w[3].double() * 2**32).floor().sum() * 0.6).floor()
    kept, mass = _cut(w, target)
    _assert_cut(w, target, kept, mass)
    assert (kept > 0).sum(-1).tolist()[:1] + (kept > 0).sum(-1).tolist()[4:] == [1000, 999, 3000]


# ----------------------------------------------------------------------------- sampling


def _repeat_draws(fn, n: int, seed: int = 0):
    """Run ``fn(batch_of_n, Philox)`` once on n copies of one row, each with its own seed."""
    return fn(n, ss.Philox(torch.arange(n) + seed * n))


@pytest.mark.montecarlo
@pytest.mark.parametrize("rng_kind", ["philox", "generator"])
def test_sample_follows_the_distribution(rng_kind):
    n = mc_trials(400_000, 100_000)
    probs = torch.tensor([0.3, 0.0, 0.05, 0.25, 1e-3, 0.0, 0.199, 0.2])
    rng = ss.Philox(torch.arange(n)) if rng_kind == "philox" else torch.Generator().manual_seed(5)
    tokens = ss.sample(probs.expand(n, 8), rng)
    assert_counts_match(torch.bincount(tokens, minlength=8).numpy(), probs.numpy(), label="sample")


@pytest.mark.montecarlo
@pytest.mark.parametrize(
    "params",
    [SP(), SP(temperature=0.6), SP(top_k=3), SP(top_p=0.7), SP(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05),
     SP(min_p=0.2)],
    ids=["plain", "temperature", "top_k", "top_p", "all", "min_p"],
)
def test_sample_from_logits_follows_logits_to_probs(params):
    n = mc_trials(400_000, 100_000)
    logits = torch.tensor([1.0, -0.5, 2.0, 0.3, 0.3, -2.0, 1.7, 0.0, -float("inf"), 0.9])
    mask = torch.ones(10, dtype=torch.bool)
    mask[7] = False
    expected = ss.logits_to_probs(logits[None], params, mask[None])[0]
    out = ss.sample_from_logits(logits.expand(n, 10), params, ss.Philox(torch.arange(n)), vocab_mask=mask)
    assert_counts_match(torch.bincount(out.tokens, minlength=10).numpy(), expected.numpy(), label=str(params))
    torch.testing.assert_close(out.logprobs, expected[out.tokens].log())


def test_sample_from_logits_draws_what_sample_draws_on_the_same_stream():
    torch.manual_seed(2)
    logits = torch.randn(64, 3, 200) * 2
    params = SP(
        temperature=torch.rand(64) + 0.3,
        top_k=torch.randint(0, 30, (64,)),
        top_p=torch.rand(64) * 0.5 + 0.5,
        min_p=torch.rand(64) * 0.1,
    )
    rng = ss.Philox(torch.arange(64), 7)
    fused = ss.sample_from_logits(logits, params, rng).tokens
    two_step = ss.sample(ss.logits_to_probs(logits, params), rng)
    assert (fused == two_step).float().mean() > 0.99  # equal but for float rounding at a CDF boundary


def test_probability_zero_tokens_are_never_sampled():
    n = 20_000
    logits = torch.tensor([0.0, 10.0, -float("inf"), 10.0, -30.0])
    out = ss.sample_from_logits(logits.expand(n, 5), SP(top_k=2), ss.Philox(torch.arange(n))).tokens
    assert set(out.tolist()) <= {1, 3}
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    assert set(ss.sample(probs.expand(n, 5), ss.Philox(torch.arange(n))).tolist()) <= {1, 3}


def test_outputs_stay_in_range_on_degenerate_rows():
    V = 7
    rows = torch.tensor(
        [[float("nan")] * V, [-float("inf")] * V, [float("inf")] + [0.0] * (V - 1), [1e30, -1e30] + [0.0] * (V - 2)]
    )
    for params in (SP(), SP(temperature=0.0), SP(top_k=3), SP(top_p=0.5), SP(min_p=0.5)):
        out = ss.sample_from_logits(rows, params, ss.Philox(1), num_logprobs=2)
        assert ((out.tokens >= 0) & (out.tokens < V)).all()
        assert ((out.top_token_ids >= -1) & (out.top_token_ids < V)).all()
    tokens = ss.sample(torch.tensor([[0.0] * V, [float("nan")] * V, [-1.0] * V]), ss.Philox(0))
    assert ((tokens >= 0) & (tokens < V)).all()


def test_top_logprobs_are_sorted_and_padded_past_the_support():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    out = ss.sample_from_logits(logits, SP(top_k=3), ss.Philox(0), num_logprobs=4)
    assert out.top_token_ids.tolist() == [[1, 3, 2, -1]]
    expected = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0]), -1)
    torch.testing.assert_close(out.top_logprobs[0, :3], expected)
    assert out.top_logprobs[0, 3] == -math.inf
    dense = ss.sample_from_logits(logits, SP(temperature=2.0), ss.Philox(0), num_logprobs=7)
    assert dense.top_token_ids.tolist() == [[1, 3, 2, 0, 4, -1, -1]]
    torch.testing.assert_close(dense.top_logprobs[0, :5], torch.log_softmax(logits[0] / 2, -1)[[1, 3, 2, 0, 4]])


def test_leading_dimensions_keep_their_shape():
    logits = torch.randn(2, 3, 4, 11)
    out = ss.sample_from_logits(logits, SP(top_k=torch.tensor([2, 5])), ss.Philox(0), num_logprobs=2)
    assert out.tokens.shape == (2, 3, 4) and out.top_token_ids.shape == (2, 3, 4, 2)
    assert ss.sample(torch.rand(2, 3, 11)).shape == (2, 3)
    assert ss.logits_to_probs(logits).shape == logits.shape


def test_empty_batch():
    out = ss.sample_from_logits(torch.zeros(0, 5), SP(top_k=2), ss.Philox(0))
    assert out.tokens.shape == (0,)
    assert ss.logits_to_probs(torch.zeros(0, 5), SP(top_p=0.5)).shape == (0, 5)


def test_generator_and_global_rng_are_reproducible():
    logits = torch.randn(8, 100)
    a = ss.sample_from_logits(logits, rng=torch.Generator().manual_seed(3)).tokens
    b = ss.sample_from_logits(logits, rng=torch.Generator().manual_seed(3)).tokens
    torch.manual_seed(9)
    c = ss.sample_from_logits(logits).tokens
    torch.manual_seed(9)
    d = ss.sample_from_logits(logits).tokens
    assert torch.equal(a, b) and torch.equal(c, d)


# ----------------------------------------------------------------------------- no full sort


@pytest.fixture
def sort_sizes(monkeypatch):
    """Record the length of every sorted dimension (torch.sort / argsort / topk with k == V)."""
    seen = []
    real_sort, real_topk = torch.sort, torch.topk

    def sort(t, *a, **k):
        seen.append(t.shape[-1])
        return real_sort(t, *a, **k)

    def topk(t, k, *a, **kw):
        if k >= t.shape[-1]:
            seen.append(t.shape[-1])
        return real_topk(t, k, *a, **kw)

    monkeypatch.setattr(torch, "sort", sort)
    monkeypatch.setattr(torch, "topk", topk)
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sort(self, *a, **k))
    monkeypatch.setattr(torch, "argsort", lambda t, *a, **k: sort(t, *a, **k)[1])
    return seen


def test_top_k_top_p_sampling_sorts_no_full_vocabulary(sort_sizes):
    V = 8192
    logits = torch.randn(8, V) * 3
    ss.sample_from_logits(logits, SP(temperature=0.8, top_k=50, top_p=0.9), ss.Philox(0), num_logprobs=5)
    assert sort_sizes and max(sort_sizes) < V


def test_small_nucleus_sampling_sorts_no_full_vocabulary(sort_sizes):
    V = 8192
    logits = torch.randn(8, V) * 6  # peaked: the 0.9 nucleus holds a few dozen tokens
    out = ss.sample_from_logits(logits, SP(temperature=0.8, top_p=0.9), ss.Philox(0))
    assert max(sort_sizes) < V
    nucleus = (ss.logits_to_probs(logits, SP(temperature=0.8, top_p=0.9)) > 0).sum(-1)
    assert nucleus.max() < 512
    assert out.tokens.shape == (8,)


@pytest.mark.parametrize("V, scale", [(32768, 3.0), (65536, 3.5), (131072, 3.0)])
def test_large_nuclei_are_cut_among_few_candidates(monkeypatch, V, scale):
    # the estimated bound (rows longer than _COUNT_WHOLE; here all) keeps the candidates few (a
    # few times the nucleus) yet enough: no row falls back to cutting its whole vocabulary
    import specsampler.sampling.nucleus as search

    monkeypatch.setattr(search, "_COUNT_WHOLE", 0)
    widths, real_cut = [], search._cut
    monkeypatch.setattr(search, "_cut",
                        lambda w, t, out=None, m=None: widths.append(w.shape[1]) or real_cut(w, t, out, m))
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(V)) * scale
    probs = ss.logits_to_probs(logits, SP(temperature=0.8, top_p=0.9))
    nucleus = int((probs > 0).sum(-1).max())
    assert nucleus > 200 and widths and max(widths) <= min(4 * nucleus + 256, V // 8)


@pytest.mark.parametrize("V", [4096, 32000, 65536])
def test_counted_nuclei_are_compacted_when_small_and_cut_densely_when_large(monkeypatch, V):
    # rows up to _COUNT_WHOLE long are counted whole: a nucleus of up to V/16 tokens is settled
    # among the tokens down to its crossing bin (barely more than the nucleus), a larger one densely
    import specsampler.sampling.nucleus as search

    assert V <= search._COUNT_WHOLE
    widths, real_settle = [], search._settle
    monkeypatch.setattr(search, "_settle", lambda w, *a: widths.append(w.shape[1]) or real_settle(w, *a))
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(4, V, generator=g) * 0.5
    logits[:2, torch.randperm(V, generator=g)[: V // 40]] += 8.0  # the first rows: a nucleus of ~V/44 tokens
    nucleus = (ss.logits_to_probs(logits, SP(temperature=0.8, top_p=0.9)) > 0).sum(-1)
    assert nucleus[:2].min() > 10 and nucleus[:2].max() <= V // 16 < nucleus[2:].min()
    assert widths == [widths[0], V] and widths[0] <= 1.05 * int(nucleus[:2].max()) + 16


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, fragments",
    [
        (lambda: ss.sample_from_logits(torch.zeros(3, 5, dtype=torch.long)), ["logits", "floating-point", "int64"]),
        (lambda: ss.sample_from_logits(torch.zeros(5)), ["logits", "2 to 8 dimensions", "[5]"]),
        (lambda: ss.logits_to_probs(torch.zeros(3, 5), SP(top_k=torch.tensor([1, 2]))),
         ["SamplingParams.top_k", "[B] = [3]", "[2]"]),
        (lambda: ss.logits_to_probs(torch.zeros(3, 5), SP(top_p=torch.tensor([0.5, 1.5, 0.2]))),
         ["SamplingParams.top_p", "(0, 1]", "1.5", "request 1"]),
        (lambda: ss.logits_to_probs(torch.zeros(3, 5), SP(temperature=torch.tensor([1.0, 1.0, -2.0]))),
         ["temperature", ">= 0", "-2", "request 2"]),
        (lambda: SP(top_p=0.0), ["SamplingParams.top_p", "(0, 1]", "0.0"]),
        (lambda: SP(min_p=1.5), ["min_p", "[0, 1]", "1.5"]),
        (lambda: SP(top_k=2.5), ["top_k", "an integer", "2.5"]),
        (lambda: SP(temperature=float("nan")), ["temperature", "nan"]),
        (lambda: ss.logits_to_probs(torch.zeros(3, 5), vocab_mask=torch.ones(2, 5, dtype=torch.bool)),
         ["vocab_mask", "broadcastable", "[3, 5]", "[2, 5]"]),
        (lambda: ss.logits_to_probs(torch.zeros(3, 5), vocab_mask=torch.ones(3, 5)), ["vocab_mask", "bool"]),
        (lambda: ss.sample(torch.rand(3, 5), rng=42), ["rng", "Philox", "int"]),
        (lambda: ss.sample(torch.rand(3, 5), rng=ss.Philox(torch.tensor([1, 2]))), ["Philox.seed", "[3]", "[2]"]),
        (lambda: ss.sample(torch.rand(3, 5), validate="fast"), ["validate", "'fast'"]),
        (lambda: ss.sample_from_logits(torch.zeros(3, 5), num_logprobs=-1), ["num_logprobs", ">= 0", "-1"]),
        (lambda: ss.logits_to_probs(torch.zeros(3, 0)), ["logits", "V >= 1"]),
    ],
)
def test_bad_input_names_argument_expected_and_actual(call, fragments):
    with pytest.raises(ValueError) as err:
        call()
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize("n", [np.int64(2), np.int32(2), torch.tensor(2)], ids=["int64", "int32", "tensor"])
def test_num_logprobs_takes_numpy_integers_and_0d_tensors_as_the_other_counts(n):
    logits = torch.randn(2, 8)
    want = ss.sample_from_logits(logits, rng=ss.Philox(0), num_logprobs=2)
    got = ss.sample_from_logits(logits, rng=ss.Philox(0), num_logprobs=n)
    assert torch.equal(got.top_token_ids, want.top_token_ids) and torch.equal(got.tokens, want.tokens)
    with pytest.raises(ValueError, match="num_logprobs"):
        ss.sample_from_logits(logits, rng=ss.Philox(0), num_logprobs=True)


def test_full_validation_checks_values_and_names_the_request():
    logits = torch.zeros(3, 4)
    logits[2, 1] = float("nan")
    ss.logits_to_probs(logits)  # default: no value pass
    with pytest.raises(ValueError, match=r"logits: expected logits without NaN or \+inf, got nan .*request 2"):
        ss.logits_to_probs(logits, validate="full")
    probs = torch.tensor([[0.5, 0.5], [0.2, -0.1]])
    with pytest.raises(ValueError, match=r"probs: expected probabilities >= 0, got -0.1.*request 1"):
        ss.sample(probs, validate="full")
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match=r"vocab_mask: expected at least one allowed token per row.*request 1"):
        ss.logits_to_probs(torch.zeros(2, 3), vocab_mask=mask, validate="full")


def test_value_checks_of_cpu_parameters_run_by_default():
    with pytest.raises(ValueError, match="request 0"):
        ss.sample_from_logits(torch.zeros(2, 4), SP(min_p=torch.tensor([2.0, 0.0])))


def test_sampling_matches_numpy_reference_of_inversion():
    # inversion: first id whose cumulative probability exceeds u * total
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    rng = ss.Philox(torch.tensor([5]), 2)
    from specsampler.rng import STREAM_SAMPLE, uniform

    u = uniform(rng, "t", 1, 1, STREAM_SAMPLE, torch.device("cpu"))[0, 0].item()
    expected = int(np.searchsorted(np.cumsum([0.1, 0.0, 0.6, 0.3]), u * 1.0, side="right"))
    assert ss.sample(probs, rng).item() == expected


def test_rows_known_to_have_mass_draw_the_column_every_row_draws():
    """sample_processed (rows with mass, values in [0, 1], u in [0, 1)) gives sample_by_inversion's column, u at both
    ends of its range and rows of one token or of gaps included; the short rows' processing marks its rows so, and
    Processed.sample then takes it (the same tokens)."""
    from specsampler.sampling.masses import sample_by_inversion, sample_processed
    from specsampler.sampling.ops import _process_small, _small_constants

    g = torch.Generator().manual_seed(11)
    for V in (64, 256, 1024, 2048):
        for scale in (0.3, 3.0, 30.0):
            w = torch.softmax(torch.randn(400, V, generator=g) * scale, -1)  # many draws: a column off by a rounding
            w[0] = 0.0
            w[0, V // 3] = 1.0  # one token
            w[1, ::2] = 0.0
            w[1, 1] = 0.5  # gaps, and mass
            u = torch.rand(400, generator=g)
            u[2], u[3] = 0.0, 1 - 2**-24
            assert torch.equal(sample_processed(w, u), sample_by_inversion(w, u))
    x = torch.randn(5, 256, generator=g) * 3
    rp = SP(temperature=0.7, top_p=0.9).rows("t", 5, 1, torch.device("cpu"), False)
    proc = _process_small(x, _small_constants(rp, 256))
    u = torch.rand(5, generator=g)
    assert proc.positive and not ss.sampling.processing.process(x, rp, logits=True).positive
    assert torch.equal(proc.sample(u), sample_by_inversion(proc.dense(), u))


def test_ops_called_in_inference_mode_leave_later_calls_outside_it_working():
    """Engines call the ops in ``torch.inference_mode`` (and the generation loop runs in it); the large temporaries
    reused across calls are ordinary tensors, so a later call outside inference mode, which writes into them,
    works and gives the same tokens. A fresh thread: the buffers are per thread, made by the first call."""
    import threading

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 1 << 15, generator=g)
    probs = torch.softmax(torch.randn(2, 3, 5000, generator=g), -1)
    q = torch.softmax(torch.randn(2, 2, 5000, generator=g), -1)
    drafts = torch.randint(0, 5000, (2, 2), generator=g)
    calls = [lambda: ss.sample_from_logits(logits, SP(temperature=0.8), ss.Philox(1)).tokens,
             lambda: ss.sample_from_logits(logits, SP(temperature=0.8, top_p=0.9), ss.Philox(1)).tokens,
             lambda: ss.verify_chain(probs, drafts, q, rng=ss.Philox(1)).tokens]
    outcome = []

    def run():
        try:
            with torch.inference_mode():
                first = [call() for call in calls]
            outcome.append(all(torch.equal(a, call()) for a, call in zip(first, calls)))
        except RuntimeError as e:
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome == [True]


def test_inputs_that_require_grad_are_taken():  # sampling and verification are not differentiable
    g = torch.Generator().manual_seed(0)
    B, K, N, V = 3, 2, 4, 5000  # rows long enough for the nucleus path's scratch buffers
    logits = torch.randn(B, V, generator=g).requires_grad_()
    probs = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1).requires_grad_()
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1).requires_grad_()
    tree_logits = torch.randn(B, N, V, generator=g).requires_grad_()
    tree_probs = torch.softmax(tree_logits.detach(), -1).requires_grad_()
    drafts = torch.randint(0, V, (B, K), generator=g)
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]] * B))
    tokens = torch.randint(0, V, (B, N), generator=g)
    outs = [
        ss.sample_from_logits(logits, SP(temperature=0.8, top_p=0.9), ss.Philox(1), num_logprobs=2).tokens,
        ss.sample_from_logits(logits, SP(temperature=0.8, top_k=5), ss.Philox(1)).tokens,
        ss.logits_to_probs(logits, SP(top_p=0.9)), ss.logits_to_probs(logits, SP(min_p=0.1)),
        ss.top_p_renorm(probs, 0.9), ss.top_k_renorm(probs, 3), ss.min_p_renorm(probs, 0.2), ss.sample(probs),
        ss.verify_chain(probs, drafts, q, rng=ss.Philox(1)).tokens,
        ss.verify_chain(probs, drafts, q, rng=ss.Philox(1)).expected_accepted,
        ss.verify_chain_from_logits(logits[:, None].expand(B, K + 1, V), drafts, SP(top_p=0.9), draft_probs=q,
                                    rng=ss.Philox(1)).tokens,
        ss.verify_tree(tree_probs, tokens, tree, method="target_only", rng=ss.Philox(1)).path,
        ss.verify_tree_from_logits(tree_logits, tokens, tree, SP(top_p=0.9), method="target_only",
                                   rng=ss.Philox(1)).path,
        ss.verify_tree_from_logits(tree_logits, tokens, tree, SP(top_p=0.9), draft_probs=tree_probs,
                                   method="traversal", rng=ss.Philox(1)).path,
    ]
    assert not any(t.requires_grad for t in outs)


def test_dense_rows_sampled_in_blocks_draw_what_one_call_per_row_draws(monkeypatch):
    # rows without top-k or top-p are sampled a few at a time on CPU (their temporaries in cache): the tokens,
    # log-probabilities and top log-probabilities are those of each row alone
    import specsampler.sampling.ops as sampling_ops

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 3000, generator=g) * 2
    params = SP(temperature=0.7, min_p=0.01)
    rng = ss.Philox(torch.arange(7) + 11)
    monkeypatch.setattr(sampling_ops, "_BLOCK_VALUES", 2 * 3000)  # blocks of two rows, the last alone
    blocked = ss.sample_from_logits(logits, params, rng, num_logprobs=3)
    monkeypatch.setattr(sampling_ops, "_BLOCK_VALUES", 1 << 30)
    whole = ss.sample_from_logits(logits, params, rng, num_logprobs=3)
    for a, b in zip(blocked, whole):
        assert torch.equal(a, b)
    for r in range(7):
        one = ss.sample_from_logits(logits[r:r + 1], params, ss.Philox(torch.tensor([r + 11])), num_logprobs=3)
        assert one.tokens.item() == blocked.tokens[r].item()
        assert torch.equal(one.top_logprobs[0], blocked.top_logprobs[r])


_EVERY_KIND = [SP(temperature=0.0), SP(temperature=0.0), SP(0.8, top_k=7), SP(0.8, top_k=7),
               SP(0.7, top_k=20, top_p=0.8), SP(0.8, top_p=0.9), SP(1.0, top_p=0.5), SP(1.3, min_p=0.1), SP(1.0),
               SP(0.6)]


def _every_kind_batch(V: int):
    """Rows of every kind (greedy, top-k, top-k + top-p, top-p with a large and a one-token nucleus, min-p,
    plain, one far from zero), a greedy and a top-k row holding a NaN, with their parameters as per-row tensors."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(len(_EVERY_KIND), V, generator=g) * 3
    logits[1, 5], logits[3, 9] = math.nan, math.nan
    logits[6, 17] = 40.0
    logits[9] += 3e7  # a plain row far from zero (its products with c would round by units)
    fields = ("temperature", "top_k", "top_p", "min_p")
    return logits, SP(*(torch.tensor([getattr(p, f) for p in _EVERY_KIND]) for f in fields))


@pytest.mark.parametrize("V", [300, 4096])
def test_a_batch_of_every_kind_draws_what_each_row_draws_alone(V):
    logits, params = _every_kind_batch(V)
    together = ss.sample_from_logits(logits, params, ss.Philox(torch.arange(len(_EVERY_KIND)) + 5))
    for r, p in enumerate(_EVERY_KIND):
        alone = ss.sample_from_logits(logits[r:r + 1], p, ss.Philox(torch.tensor([r + 5])))
        assert alone.tokens.item() == together.tokens[r].item(), r
        assert torch.equal(alone.logprobs, together.logprobs[r:r + 1]), r
    assert together.tokens[1].item() != 5  # the greedy choice never takes the NaN


def _rows_without_mass(V: int) -> dict[str, torch.Tensor]:
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    x[0, 30], x[0, V - 3] = math.inf, math.inf  # two +inf logits, neither the lowest id of a top-k's candidates
    x[1] = math.nan
    x[2, 4], x[2, 7] = math.nan, math.nan  # NaN among finite logits: no mass unless greedy (NaN never its argmax)
    x[3] = -math.inf
    return dict(zip(("+inf", "all NaN", "some NaN", "all -inf"), x))


@pytest.mark.parametrize("V", [64, 8192])
def test_a_row_without_mass_draws_0_or_its_argmax_beside_any_neighbour(V):
    # a greedy or top-k row is held by the batch's largest-k candidates: without mass it still draws token 0 (as a
    # dense row does), a greedy row its argmax (as greedy rows alone do), whatever candidates its neighbours leave
    kinds = {"greedy": SP(temperature=0.0), "top-1": SP(top_k=1), "top-3": SP(top_k=3),
             "top-3 + top-p": SP(temperature=0.7, top_k=3, top_p=0.8), "top-p": SP(top_p=0.9)}
    neighbours = [SP(top_k=5), SP(top_k=40), SP(temperature=0.0), SP(top_p=0.5)]
    other = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    fields = ("temperature", "top_k", "top_p", "min_p")
    both = lambda a, b: SP(*(torch.tensor([getattr(a, f), getattr(b, f)]) for f in fields))  # noqa: E731
    for (name, row), (kind, p) in itertools.product(_rows_without_mass(V).items(), kinds.items()):
        want = torch.where(row.isnan(), -math.inf, row).argmax().item() if kind == "greedy" else 0
        alone = ss.sample_from_logits(row[None], p, ss.Philox(torch.tensor([7])))
        assert alone.tokens.item() == want, (name, kind)
        for nb in neighbours:
            for first in (True, False):
                x = torch.stack([row, other[0]] if first else [other[0], row])
                params, seeds = (both(p, nb), [7, 9]) if first else (both(nb, p), [9, 7])
                out = ss.sample_from_logits(x, params, ss.Philox(torch.tensor(seeds)))
                chain = ss.verify_chain_from_logits(x[:, None], torch.zeros(2, 0, dtype=torch.long), params,
                                                    method="target_only", rng=ss.Philox(torch.tensor(seeds)))
                at = 0 if first else 1
                assert out.tokens[at].item() == want, (name, kind, nb)
                assert out.logprobs[at].item() == alone.logprobs.item(), (name, kind, nb)
                assert chain.tokens[at, 0].item() == want, (name, kind, nb)


def test_a_batch_of_every_kind_takes_each_kind_s_own_path(monkeypatch):
    # the plain rows are drawn without writing their distribution, as in a batch of them alone; greedy rows are
    # read with NaN as -inf only where they hold one (not every row of the batch rewritten)
    import specsampler.sampling.filters as filters
    import specsampler.sampling.ops as sampling_ops

    seen = {"plain": [], "nan": []}
    plain, nan = sampling_ops.sample_plain, filters.nan_as_minus_inf
    monkeypatch.setattr(sampling_ops, "sample_plain", lambda x, rp, u, *a: seen["plain"].append(u.numel())
                        or plain(x, rp, u, *a))
    monkeypatch.setattr(filters, "nan_as_minus_inf", lambda x: seen["nan"].append(x.shape[0]) or nan(x))
    logits, params = _every_kind_batch(4096)
    ss.sample_from_logits(logits, params, ss.Philox(torch.arange(len(_EVERY_KIND))))
    assert seen == {"plain": [3], "nan": [1]}


@pytest.fixture
def threads():
    """``threads(n)``: run the test's ops on n intra-op threads (restored after)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [3, 5, 7])
def test_a_row_processes_and_samples_as_alone_whatever_the_thread_count(threads, n):
    # ATen splits an elementwise loop over more than 32768 values among its threads, and from 3 threads up a
    # thread's share may end inside an iteration of the vectorised loop: the exponentials there rounded as the
    # scalar loop does, at places that depend on the batch (with 7 threads, rows 2, 3 and 7 of the plain batch below
    # were processed otherwise than alone); short rows of the generation loop's top-p processing included
    from specsampler.sampling.ops import _process_small, _small_constants

    threads(n)
    for B, V, params in [(9, 32000, SP(1.0)), (13, 4160, SP(0.8)), (40, 4096, SP(0.8, top_p=0.9)),
                         (5, 128256, SP(0.7, min_p=0.01))]:
        x = torch.randn(B, V, generator=torch.Generator().manual_seed(B * V)) * 3
        together = ss.logits_to_probs(x, params)
        drawn = ss.sample_from_logits(x, params, ss.Philox(torch.arange(B)), num_logprobs=2)
        for b in range(B):
            assert torch.equal(ss.logits_to_probs(x[b:b + 1], params)[0], together[b]), (B, V, b)
            alone = ss.sample_from_logits(x[b:b + 1], params, ss.Philox(torch.tensor([b])), num_logprobs=2)
            assert alone.tokens.item() == drawn.tokens[b].item() and torch.equal(alone.logprobs[0], drawn.logprobs[b])
            assert torch.equal(alone.top_logprobs[0], drawn.top_logprobs[b])
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(1)) * 3
    rp = SP(0.8, top_p=0.95).rows("t", 300, 1, torch.device("cpu"), False)
    rp_one = SP(0.8, top_p=0.95).rows("t", 1, 1, torch.device("cpu"), False)
    together = _process_small(x, _small_constants(rp, 256)).dense()
    for b in range(300):
        assert torch.equal(_process_small(x[b:b + 1], _small_constants(rp_one, 256)).dense()[0], together[b]), b


@pytest.mark.parametrize("n", [64 * 1001, 64 * 3001, 128256 * 3, 128256 * 8])
def test_exponentials_over_grid_length_buffers_round_as_on_one_thread(threads, n):
    from specsampler.sampling.rounding import grid_length

    x = -torch.rand(n, generator=torch.Generator().manual_seed(n)) * 30
    threads(1)
    want = torch.exp2(x)  # one thread: every value in the vectorised body (n is a multiple of 64)
    for t in (2, 3, 4, 5, 7, 16):
        threads(t)
        m = grid_length(n)
        assert m % 64 == 0 and n <= m < n + 64 * t
        assert torch.equal(torch.exp2(torch.nn.functional.pad(x, (0, m - n)))[:n], want), t


def test_filters_of_host_numbers_under_torch_compile_with_dynamic_shapes_give_the_eager_rows(monkeypatch):
    """A symbolic vocabulary size made the rows' kinds SymBools, whose ``^`` with a bool raised ``TypeError``; and
    dynamo warned of the exponentials' cached grid length on every trace."""
    import warnings

    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    torch._dynamo.reset()
    probs = torch.softmax(torch.randn(2, 32, generator=torch.Generator().manual_seed(0)), -1)
    f = lambda p: ss.top_k_renorm(p, 5)  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert torch.equal(torch.compile(f, dynamic=True, backend="eager")(probs), f(probs))
    assert not [w for w in seen if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_pytorch_path_under_a_plain_torch_compile_gives_the_eager_tokens(monkeypatch, backend):
    """The PyTorch path writes NumPy views in place on the CPU, which a traced graph cannot hold: with per-row
    parameters, inductor failed ("Storage size calculation overflowed") and so did dynamo's guards under
    ``inference_mode``. A call that takes the PyTorch path now runs outside the graph, as in eager mode, whatever the
    back end (inductor would also round fused loops its own way)."""
    import shutil

    if backend == "inductor" and not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor needs a C++ compiler on the CPU")
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    g = torch.Generator().manual_seed(11)
    B, K, V = 3, 2, 64
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    x = torch.randint(0, V, (B, K), generator=g)
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * B))
    params = ss.SamplingParams(temperature=torch.tensor([0.0, 0.8, 1.0]), top_k=torch.tensor([0, 5, 0]),
                               top_p=torch.tensor([1.0, 0.9, 0.7]))

    def step(seed, offset):
        rng = ss.Philox(seed, offset)
        return (ss.sample_from_logits(logits[:, 0], params, rng).tokens,
                ss.logits_to_probs(logits[:, 0], params),
                ss.verify_chain_from_logits(logits, x, params, draft_probs=q, method="token", rng=rng).tokens,
                ss.verify_tree_from_logits(logits, torch.cat([x[:, :1], x], 1), tree, params,
                                           draft_probs=torch.cat([q[:, :1], q], 1), method="rrs", rng=rng).tokens)

    args = (torch.arange(B) + 3, torch.full((B,), 5))
    for mode in (torch.no_grad, torch.inference_mode):
        torch._dynamo.reset()
        with mode():
            want = step(*args)
            got = torch.compile(step, backend=backend)(*args)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), mode.__name__


@pytest.mark.parametrize(("logits", "temperature"), [
    ([-11e6, -11e6 + 1, -11e6 + 2, -11e6 + 3], 1.0),  # |top * c| near 2**24
    ([100.0, 100.0 - 2**-17, 100.0 - 2**-16, 99.9999], 1e-5),
    ([-1e5, -1e5 + 0.5, -1e5 + 2.0, -1e5 + 2.25], 1.0),
])
def test_logits_far_from_zero_keep_their_exact_distribution(logits, temperature):
    """The weights were ``2 ** (x * c - top * c)``: each product rounded by up to half a unit of ``top * c``, so
    logits near -1.1e7 at T = 1 were sampled 0.036/0.076/0.297/0.591 against the exact 0.032/0.087/0.237/0.644 (an
    exactness audit's chi-square, p = 0). Subtracting first, each probability is within float32 rounding."""
    x = torch.tensor([logits])
    exact = torch.softmax((x.double() - x.double().max()) / temperature, -1)
    params = ss.SamplingParams(temperature=temperature)
    torch.testing.assert_close(ss.logits_to_probs(x, params).double(), exact, rtol=1e-5, atol=1e-9)
    for top_p in (1.0, 0.9):  # the plain path and the nucleus path
        p, order = exact[0].sort(descending=True)
        nucleus = torch.zeros_like(p).scatter_(0, order, torch.where(p.cumsum(0) - p < top_p, p, 0.0))
        nucleus /= nucleus.sum()
        out = ss.sample_from_logits(x.expand(64, -1), ss.SamplingParams(temperature=temperature, top_p=top_p),
                                    ss.Philox(torch.arange(64)))
        torch.testing.assert_close(out.logprobs.exp().double(), nucleus[out.tokens], rtol=1e-5, atol=1e-9)
