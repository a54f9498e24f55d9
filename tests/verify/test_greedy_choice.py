"""The greedy choice is one rule on every path: the argmax with ties to the lowest id, a NaN never chosen (a row
of NaN gives 0). The kernels compared so from the start; the PyTorch path took ``torch.argmax``, which picks the
first NaN, so the same greedy verification gave another token on each back end."""

from __future__ import annotations

import pytest
import torch

import specsampler as ss

NAN = float("nan")
# per row: a NaN before the maximum, ties after a NaN, all NaN, +inf and a NaN
LOGITS = torch.tensor([[1.0, NAN, 3.0, 3.0], [0.0, 1.0, NAN, 2.0], [NAN] * 4, [NAN, float("inf"), 0.0, 0.0]])
CHOICE = [2, 3, 0, 1]


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("SPECSAMPLER_BACKEND", request.param)
    return request.param


def test_greedy_chain_verification_never_chooses_a_nan(backend):
    logits = LOGITS[:, None].expand(4, 2, 4).contiguous()
    drafts = torch.tensor(CHOICE)[:, None]  # each draft is the choice: accepted, then the choice again
    res = ss.verify_chain_from_logits(logits, drafts, method="greedy")
    assert res.tokens.tolist() == [[c, c] for c in CHOICE]
    # probabilities: a NaN is read as weight 0 (the error policy), so never the largest
    probs = torch.tensor([[0.1, NAN, 0.45, 0.45], [0.1, 0.2, NAN, 0.7], [NAN] * 4, [NAN, 0.5, 0.25, 0.25]])
    res = ss.verify_chain(probs[:, None].expand(4, 2, 4).contiguous(), drafts, method="greedy")
    assert res.tokens[:, 0].tolist() == CHOICE


def test_greedy_tree_verification_never_chooses_a_nan(backend):
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0]] * 4))
    res = ss.verify_tree_from_logits(LOGITS[:, None].expand(4, 2, 4).contiguous(),
                                     torch.tensor([[0, c] for c in CHOICE]), tree, method="greedy")
    assert res.tokens.tolist() == [[c, c] for c in CHOICE]


def test_greedy_sampling_never_chooses_a_nan(backend):
    params = ss.SamplingParams(temperature=0.0)
    out = ss.sample_from_logits(LOGITS, params)
    assert out.tokens.tolist() == CHOICE
    # a greedy row is one-hot at its choice, with mass where that maximum is finite (NaN aside)
    assert out.logprobs.tolist() == [0.0, 0.0, float("-inf"), float("-inf")]
    probs = ss.logits_to_probs(LOGITS, params)
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0] * 4, [0.0] * 4]
