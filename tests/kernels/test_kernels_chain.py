"""The chain-verification kernel (run in the Triton interpreter without a GPU) against specsampler.verify_chain.

Both run on the same random streams (in-kernel Philox, or the uniforms a torch.Generator gives
the reference, in its order), so tokens and num_accepted must be identical. The kernel's
cumulative sums are taken in another order than torch's; over these cases no draw falls on a
float rounding tie, so no mismatch is allowed.
"""

import os

import pytest
import torch
from kernelcheck import DEVICE, assert_same_chain, chain_shape, recorded_loads, row_reads, to_device

import specsampler as ss
from specsampler.kernels import chain as kchain

METHODS = ("token", "block", "target_only", "greedy")
SAMPLED = ("token", "block")
K_MAX = 5


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    """The reference (specsampler.verify_chain) runs its PyTorch code whatever SPECSAMPLER_BACKEND says."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")


def _dist(g, shape, V, spread, zeros):
    """Random distributions ``[*shape, V]``: softmax of logits times ``spread`` (broadcast; peaked when large),
    a fraction ``zeros`` of the entries set to 0 (a row keeps at least one entry)."""
    logits = torch.randn(*shape, V, generator=g) * spread
    keep = torch.rand(*shape, V, generator=g) >= zeros
    keep |= torch.arange(V) == logits.argmax(-1, keepdim=True)
    p = torch.softmax(logits, -1) * keep
    return p / p.sum(-1, keepdim=True)


def _case(g, method, B, K, V):
    """Inputs for ``method`` with long accepted runs, zero-probability and out-of-range drafts, and
    (for token/block) requests whose draft equals the target (residuals without mass)."""
    spread = torch.empty(B, 1, 1).uniform_(0.2, 6.0 if method in SAMPLED else 20.0, generator=g)  # per request
    p = _dist(g, (B, K + 1), V, spread, 0.3 * float(torch.rand(1, generator=g)))
    q = None
    if method in SAMPLED:
        mix = torch.rand(B, 1, 1, generator=g) ** 3  # mostly a draft close to the target
        q = (1 - mix) * p[:, :K] + mix * _dist(g, (B, K), V, spread, 0.3)
        same = torch.rand(B, 1, 1, generator=g) < 0.2
        q = torch.where(same, p[:, :K], q)
        x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K) if K else torch.zeros(B, 0).long()
    else:  # a deterministic drafter that agrees with the target's most likely token
        x = p[:, :K].argmax(-1)
    noise = torch.rand(B, K, generator=g)
    x = torch.where(noise < 0.04, torch.randint(0, V, (B, K), generator=g), x)  # any token, often p(x) = 0
    bad = torch.tensor([-1, V, V + 7, 2**40])[torch.randint(0, 4, (B, K), generator=g)]
    x = torch.where(noise > 0.97, bad, x)  # out of range: never accepted
    num_drafts = torch.randint(0, K + 1, (B,), generator=g)
    return p, x, q, num_drafts


@pytest.mark.parametrize("method", METHODS)
def test_kernel_equals_the_reference_on_philox_streams(method):
    g = torch.Generator().manual_seed(100 + METHODS.index(method))
    lengths = set()
    for case in range(16):
        B, K, V = chain_shape(g, 6, K_MAX) if case else (6, K_MAX, 257)
        seed = torch.randint(-(2**62), 2**62, (B,), generator=g)
        offset = torch.randint(0, 2**40, (B,), generator=g)
        p, x, q, n, seed, offset = to_device((*_case(g, method, B, K, V), seed, offset))
        if case == 0:  # full chains: long accepted runs are likely
            n = torch.full_like(n, K)
        ref = ss.verify_chain(p, x, q, num_drafts=n, method=method, rng=ss.Philox(seed, offset))
        out = kchain.verify_chain(p, x, q, n, method, seed, offset, block_v=(64, 128, 256)[case % 3])
        assert_same_chain(out, ref, f"{method} case {case} B={B} K={K} V={V}")
        lengths |= set(ref.num_accepted.tolist())
    assert lengths == set(range(K_MAX + 1)), f"acceptance lengths seen: {sorted(lengths)}"


@pytest.mark.parametrize("method", METHODS)
def test_kernel_equals_the_reference_on_a_torch_generator(method):
    g = torch.Generator().manual_seed(200 + METHODS.index(method))
    for case in range(6):
        B, K, V = chain_shape(g, 6, K_MAX)
        p, x, q, n = to_device(_case(g, method, B, K, V))
        ref = ss.verify_chain(p, x, q, num_drafts=n, method=method, rng=torch.Generator().manual_seed(case))
        rng = torch.Generator().manual_seed(case)  # the reference's draws, in its order
        u_sample = torch.rand(B, K + 1, generator=rng)
        u_accept = torch.rand(B, K + 1, generator=rng) if method in SAMPLED else None
        u_sample, u_accept = to_device((u_sample, u_accept))
        out = kchain.verify_chain(p, x, q, n, method, u_accept=u_accept, u_sample=u_sample, block_v=64)
        assert_same_chain(out, ref, f"{method} case {case} B={B} K={K} V={V}")


@pytest.mark.parametrize("method", METHODS)
def test_empty_chains_full_chains_and_strided_half_precision_inputs(method):
    g = torch.Generator().manual_seed(300 + METHODS.index(method))
    B, K, V = 5, 3, 131
    seed, offset = to_device((torch.arange(B) * 7919, torch.full((B,), 3)))
    for k in (0, K):  # K = 0: only the bonus row; num_drafts None: all K drafts
        p, x, q, _ = to_device(_case(g, method, B, k, V))
        ref = ss.verify_chain(p, x, q, method=method, rng=ss.Philox(seed, offset))
        assert_same_chain(kchain.verify_chain(p, x, q, None, method, seed, offset, block_v=32), ref, f"{method} K={k}")
    p, x, q, n = to_device(_case(g, method, B, K, V))
    wide = torch.zeros(B, K + 3, V, dtype=torch.float16, device=DEVICE)
    wide[:, 1 : K + 2] = p.half()  # a [B, K+1, V] view with a batch stride of (K+3) * V
    target = wide[:, 1 : K + 2]
    q = None if q is None else q.bfloat16()
    ref = ss.verify_chain(target, x.int(), q, num_drafts=n.int(), method=method, rng=ss.Philox(seed, offset))
    assert_same_chain(kchain.verify_chain(target, x.int(), q, n.int(), method, seed, offset, block_v=64), ref, method)


def _stopping_case(g, method, B, K, V):
    """Inputs where every request stops at or before a position ``r[b] < num_drafts[b]``: its
    draft there has target probability 0 (no method accepts it, block's a drops to 0)."""
    p, x, q, _ = _case(g, method, B, K, V)
    n = torch.randint(1, K + 1, (B,), generator=g)
    r = (torch.rand(B, generator=g) * n).long()
    batch = torch.arange(B)
    x[batch, r] = (p[batch, r].argmax(-1) + torch.randint(1, V, (B,), generator=g)) % V  # not the argmax
    p[batch, r, x[batch, r]] = 0.0
    if q is not None:
        q[batch, r, x[batch, r]] += 0.5
    return p, x, q, n, r


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records loads in the Triton interpreter")
@pytest.mark.parametrize("method", METHODS)
def test_rows_after_the_stopping_position_are_never_loaded(method, monkeypatch):
    g = torch.Generator().manual_seed(400 + METHODS.index(method))
    B, K, V = 6, K_MAX, 100
    p, x, q, n, r = _stopping_case(g, method, B, K, V)
    seed, offset = torch.randint(0, 2**62, (B,), generator=g), torch.zeros(B, dtype=torch.int64)
    ref = ss.verify_chain(p, x, q, num_drafts=n, method=method, rng=ss.Philox(seed, offset))
    after = torch.arange(K + 1) > r[:, None]  # [B, K+1]: rows past each request's stop
    p_poisoned = p.masked_fill(after[..., None], float("nan"))
    q_poisoned = None if q is None else q.masked_fill(after[:, :K, None], float("nan"))
    with recorded_loads(monkeypatch) as loaded:
        out = kchain.verify_chain(p_poisoned, x, q_poisoned, n, method, seed, offset, block_v=32)
    assert_same_chain(out, ref, method)
    assert (out[1] <= r).all()
    assert row_reads(loaded, p_poisoned)[~after].gt(0).any()  # the recording sees the rows read
    for name, t, rows in (("target_probs", p_poisoned, after), ("draft_probs", q_poisoned, after[:, :K])):
        if t is not None:
            hit = row_reads(loaded, t)[rows]
            assert not hit.any(), f"{method}: loaded {int(hit.gt(0).sum())} {name} rows past the stopping position"


def test_draws_at_exact_boundaries_follow_the_strict_rules():
    """Dyadic probabilities and uniforms (no rounding) that land exactly on the boundaries: acceptance
    is strict (u * q < p), a block position with h = 0 is not taken at eta = 0, an inversion at a
    cumulative boundary takes the next token, and argmax ties go to the lowest id (across blocks)."""
    V, K = 70, 2
    w = torch.zeros(V)
    w[[1, 3, 40, 66]] = torch.tensor([0.25, 0.25, 0.25, 0.25])  # cumulative .25 .5 .75 1; ties for the argmax
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-24])
    B = len(u)
    q = torch.zeros(B, K, V)
    q[..., [1, 3]], q[..., 40] = 0.5, 0.25  # u * q == p(x) at u = 0.5 for x in {1, 3}; a_1 = 1 for x = 40
    q[:, 1, 66] = 0.25  # then S_1 = 0: h_1 = 0 (block)
    # the same uniform at every index of both streams
    p, q, grid = to_device((w.expand(B, K + 1, V).contiguous(), q, u[:, None].expand(B, K + 1).contiguous()))
    same = ss.Uniforms(sample=grid, accept=grid)
    for x in ([1, 3], [40, 1], [40, 2], [3, 66]):
        drafts = torch.tensor(x, device=DEVICE).expand(B, K).contiguous()
        for method in METHODS:
            draft = q if method in SAMPLED else None
            ref = ss.verify_chain(p, drafts, draft, method=method, rng=same)
            out = kchain.verify_chain(p, drafts, draft, None, method, u_accept=grid, u_sample=grid, block_v=32)
            assert_same_chain(out, ref, f"{method} drafts {x}")
    assert ss.verify_chain(p, drafts, method="greedy").tokens[:, 0].eq(1).all()
