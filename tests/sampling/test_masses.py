"""Exact masses (sampling/masses.py): sums that do not depend on the order of the additions, top-p targets and
draws on them, and the two-step inversion of wide rows equal to the plain one."""

from __future__ import annotations

import torch

import specsampler as ss
from specsampler.sampling.masses import MASS_BITS, draw_target, invert, masses, row_mass, sample_by_inversion


def test_a_rows_mass_is_the_same_integer_in_any_order_and_split():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(3, 5000, generator=g) ** 8  # many scales
    exact = [sum(int(v * 2**MASS_BITS) for v in row.tolist()) for row in w]
    assert row_mass(w).tolist() == exact
    perm = torch.randperm(5000, generator=g)
    assert row_mass(w[:, perm]).tolist() == exact
    parts = [row_mass(p) for p in w.split([1, 1700, 3299], dim=1)]  # shards of a vocabulary
    assert (parts[0] + parts[1] + parts[2]).tolist() == exact


def test_masses_stay_in_range_whatever_the_values():
    w = torch.tensor([[float("nan"), -1.0, 2.0, float("inf"), 0.5, 1e-12]])
    assert masses(w).tolist() == [[0.0, 0.0, 2.0**MASS_BITS, 2.0**MASS_BITS, 2.0 ** (MASS_BITS - 1), 0.0]]


def test_wide_rows_draw_the_token_of_the_plain_inversion():
    # rows of 4096 and 3000 (padded to whole chunks) ids, with zeros, at uniforms landing on chunk edges too
    g = torch.Generator().manual_seed(1)
    for C in (4096, 3000):
        w = torch.rand(64, C, generator=g) * (torch.rand(64, C, generator=g) < 0.3)
        w[0] = 0.0  # a row without mass
        m = masses(w)
        cum = m.cumsum(-1)
        u = torch.rand(64, generator=g)
        u[1] = float(cum[1, 255] / cum[1, -1])  # at the end of the first chunk
        want = invert(cum, draw_target(u, cum[:, -1]))
        got = sample_by_inversion(w, u)
        assert torch.equal(got, want)
        assert got[0] == 0 and bool((m[1:].gather(1, got[1:, None]) > 0).all())  # never a token without mass


def test_a_request_draws_the_same_token_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 3000, generator=g) * 3
    params = ss.SamplingParams(temperature=0.9, top_p=torch.rand(9, generator=g) * 0.9 + 0.05)
    rng = ss.Philox(torch.arange(9) * 7, 3)
    batch = ss.sample_from_logits(logits, params, rng).tokens
    for b in range(9):
        one = ss.sample_from_logits(logits[b:b + 1], ss.SamplingParams(temperature=0.9, top_p=params.top_p[b:b + 1]),
                                    ss.Philox(torch.tensor([b * 7]), 3)).tokens
        assert one.item() == batch[b].item()


def test_unnormalised_probabilities_above_one_are_scaled_not_clamped():
    probs = torch.tensor([[3.0, 1.0]]).expand(4000, 2)
    tokens = ss.sample(probs, ss.Philox(torch.arange(4000)))
    share = (tokens == 0).float().mean().item()
    assert abs(share - 0.75) < 0.03  # clamped to 1 each, it would be 0.5
