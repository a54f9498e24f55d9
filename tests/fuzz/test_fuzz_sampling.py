"""Fuzzing the sampling ops against the error policy (see fuzzkit): logits_to_probs, the three renorm
filters, sample and sample_from_logits (with top-N log-probabilities), on both back ends."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from fuzzkit import (
    BACKENDS,
    FLOAT_DTYPES,
    LOGIT_CLASSES,
    PROB_CLASSES,
    Mask,
    Params,
    Rng,
    Values,
    assert_ids,
    bad_logits,
    bad_probs,
    build_mask,
    build_params,
    build_rng,
    call_contract,
    fuzz,
    fuzz_report,  # noqa: F401  (autouse: the examples-run report)
    make_logits,
    make_probs,
    mask_has_empty_row,
    mask_is_structurally_bad,
    mask_strategy,
    params_strategy,
    rng_strategy,
    values_strategy,
    vocab,
)
from hypothesis import strategies as st

import specsampler as ss


@dataclass(frozen=True)
class LogitsCase:
    shape: tuple[int, ...]
    values: Values
    params: Params
    mask: Mask
    rng: Rng
    validate: str
    num_logprobs: int


@st.composite
def logits_cases(draw, backend: str) -> LogitsCase:
    B = draw(st.integers(0, 3))
    V = draw(vocab(backend))
    shape = (B, *draw(st.sampled_from(((), (2,), (1,), (2, 1)))), V)
    return LogitsCase(shape, draw(values_strategy(LOGIT_CLASSES, FLOAT_DTYPES)), draw(params_strategy(B)),
                      draw(mask_strategy()), draw(rng_strategy()), draw(st.sampled_from(("structure", "full"))),
                      draw(st.sampled_from((0, 0, 1, 3, V, V + 2, -1))))


def _structural(case: LogitsCase) -> bool:
    """Whether the call must fail whatever the values (bad parameters, mask, rng or num_logprobs)."""
    return (case.params.bad or mask_is_structurally_bad(case.mask, case.shape) or case.num_logprobs < 0
            or case.rng.kind in ("philox_bad_shape", "bad_type"))


def _has_mass(probs: torch.Tensor) -> torch.Tensor:
    return probs.sum(-1) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_from_logits_gives_a_clear_error_or_tokens_in_range(backend):
    def body(case: LogitsCase):
        logits = make_logits(case.values, case.shape)
        mask = build_mask(case.mask, case.shape)
        V = case.shape[-1]
        full = case.validate == "full"
        bad_values = full and (bad_logits(logits) or mask_has_empty_row(mask, case.shape))
        structural = _structural(case)
        rng_made = build_rng(case.rng, case.shape[0])

        def call():
            return ss.sample_from_logits(logits, build_params(case.params), rng_made, mask, case.num_logprobs,
                                         validate=case.validate)

        out = call_contract(call, [logits, mask, rng_made], must_raise=structural or bad_values,
                            must_pass=not structural and not bad_values, value_error=bad_values and not structural)
        if out.error is not None:
            return
        res = out.result
        lead = case.shape[:-1]
        assert res.tokens.shape == lead and res.logprobs.shape == lead and res.logprobs.dtype == torch.float32
        assert_ids(res.tokens, V, pad=False, what="SampleOutput.tokens")
        assert not bool((res.logprobs > 1e-5).any()), "a log-probability above 0"
        if case.num_logprobs:
            n = case.num_logprobs
            assert res.top_token_ids.shape == (*lead, n) and res.top_logprobs.shape == (*lead, n)
            assert_ids(res.top_token_ids, V, pad=True, what="SampleOutput.top_token_ids")
            ids = res.top_token_ids.reshape(-1, n)
            for row in ids.tolist():
                kept = [t for t in row if t >= 0]
                assert len(kept) == len(set(kept)), f"top tokens repeat: {row}"
            pad_lp = res.top_logprobs.reshape(-1, n)[ids < 0]
            assert bool((pad_lp == float("-inf")).all()), "a -1 top token without log-probability -inf"
        if case.values.kind in ("clean", "masked", "masked_row"):  # valid logits: the token has probability > 0
            probs = ss.logits_to_probs(logits, build_params(case.params), mask)
            drawn = probs.gather(-1, res.tokens[..., None])[..., 0]
            assert bool((drawn[_has_mass(probs)] > 0).all()), "a token of probability 0 drawn from a row with mass"

    fuzz("sample_from_logits", backend, logits_cases(backend), body, n=(60, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_to_probs_gives_a_clear_error_or_distributions(backend):
    def body(case: LogitsCase):
        logits = make_logits(case.values, case.shape)
        mask = build_mask(case.mask, case.shape)
        full = case.validate == "full"
        bad_values = full and (bad_logits(logits) or mask_has_empty_row(mask, case.shape))
        structural = case.params.bad or mask_is_structurally_bad(case.mask, case.shape)
        call = lambda: ss.logits_to_probs(logits, build_params(case.params), mask, validate=case.validate)
        out = call_contract(call, [logits, mask], must_raise=structural or bad_values,
                            must_pass=not structural and not bad_values, value_error=bad_values and not structural)
        if out.error is not None:
            return
        probs = out.result
        assert probs.shape == case.shape and probs.dtype == torch.float32
        if case.values.kind in ("clean", "masked", "masked_row"):
            assert bool(torch.isfinite(probs).all()) and bool(((probs >= 0) & (probs <= 1)).all())
            sums = probs.sum(-1)
            assert bool((((sums - 1).abs() < 1e-4) | (sums == 0)).all()), f"row sums {sums.flatten()[:8].tolist()}"

    fuzz("logits_to_probs", backend, logits_cases(backend), body, n=(40, 4))


@dataclass(frozen=True)
class ProbsCase:
    shape: tuple[int, ...]
    values: Values
    op: str
    param: object  # the filter's value (scalar, list for a [B] tensor, or a tuple for a 0-d tensor)
    rng: Rng
    validate: str


FILTER_VALUES = {"top_k_renorm": (0, 1, 2, -3, 10**6, 2.5), "top_p_renorm": (1.0, 0.5, 1e-6, 0.0, 1.5, float("nan")),
                 "min_p_renorm": (0.0, 0.3, 1.0, -0.1, 1.5, float("nan")), "sample": (None,)}
BAD_FILTER = {"top_k_renorm": (2.5,), "top_p_renorm": (0.0, 1.5), "min_p_renorm": (-0.1, 1.5)}


@st.composite
def probs_cases(draw, backend: str) -> ProbsCase:
    B = draw(st.integers(0, 3))
    V = draw(vocab(backend))
    shape = (B, *draw(st.sampled_from(((), (2,), (1,)))), V)
    op = draw(st.sampled_from(tuple(FILTER_VALUES)))
    pool = FILTER_VALUES[op]
    form = draw(st.sampled_from(("scalar", "tensor", "0-d")))
    if op == "sample":
        param = None
    elif form == "scalar":
        param = draw(st.sampled_from(pool))
    elif form == "0-d":
        param = (draw(st.sampled_from(pool)),)
    else:
        param = [draw(st.sampled_from(pool)) for _ in range(B)]
    return ProbsCase(shape, draw(values_strategy(PROB_CLASSES, FLOAT_DTYPES)), op, param, draw(rng_strategy()),
                     draw(st.sampled_from(("structure", "full"))))


def _filter_arg(case: ProbsCase):
    p = case.param
    dtype = torch.int64 if case.op == "top_k_renorm" else torch.float32
    if isinstance(p, tuple):
        return torch.tensor(p[0], dtype=torch.float32 if isinstance(p[0], float) else dtype)
    if isinstance(p, list):
        return torch.tensor(p, dtype=torch.float32 if any(isinstance(v, float) for v in p) else dtype)
    return p


def _filter_is_bad(case: ProbsCase) -> bool:
    vals = case.param if isinstance(case.param, (list, tuple)) else [case.param]
    bad = BAD_FILTER.get(case.op, ())
    if case.op == "top_k_renorm":  # a float top-k (tensor or scalar) is the wrong type
        return any(isinstance(v, float) for v in vals)
    return any(v in bad or (isinstance(v, float) and v != v) for v in vals)


@pytest.mark.parametrize("backend", BACKENDS)
def test_renorm_filters_and_sample_give_a_clear_error_or_outputs_in_range(backend):
    def body(case: ProbsCase):
        probs = make_probs(case.values, case.shape)
        V = case.shape[-1]
        full = case.validate == "full"
        bad_values = full and bad_probs(probs)
        rng_made = build_rng(case.rng, case.shape[0])
        arg = _filter_arg(case)
        if case.op == "sample":
            structural = case.rng.kind in ("philox_bad_shape", "bad_type")
            call = lambda: ss.sample(probs, rng_made, validate=case.validate)
        else:
            structural = _filter_is_bad(case)
            call = lambda: getattr(ss, case.op)(probs, arg, validate=case.validate)
        out = call_contract(call, [probs, arg, rng_made], must_raise=structural or bad_values,
                            must_pass=not structural and not bad_values, value_error=bad_values and not structural)
        if out.error is not None:
            return
        clean = case.values.kind in ("clean", "unnormalised", "tiny")
        # the Triton interpreter converts bf16 to float32 flushing subnormals to 0 (a GPU converts them exactly)
        flushed = backend == "triton" and case.values.kind == "tiny" and case.values.dtype == torch.bfloat16
        if case.op == "sample":
            tokens = out.result
            assert tokens.shape == case.shape[:-1]
            assert_ids(tokens, V, pad=False, what="sample")
            if clean and not flushed:
                # weights as sample reads them: an unnormalised half-precision row may overflow to +inf, weight 0
                p = probs.float().nan_to_num(posinf=0.0)
                drawn = p.gather(-1, tokens[..., None])[..., 0]
                assert bool((drawn[p.sum(-1) > 0] > 0).all()), "a token of probability 0 drawn from a row with mass"
            return
        res = out.result
        assert res.shape == case.shape and res.dtype == torch.float32
        if clean:
            assert bool(torch.isfinite(res).all()) and bool((res >= 0).all()), "a filter made a bad probability"
            sums = res.sum(-1)
            # a kept mass below float32's smallest normal number is divided by that number, not by itself (a
            # documented limit): the row sums to less than 1
            tiny = case.values.kind == "tiny"
            ok = ((sums - 1).abs() < 1e-4) | (sums == 0) | (tiny & (sums <= 1))
            assert bool(ok.all()), f"row sums {sums.flatten()[:8].tolist()}"

    fuzz("renorm_and_sample", backend, probs_cases(backend), body, n=(80, 10))

