"""Fuzzing ``specsampler.parallel`` against the error policy on a gloo group of one process (the whole
vocabulary on one shard; tests/parallel checks the splits): a clear error, or the one-device op's results, with
inputs unchanged, greedy and sampled rows alike, with either strategy (the rows processed on the shard, or
gathered)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from fuzzkit import (
    FLOAT_DTYPES,
    LOGIT_CLASSES,
    Values,
    assert_ids,
    bad_logits,
    call_contract,
    fuzz,
    fuzz_report,  # noqa: F401  (autouse: the examples-run report)
    make_logits,
    values_strategy,
)
from hypothesis import strategies as st

import specsampler as ss
from specsampler import parallel


@pytest.fixture(scope="module", autouse=True)
def group_of_one():
    if dist.is_initialized():  # another test of this worker left one
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@dataclass(frozen=True)
class Case:
    B: int
    K: int
    V: int
    values: Values
    greedy: bool
    masked: bool
    drafts_seed: int
    validate: str


@st.composite
def cases(draw) -> Case:
    return Case(draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 70)),
                draw(values_strategy(LOGIT_CLASSES, FLOAT_DTYPES)),
                draw(st.sampled_from((True, True, True, False))), draw(st.booleans()), draw(st.integers(0, 99)),
                draw(st.sampled_from(("structure", "full"))))


def test_parallel_ops_give_a_clear_error_or_the_one_device_results():
    def body(case: Case):
        V = case.V
        logits = make_logits(case.values, (case.B, case.K + 1, V))
        g = torch.Generator().manual_seed(case.drafts_seed)
        drafts = torch.randint(-1, V + 1, (case.B, case.K), generator=g)
        mask = (torch.rand(case.B, case.K + 1, V, generator=g) < 0.8) if case.masked else None
        params = ss.SamplingParams(temperature=0.0 if case.greedy else 0.7)
        shard = parallel.VocabShard(0, V, V)
        bad = case.validate == "full" and (bad_logits(logits) or bool(((drafts < 0) | (drafts >= V)).any()))
        rng = ss.Philox(torch.arange(case.B) + case.drafts_seed)
        for strategy in ("shard", "gather"):
            out = call_contract(lambda strategy=strategy: parallel.verify_chain_from_logits(
                logits, drafts, params, method="target_only", rng=rng, vocab_mask=mask, shard=shard,
                validate=case.validate, strategy=strategy), [logits, drafts, mask], must_raise=bad, must_pass=not bad,
                value_error=bad)
            if out.error is not None:
                return
            res = out.result
            assert_ids(res.tokens, V, pad=True, what="ChainResult.tokens")
            want = ss.verify_chain_from_logits(logits, drafts, params, method="target_only", rng=rng, vocab_mask=mask)
            assert torch.equal(res.tokens, want.tokens) and torch.equal(res.num_accepted, want.num_accepted)
            rows = logits[:, 0]
            row_mask = None if mask is None else mask[:, 0]
            sampled = parallel.sample_from_logits(rows, params, rng, vocab_mask=row_mask, num_logprobs=2, shard=shard,
                                                  strategy=strategy)
            one = ss.sample_from_logits(rows, params, rng, vocab_mask=row_mask, num_logprobs=2)
            assert all(torch.equal(a, b) for a, b in zip(sampled, one)), strategy

    fuzz("parallel", "torch", cases(), body, n=(40, 0))
