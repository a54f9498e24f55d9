"""The chain-verification-from-logits kernel (run in the Triton interpreter without a GPU) against
specsampler.verify_chain_from_logits.

Both run on the same random streams (in-kernel Philox, or the uniforms a torch.Generator gives the
reference, in its order), so tokens and num_accepted must be identical. The kernel's sums are taken
in another order than torch's; over these cases no acceptance test or draw falls on a float rounding
tie, so no mismatch is allowed. Small ``chunk``/``cand`` configurations of the row descriptors send
rows through every path (kept tokens in registers, or the passes over a whole row) on small vocabularies.
"""

import math
import os
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from kernelcheck import DEVICE, assert_same_chain, chain_shape, recorded_loads, row_reads, to_device

import specsampler as ss
from specsampler import SamplingParams as SP
from specsampler.kernels import chain as kchain
from specsampler.kernels import sampling as ksampling
from specsampler.sampling.processing import sample_by_inversion

METHODS = ("token", "block", "target_only", "greedy")
SAMPLED = ("token", "block")
K_MAX = 4
CONFIGS = [(8, 16), (16, 32), (4, 16)]  # (chunk, cand) of the row descriptors


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    """The reference (specsampler.verify_chain_from_logits) runs its PyTorch code whatever SPECSAMPLER_BACKEND says."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")


class Case(NamedTuple):
    logits: torch.Tensor  # [B, K+1, V]
    params: SP
    mask: torch.Tensor | None  # bool, broadcastable to [B, K+1, V]
    x: torch.Tensor  # [B, K]
    q: torch.Tensor | None  # [B, K, V]
    n: torch.Tensor | None  # [B]


def _random_logits(g, shape, kind):
    if kind == "ties":  # integer-valued: many exact ties, also at the argmax and the top-k / top-p cuts
        return torch.randint(-3, 3, shape, generator=g).float()
    if kind == "peaked":  # one token far above the others at most positions: long accepted runs
        top = torch.randint(0, shape[-1], (*shape[:-1], 1), generator=g)
        bump = 15.0 * (torch.rand(*shape[:-1], 1, generator=g) < 0.9)
        return torch.randn(shape, generator=g) + bump * (torch.arange(shape[-1]) == top)
    return torch.randn(shape, generator=g) * float(torch.empty(1).uniform_(0.3, 6.0, generator=g))


def _random_params(g, B, V):
    """Per-request params mixing greedy, top-k, top-p, both, min-p, nothing and all (k out of range too)."""
    kind = torch.randint(0, 7, (B,), generator=g)
    temperature = torch.where(kind == 0, 0.0, torch.empty(B).uniform_(0.3, 2.0, generator=g))
    top_k = torch.randint(-1, V + 3, (B,), generator=g)
    size = torch.rand(B, generator=g)  # k of 1 to 3, or up to 14 (kept tokens in registers), or any
    top_k = torch.where(size < 0.6, torch.randint(4, 15, (B,), generator=g), top_k)
    top_k = torch.where(size < 0.3, torch.randint(1, 4, (B,), generator=g), top_k)
    top_k = torch.where((kind == 1) | (kind == 3) | (kind == 6), top_k.clamp(min=1), 0)
    top_p = torch.where((kind == 2) | (kind == 3) | (kind == 6), torch.empty(B).uniform_(0.05, 0.99, generator=g), 1.0)
    min_p = torch.where((kind == 4) | (kind == 6), torch.empty(B).uniform_(0.0, 0.4, generator=g), 0.0)
    return SP(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _random_mask(g, B, K1, V):
    """None, or a bool mask of one of the broadcast shapes [V], [B, 1, V], [B, K+1, V]; every row keeps a token."""
    shape = [None, (V,), (B, 1, V), (B, K1, V)][int(torch.randint(0, 4, (1,), generator=g))]
    if shape is None:
        return None
    mask = torch.rand(shape, generator=g) < 0.8
    return mask | (torch.arange(V) == torch.randint(0, V, (*shape[:-1], 1), generator=g))


def _dist(g, shape, V, spread):
    return torch.softmax(torch.randn(*shape, V, generator=g) * spread, -1)


def _case(g, method, B, K, V, kind, far=0.5, noise=True):
    """Inputs for ``method``: drafts often the target's choice (long accepted runs), sometimes (``noise``) any
    token (often probability 0) or out of range; for token/block draft distributions near the processed target,
    or (a fraction ``far`` of the requests) farther."""
    logits = _random_logits(g, (B, K + 1, V), kind)
    params = _random_params(g, B, V)
    mask = _random_mask(g, B, K + 1, V)
    p = ss.logits_to_probs(logits, params, mask)
    q = None
    if method in SAMPLED:
        # p tilted at random (so that u decides many tests), plus a little of another distribution (drafts where
        # p = 0); q = p exactly only where p is exact in both (one-hot rows: the residual has no mass), as a q equal
        # to the reference's p up to rounding leaves a residual of rounding noise, drawn from as it is
        sigma = torch.rand(B, 1, 1, generator=g) * torch.where(torch.rand(B, 1, 1, generator=g) < far, 2.0, 0.1)
        q = p[:, :K] * torch.exp(sigma * torch.randn(B, K, V, generator=g))
        mix = 0.05 * torch.rand(B, 1, 1, generator=g)
        q = (1 - mix) * q / q.sum(-1, keepdim=True) + mix * _dist(g, (B, K), V, 2.0)
        one_hot = (torch.as_tensor(params.temperature) == 0) | (torch.as_tensor(params.top_k) == 1)
        q = torch.where((one_hot & (torch.rand(B, generator=g) < 0.7))[:, None, None], p[:, :K], q)
        x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K) if K else torch.zeros(B, 0).long()
    else:  # a deterministic drafter that agrees with the target's most likely token
        x = p[:, :K].argmax(-1)
    noise = torch.rand(B, K, generator=g) if noise else torch.full((B, K), 0.5)
    x = torch.where(noise < 0.05, torch.randint(0, V, (B, K), generator=g), x)
    bad = torch.tensor([-1, V, V + 7, 2**40])[torch.randint(0, 4, (B, K), generator=g)]
    x = torch.where(noise > 0.97, bad, x)  # out of range: never accepted
    n = torch.randint(0, K + 1, (B,), generator=g)
    return Case(logits, params, mask, x, q, n)


def _reference(c: Case, method, rng):
    return ss.verify_chain_from_logits(c.logits, c.x, c.params, draft_probs=c.q, num_drafts=c.n, method=method,
                                       rng=rng, vocab_mask=c.mask)


def _row_params(params: SP, B: int, K1: int) -> tuple:
    """(temperature, top_k, top_p, min_p) of each row ``[B * (K+1)]``, as the reference builds them."""
    rp = params.rows("test", B, K1, torch.device(DEVICE), False)
    return rp.temperature, rp.top_k, rp.top_p, rp.min_p


def _kernel(c: Case, method, rng, cfg=CONFIGS[0], block_v=64, flat_mask=False, rows_in_parallel=False, **tuning):
    """The kernel with rng a Philox, or a torch.Generator whose uniforms are drawn here as the reference draws
    them (STREAM_SAMPLE [B, K+1], then STREAM_ACCEPT for token and block). The mask is passed as a strided
    [B, K+1, V] view, or (flat_mask) copied to [B * (K+1), V]. By default the chain kernel describes the
    rows itself (the launcher's choice for large batches; these are small)."""
    B, K1, V = c.logits.shape
    mask = None if c.mask is None else c.mask.expand(B, K1, V)
    if mask is not None and flat_mask:
        mask = mask.reshape(B * K1, V)
    seed = offset = u_accept = u_sample = None
    if isinstance(rng, ss.Philox):
        seed, offset = rng.keys("test", B, c.logits.device)
    else:
        u_sample = torch.rand(B, K1, generator=rng).to(DEVICE)
        u_accept = torch.rand(B, K1, generator=rng).to(DEVICE) if method in SAMPLED else None
    return kchain.verify_chain_from_logits(c.logits, c.x, c.q, c.n, method, *_row_params(c.params, B, K1), mask, seed,
                                           offset, u_accept, u_sample, block_v=block_v, chunk=cfg[0], cand=cfg[1],
                                           rows_in_parallel=rows_in_parallel, **tuning)


@pytest.mark.parametrize("method", METHODS)
def test_kernel_equals_the_reference_on_philox_streams(method):
    g = torch.Generator().manual_seed(100 + METHODS.index(method))
    lengths = set()
    for case in range(10):
        B, K, V = chain_shape(g, 5, K_MAX) if case else (5, K_MAX, 257)
        kind = ("peaked", "normal", "ties")[case % 3]
        c = _case(g, method, B, K, V, kind, far=0.5 if case else 0.0, noise=case > 0)
        if case == 0:  # chains of K and K - 1 drafts: long accepted runs are likely
            c = c._replace(n=K - torch.arange(B) % 2)
        if case % 4 == 1:  # half-precision logits
            c = c._replace(logits=c.logits.to((torch.float16, torch.bfloat16)[case % 8 // 4]))
        c = to_device(c)
        rng = ss.Philox(torch.randint(-(2**62), 2**62, (B,), generator=g).to(DEVICE),
                        torch.randint(0, 2**40, (B,), generator=g).to(DEVICE))
        ref = _reference(c, method, rng)
        out = _kernel(c, method, rng, CONFIGS[case % 3], block_v=(64, 128, 512)[case % 3], flat_mask=case % 2 == 0,
                      rows_in_parallel=case % 4 >= 2)  # either way the same tokens
        assert_same_chain(out, ref, f"{method} case {case} {kind} B={B} K={K} V={V} {c.logits.dtype} {c.params}")
        lengths |= set(ref.num_accepted.tolist())
    assert lengths == set(range(K_MAX + 1)), f"acceptance lengths seen: {sorted(lengths)}"


@pytest.mark.parametrize("method", METHODS)
def test_kernel_equals_the_reference_on_a_torch_generator(method):
    g = torch.Generator().manual_seed(200 + METHODS.index(method))
    for case in range(3):
        B, K, V = chain_shape(g, 5, K_MAX)
        c = to_device(_case(g, method, B, K, V, ("normal", "ties", "peaked")[case]))
        ref = _reference(c, method, torch.Generator().manual_seed(case))
        out = _kernel(c, method, torch.Generator().manual_seed(case), CONFIGS[case % 3], rows_in_parallel=case == 1)
        assert_same_chain(out, ref, f"{method} case {case} B={B} K={K} V={V} {c.params}")


@pytest.mark.parametrize("method", METHODS)
def test_empty_chains_full_chains_and_strided_half_precision_logits(method):
    g = torch.Generator().manual_seed(300 + METHODS.index(method))
    B, K, V = 4, 3, 131
    rng = ss.Philox(torch.arange(B, device=DEVICE) * 7919, torch.full((B,), 3, device=DEVICE))
    for k in (0, K):  # K = 0: only the bonus row; num_drafts None: all K drafts
        c = to_device(_case(g, method, B, k, V, "peaked")._replace(n=None))
        assert_same_chain(_kernel(c, method, rng), _reference(c, method, rng), f"{method} K={k}")
    c = to_device(_case(g, method, B, K, V, "normal"))
    wide = torch.zeros(B, K + 3, V + 5, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 1 : K + 2, :V] = c.logits.bfloat16()  # a [B, K+1, V] view with row stride V + 5
    c = c._replace(logits=wide[:, 1 : K + 2, :V], x=c.x.int(), n=c.n.int())
    assert_same_chain(_kernel(c, method, rng, (16, 32)), _reference(c, method, rng), f"{method} strided")


def test_block_residuals_after_partial_acceptance_are_scaled_by_a():
    """Block verification stopping at tau = 1 with a_1 < 1 draws from max(a_1 p_1 - q_1, 0): the first draft is
    the most likely token with 0.5 < a_1 = p/q < 0.95, the second out of range (a_2 = 0), every eta is 0 (tau = 1
    wherever h_1 > 0); on dense rows and on top-k rows held in registers."""
    g = torch.Generator().manual_seed(11)
    B, K, V = 8, 2, 60
    logits = torch.randn(B, K + 1, V, generator=g) * 1.5
    params = SP(top_k=torch.tensor([0, 12] * (B // 2)))
    p = ss.logits_to_probs(logits, params)[:, :K]
    q = p * torch.exp(0.7 * torch.randn(B, K, V, generator=g)) + 0.05 / V
    q /= q.sum(-1, keepdim=True)
    ratio = p[:, 0] / q[:, 0]
    x = torch.stack([torch.where((ratio > 0.5) & (ratio < 0.95), p[:, 0], -1.0).argmax(-1), torch.full((B,), V)], 1)
    a_1 = ratio.gather(1, x[:, :1])
    assert ((a_1 > 0.5) & (a_1 < 0.95)).all()
    u_sample, eta = torch.rand(B, K + 1, generator=g), torch.zeros(B, K + 1)
    logits, p, q, x, u_sample, eta = (t.to(DEVICE) for t in (logits, p, q, x, u_sample, eta))
    given = ss.Uniforms(sample=u_sample, accept=eta)
    ref = ss.verify_chain_from_logits(logits, x, params, draft_probs=q, method="block", rng=given)
    assert (ref.num_accepted == 1).all(), ref.num_accepted
    unscaled = sample_by_inversion((p[:, 1] - q[:, 1]).clamp(min=0), u_sample[:, 1])
    assert (unscaled != ref.tokens[:, 1])[0::2].any() and (unscaled != ref.tokens[:, 1])[1::2].any()  # a_1 matters
    out = kchain.verify_chain_from_logits(logits, x, q, None, "block", *_row_params(params, B, K + 1),
                                          u_accept=eta, u_sample=u_sample, block_v=32, chunk=16, cand=64)
    assert_same_chain(out, ref, "block")


def test_target_only_draws_the_tokens_of_sample_from_logits():
    """Seed 002's sample-then-compare: each position's draw is sample_from_logits' token for that row (its
    kernel with the same descriptor configuration, and its reference), up to the first mismatch."""
    g = torch.Generator().manual_seed(7)
    B, K, V = 4, 3, 150
    c = _case(g, "target_only", B, K, V, "peaked")
    c = c._replace(params=SP(temperature=torch.tensor([1.0, 0.8, 1.1, 0.0]), top_k=torch.tensor([0, 5, 0, 0]),
                             top_p=torch.tensor([1.0, 0.9, 0.95, 1.0]), min_p=torch.tensor([0.05, 0.0, 0.0, 0.0])),
                   mask=None, n=None)
    c = to_device(c)
    rng = ss.Philox(torch.tensor([11, 12, 13, 14], device=DEVICE), torch.tensor([0, 5, 9, 2], device=DEVICE))
    rp = _row_params(c.params, B, K + 1)
    tokens, n = kchain.verify_chain_from_logits(c.logits, c.x, None, None, "target_only", *rp, seed=rng.seed,
                                                offset=rng.offset, chunk=8, cand=16)
    draws = ss.sample_from_logits(c.logits, c.params, rng).tokens
    seed, offset = rng.seed.repeat_interleave(K + 1), rng.offset.repeat_interleave(K + 1)
    kernel_draws, _ = ksampling.sample_from_logits(c.logits.view(-1, V), *rp, None, seed, offset,
                                                   torch.arange(K + 1, device=DEVICE).repeat(B), chunk=8, cand=16)
    assert torch.equal(kernel_draws.view(B, K + 1), draws)
    upto = torch.arange(K + 1, device=DEVICE) <= n[:, None]
    assert torch.equal(tokens[upto], draws[upto])
    assert set(n.tolist()) != {0}


def _stopping_case(g, method, B, K, V):
    """Inputs where every request stops at or before a position ``r[b] < num_drafts[b] - 1``: its draft there has
    target probability 0 (a -inf logit: no method accepts it, block's a drops to 0)."""
    c = _case(g, method, B, K, V, "peaked")
    n = torch.randint(2, K + 1, (B,), generator=g)
    r = (torch.rand(B, generator=g) * (n - 1)).long()  # drafts after r too
    batch = torch.arange(B)
    x = c.x.clamp(0, V - 1)
    x[batch, r] = (c.logits[batch, r].argmax(-1) + torch.randint(1, V, (B,), generator=g)) % V  # not the argmax
    logits = c.logits.clone()
    logits[batch, r, x[batch, r]] = float("-inf")
    q = c.q
    if q is not None:
        q = q.clone()
        q[batch, r, x[batch, r]] += 0.5
    mask = torch.rand(B, K + 1, V, generator=g) < 0.9
    mask[batch, r, (x[batch, r] + 1) % V] = True  # row r keeps an allowed token besides x
    return Case(logits, c.params, mask, x, q, n), r


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records loads in the Triton interpreter")
@pytest.mark.parametrize("method", METHODS)
def test_rows_after_the_stopping_position_are_never_loaded(method, monkeypatch):
    g = torch.Generator().manual_seed(400 + METHODS.index(method))
    B, K, V = 5, K_MAX, 100
    c, r = _stopping_case(g, method, B, K, V)
    rng = ss.Philox(torch.randint(0, 2**62, (B,), generator=g), torch.zeros(B, dtype=torch.int64))
    ref = _reference(c, method, rng)
    after = torch.arange(K + 1) > r[:, None]  # [B, K+1]: rows past each request's stop
    poisoned = c._replace(logits=c.logits.masked_fill(after[..., None], float("nan")),
                          q=None if c.q is None else c.q.masked_fill(after[:, :K, None], float("nan")))
    with recorded_loads(monkeypatch) as loaded:
        out = _kernel(poisoned, method, rng, (8, 16), block_v=32)
    assert_same_chain(out, ref, method)
    assert (out[1] <= r).all()
    assert row_reads(loaded, poisoned.logits)[~after].gt(0).any()  # the recording sees the rows read
    for name, t, rows in (("target_logits", poisoned.logits, after), ("vocab_mask", poisoned.mask, after),
                          ("draft_probs", poisoned.q, after[:, :K])):
        if t is not None:
            hit = row_reads(loaded, t)[rows]
            assert not hit.any(), f"{method}: loaded {int(hit.gt(0).sum())} {name} rows past the stopping position"


@pytest.mark.parametrize("method", METHODS)
def test_rows_described_in_parallel_give_the_same_chains_bit_for_bit(method, monkeypatch):
    """The small-batch mode (every row described by a first kernel, the chain kernel walking on the stored
    descriptors) against the chain kernel describing its rows itself: the same tokens, on every path of the
    row descriptor (kept tokens in registers or not, draws from chunk masses), shorter chains (rows past
    num_drafts are not described), masks, rows whose first pass is split over several programs; and the
    launcher's choice by size."""
    g = torch.Generator().manual_seed(450 + METHODS.index(method))
    for case in range(3):
        B, K, V = chain_shape(g, 5, K_MAX)
        c = to_device(_case(g, method, B, K, V, ("normal", "ties", "peaked")[case]))
        rng = ss.Philox(torch.randint(0, 2**62, (B,), generator=g).to(DEVICE), case)
        alone = _kernel(c, method, rng, CONFIGS[case], rows_in_parallel=False, tile=64)
        both = _kernel(c, method, rng, CONFIGS[case], rows_in_parallel=True, tile=64, parts=0)
        assert torch.equal(alone[0], both[0]) and torch.equal(alone[1], both[1]), f"{method} case {case}"
        # each row's first pass split over 3 programs (scan_parts; tiles of 64 tokens: up to 5 a row)
        split = _kernel(c, method, rng, CONFIGS[case], rows_in_parallel=True, tile=64, parts=3)
        assert torch.equal(alone[0], split[0]) and torch.equal(alone[1], split[1]), f"{method} case {case}, parts"
    if os.environ.get("TRITON_INTERPRET") == "1":  # loads are recorded in the interpreter
        c, r = _stopping_case(g, method, 5, K_MAX, 100)
        with recorded_loads(monkeypatch) as loaded:
            _kernel(c, method, ss.Philox(torch.arange(5)), (8, 16), rows_in_parallel=True)
        reads = row_reads(loaded, c.logits)
        described = torch.arange(K_MAX + 1) <= c.n[:, None]  # rows past num_drafts are not read at all
        assert reads[described].gt(0).all() and not reads[~described].gt(0).any()
    # on a GPU always (measured faster at every shape, issue 31's table); never in the interpreter
    h100 = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h100)
    assert kchain.rows_in_parallel_by_default(torch.device("cuda"))
    assert not kchain.rows_in_parallel_by_default(torch.device("cpu"))


@pytest.mark.parametrize("method", METHODS)
def test_rows_without_an_allowed_token(method):
    """Fully masked rows have no mass: the token drawn there is 0 (greedy: the argmax of all -inf, 0), so
    greedy accepts a draft 0 (the argmax equals it), token, block and target_only never (p(0) = 0: target_only
    accepted it, as its draw, before); under each kind of parameters."""
    g = torch.Generator().manual_seed(500 + METHODS.index(method))
    B, K, V = 4, 2, 90
    c = _case(g, method, B, K, V, "normal")
    mask = torch.rand(B, K + 1, V, generator=g) < 0.7
    mask[0] = False  # request 0: all its rows
    mask[1, 1] = False  # request 1: its second row
    x = c.x.clone()
    x[0], x[1, 1] = 0, 0  # the token a row without mass draws
    rng = ss.Philox(torch.arange(B, device=DEVICE), 0)
    kinds = dict(temperature=[1.0, 0.0, 0.7, 1.3], top_k=[0, 0, 0, 3], top_p=[0.8, 1.0, 1.0, 0.8], min_p=[0, 0, 0.2, 0])
    for shift in (0, 1):  # request 0 with top-p alone, then with top-k and top-p
        params = SP(**{name: torch.tensor(v).roll(shift) for name, v in kinds.items()})
        c = to_device(c._replace(mask=mask, params=params, x=x, n=None))
        out = _kernel(c, method, rng, (8, 16))
        assert_same_chain(out, _reference(c, method, rng), f"{method} {params}")
        assert out[0][0].tolist() == ([0, 0, 0] if method == "greedy" else [0, -1, -1])


def test_greedy_rows_of_a_sampled_batch_emit_the_argmax():
    """Temperature-0 requests verified by token/block/target_only: p is one-hot at the argmax of the masked
    logits (lowest id among ties), so a draft equal to it is always accepted and the bonus token is it."""
    B, K, V = 3, 3, 40
    logits = torch.randint(-2, 2, (B, K + 1, V), generator=torch.Generator().manual_seed(8)).float()
    best = logits.argmax(-1)
    params = SP(temperature=0.0, top_k=torch.tensor([0, 2, 0]), top_p=torch.tensor([1.0, 0.5, 1.0]))
    q = torch.full((B, K, V), 1.0 / V)
    for method in ("token", "block", "target_only"):
        c = to_device(Case(logits, params, None, best[:, :K], q if method in SAMPLED else None, None))
        tokens, n = _kernel(c, method, ss.Philox(torch.arange(B, device=DEVICE)))
        assert torch.equal(tokens, best.to(DEVICE)) and (n == K).all(), method


def test_launcher_checks_its_randomness_and_draft_probs():
    B, K, V = 2, 2, 10
    logits, x = torch.randn(B, K + 1, V), torch.zeros(B, K, dtype=torch.int64)
    rp = _row_params(SP(), B, K + 1)
    with pytest.raises(ValueError, match="needs draft_probs"):
        kchain.verify_chain_from_logits(logits, x, None, None, "token", *rp, seed=torch.zeros(B, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs seed, or u_sample"):
        kchain.verify_chain_from_logits(logits, x, None, None, "target_only", *rp)
    with pytest.raises(ValueError, match="method must be one of"):
        kchain.verify_chain_from_logits(logits, x, None, None, "auto", *rp)
    tokens, n = kchain.verify_chain_from_logits(logits[:0], x[:0], None, None, "greedy", *(t[:0] for t in rp))
    assert tokens.shape == (0, K + 1) and n.shape == (0,)


def test_draws_at_exact_boundaries_follow_the_strict_rules():
    """Dyadic probabilities (four tokens of logit 0, the others -inf: p = 1/4 exactly) and uniforms that land
    exactly on the boundaries: acceptance is strict (u * q < p), a block position with h = 0 is not taken at
    eta = 0, an inversion at a cumulative boundary takes the next token, and argmax ties go to the lowest id
    (across blocks); for rows held densely (passes over the row) and as kept tokens in registers (top-k)."""
    V, K = 70, 2
    logits = torch.full((V,), float("-inf"))
    logits[[1, 20, 40, 66]] = 0.0  # cumulative .25 .5 .75 1; ties for the argmax; in 4 chunks (top-k in registers)
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-24])
    B = len(u)
    q = torch.zeros(B, K, V)
    q[..., [1, 20]], q[..., 40] = 0.5, 0.25  # u * q == p(x) at u = 0.5 for x in {1, 20}; a_1 = 1 for x = 40
    q[:, 1, 66] = 0.25  # after x_0 = 20 (a_1 = 1/2): S_1 = 0, h_1 = 0 (block); draft 2 has p = 0
    # the same uniform at every index of both streams
    logits, q, grid = (t.to(DEVICE) for t in (logits.expand(B, K + 1, V).contiguous(), q,
                                              u[:, None].expand(B, K + 1).contiguous()))
    same = ss.Uniforms(sample=grid, accept=grid)
    dense, in_registers = SP(), SP(top_k=4)
    for x, params in (([1, 20], dense), ([1, 20], in_registers), ([40, 2], dense), ([20, 66], in_registers)):
        rp = _row_params(params, B, K + 1)
        drafts = torch.tensor(x, device=DEVICE).expand(B, K).contiguous()
        for method in METHODS:
            draft = q if method in SAMPLED else None
            ref = ss.verify_chain_from_logits(logits, drafts, params, draft_probs=draft, method=method, rng=same)
            out = kchain.verify_chain_from_logits(logits, drafts, draft, None, method, *rp, u_accept=grid,
                                                  u_sample=grid, block_v=32, chunk=8, cand=16)
            assert_same_chain(out, ref, f"{method} drafts {x} {params}")
    assert ss.verify_chain_from_logits(logits, drafts, method="greedy").tokens[:, 0].eq(1).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN and inf
def test_outputs_stay_in_range_on_degenerate_logits():
    """NaN, infinite and huge logits (no reference behaviour to match): tokens stay in [0, V) or -1, exactly one
    emitted token after the accepted drafts; each row under min-p, greedy, top-k + top-p and top-p alone."""
    B, K, V = 4, 2, 70
    rows = torch.tensor([[math.nan] * V, [math.inf] + [0.0] * (V - 1), [1e30, -1e30] + [0.0] * (V - 2),
                         [math.nan, 1.0] + [-math.inf] * (V - 2)])
    x = torch.tensor([[0, 1], [0, 0], [0, 2], [1, 1]])
    q = torch.full((B, K, V), 1.0 / V)
    params = SP(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0]), top_k=torch.tensor([0, 0, 3, 0]),
                top_p=torch.tensor([1.0, 1.0, 0.5, 0.5]), min_p=torch.tensor([0.5, 0.0, 0.0, 0.0]))
    rng = ss.Philox(torch.arange(B))
    for shift in (0, 2):
        logits = rows.roll(shift, 0)[:, None].expand(B, K + 1, V).contiguous()
        for method in METHODS:
            c = to_device(Case(logits, params, None, x, q if method in SAMPLED else None, None))
            tokens, n = _kernel(c, method, rng, (8, 16))
            emitted = tokens.gather(1, n[:, None])[:, 0]
            assert ((tokens >= -1) & (tokens < V)).all() and ((emitted >= 0) & (n <= K)).all(), (method, shift)
