"""Fuzzing chain verification (verify_chain, verify_chain_from_logits; every method, ragged chains)
against the error policy (see fuzzkit), on both back ends."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from fuzzkit import (
    BACKENDS,
    FLOAT_DTYPES,
    INT_DTYPES,
    LOGIT_CLASSES,
    PROB_CLASSES,
    Ids,
    Mask,
    Params,
    Rng,
    Values,
    bad_logits,
    bad_probs,
    build_mask,
    build_params,
    build_rng,
    call_contract,
    check_chain_result,
    fuzz,
    fuzz_report,  # noqa: F401  (autouse: the examples-run report)
    garbage_strategy,
    ids_strategy,
    make_ids,
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

METHODS = ("auto", "token", "block", "target_only", "greedy", "auto", "token", "block", "unknown")


@dataclass(frozen=True)
class ChainCase:
    B: int
    K: int
    V: int
    target: Values
    drafts: Ids
    method: str
    with_q: bool
    q: Values
    num_drafts: tuple[int, ...] | None
    num_drafts_dtype: torch.dtype
    params: Params
    mask: Mask
    rng: Rng
    validate: str


@st.composite
def chain_cases(draw, backend: str, from_logits: bool) -> ChainCase:
    B = draw(st.integers(0, 3) if backend == "torch" else st.integers(1, 2))
    K = draw(st.integers(0, 4) if backend == "torch" else st.integers(0, 3))
    V = draw(vocab(backend))
    method = draw(st.sampled_from(METHODS))
    sampled = method in ("token", "block") or (method == "auto" and draw(st.booleans()))
    with_q = sampled if draw(st.integers(0, 9)) else not sampled  # sometimes the wrong way round
    ragged = draw(st.booleans())
    num_drafts = tuple(draw(st.integers(-1 if ragged else 0, K + 1 if ragged else K)) for _ in range(B)) if (
        draw(st.booleans())) else None
    classes = LOGIT_CLASSES if from_logits else PROB_CLASSES
    garbage = draw(st.integers(0, 2)) == 0  # a third of the examples: bad values everywhere, default validation
    values = garbage_strategy if garbage else values_strategy
    return ChainCase(B, K, V, draw(values(classes, FLOAT_DTYPES)), draw(ids_strategy(garbage)), method, with_q,
                     draw(values(PROB_CLASSES, FLOAT_DTYPES)), num_drafts,
                     draw(st.sampled_from(INT_DTYPES)), draw(params_strategy(B)) if from_logits else None,
                     draw(mask_strategy()) if from_logits else Mask("none", 0), draw(rng_strategy()),
                     "structure" if garbage else draw(st.sampled_from(("structure", "full"))))


def _resolved(case: ChainCase) -> str:
    return ("token" if case.with_q else "target_only") if case.method == "auto" else case.method


def _check(case: ChainCase, from_logits: bool):
    B, K, V = case.B, case.K, case.V
    shape = (B, K + 1, V)
    target = (make_logits if from_logits else make_probs)(case.target, shape)
    drafts = make_ids(case.drafts, (B, K), V)
    q = make_probs(case.q, (B, K, V)) if case.with_q else None
    n = None if case.num_drafts is None else torch.tensor(case.num_drafts, dtype=case.num_drafts_dtype).reshape(B)
    mask = build_mask(case.mask, shape) if from_logits else None
    rng = build_rng(case.rng, B)
    method = _resolved(case)
    structural = (
        method == "unknown"
        or (method in ("token", "block") and q is None)
        or (method == "target_only" and q is not None)
        or (n is not None and bool(((n < 0) | (n > K)).any()))
        or case.rng.kind in ("philox_bad_shape", "bad_type")
        or (from_logits and (case.params.bad or mask_is_structurally_bad(case.mask, shape)))
    )
    bad_values = False
    if case.validate == "full":
        # what each request uses: its drafts (and their draft rows), and target rows up to its bonus row; the rest
        # is padding, never read
        nd = (torch.full((B,), K) if n is None else n.long().clamp(0, K))[:, None]
        used, live = torch.arange(K) < nd, torch.arange(K + 1) <= nd
        x = drafts.long()
        bad_values = (
            bool((((x < 0) | (x >= V)) & used).any())
            or (bad_logits(target, live) if from_logits else bad_probs(target, live))
            or (q is not None and bad_probs(q, used))
            or (from_logits and mask_has_empty_row(mask, shape, live))
        )
    if from_logits:
        call = lambda: ss.verify_chain_from_logits(target, drafts, build_params(case.params), draft_probs=q,
                                                   num_drafts=n, method=case.method, rng=rng, vocab_mask=mask,
                                                   validate=case.validate)
    else:
        call = lambda: ss.verify_chain(target, drafts, q, num_drafts=n, method=case.method, rng=rng,
                                       validate=case.validate)
    out = call_contract(call, [target, drafts, q, n, mask, rng], must_raise=structural or bad_values,
                        must_pass=not structural and not bad_values, value_error=bad_values and not structural)
    if out.error is None:
        check_chain_result(out.result, drafts, n, V)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_chain_gives_a_clear_error_or_a_valid_chain_result(backend):
    fuzz("verify_chain", backend, chain_cases(backend, False), lambda case: _check(case, False), n=(80, 30))


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_chain_from_logits_gives_a_clear_error_or_a_valid_chain_result(backend):
    fuzz("verify_chain_from_logits", backend, chain_cases(backend, True), lambda case: _check(case, True), n=(80, 25))
