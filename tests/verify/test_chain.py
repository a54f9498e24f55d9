import pytest
import torch
from stats import assert_counts_match, assert_exact, assert_mean_within

import specsampler as ss
from conftest import mc_trials
from specsampler import SamplingParams as SP
from specsampler.verify import oracle
from specsampler.verify.exactness import Table, chain_inputs, chain_monte_carlo, encode, encode_dist, random_model

SAMPLED = ("token", "block")
CASES = [(4, 3, True, 11), (6, 2, False, 12), (3, 4, True, 13), (5, 1, True, 14)]  # V, K, zeros, seed


@pytest.mark.montecarlo
@pytest.mark.parametrize("V, K, zeros, seed", CASES)
@pytest.mark.parametrize("method", ["token", "block", "target_only"])
def test_verify_chain_matches_the_oracle_and_the_target(method, V, K, zeros, seed):
    mc = chain_monte_carlo(method, V, K, mc_trials(200_000, 50_000), seed, zeros)
    assert_exact(mc, f"{method} V={V} K={K}")


@pytest.mark.montecarlo
def test_ragged_chains_and_a_torch_generator_are_exact():
    V, K, seed = 4, 3, 21
    N = mc_trials(200_000, 50_000)
    p_fn, q_fn = random_model(V, seed, True), random_model(V, seed + 1)
    p, x, q = chain_inputs(Table(p_fn, V, K + 1), Table(q_fn, V, K), K, N, True, torch.Generator().manual_seed(2))
    n = torch.randint(0, K + 1, (N,), generator=torch.Generator().manual_seed(3))
    res = ss.verify_chain(p, x, q, num_drafts=n, method="block", rng=torch.Generator().manual_seed(4))
    for k in range(K + 1):
        rows = n == k
        exact = oracle.chain(p_fn, q_fn, k, "block", V)
        expected = encode_dist(exact.sequences, K + 1, V)
        codes = encode(res.tokens[rows], V)
        keys = sorted(set(expected) | set(codes.unique().tolist()))
        counts = torch.bincount(torch.searchsorted(torch.tensor(keys), codes), minlength=len(keys))
        assert_counts_match(counts.numpy(), [expected.get(key, 0.0) for key in keys], label=f"num_drafts={k}")
        assert_mean_within(res.num_accepted[rows].numpy(), exact.expected_accepted, label=f"num_drafts={k}")


# ----------------------------------------------------------------------------- exact behaviour


def test_greedy_equals_an_argmax_walk():
    torch.manual_seed(0)
    B, K, V = 64, 5, 7
    logits = torch.randn(B, K + 1, V)
    target = logits.argmax(-1)
    drafts = torch.where(torch.rand(B, K) < 0.8, target[:, :K], torch.randint(0, V, (B, K)))
    res = ss.verify_chain(torch.softmax(logits, -1), drafts, method="greedy")
    res_logits = ss.verify_chain_from_logits(logits, drafts, method="greedy")
    for b in range(B):
        n = 0
        while n < K and drafts[b, n] == target[b, n]:
            n += 1
        expected = drafts[b, :n].tolist() + [int(target[b, n])] + [-1] * (K - n)
        assert res.tokens[b].tolist() == expected and res_logits.tokens[b].tolist() == expected
        assert res.num_accepted[b] == n and res.expected_accepted[b] == n


@pytest.mark.parametrize("method", SAMPLED)
def test_draft_equal_to_target_accepts_every_draft(method):
    torch.manual_seed(1)
    B, K, V = 500, 4, 9
    p = torch.softmax(torch.randn(B, K + 1, V), -1)
    x = torch.multinomial(p[:, :K].reshape(-1, V), 1).view(B, K)
    res = ss.verify_chain(p, x, p[:, :K], method=method, rng=ss.Philox(torch.arange(B)))
    assert (res.num_accepted == K).all() and torch.equal(res.tokens[:, :K], x)
    torch.testing.assert_close(res.expected_accepted, torch.full((B,), float(K)))


def test_block_accepts_at_least_as_much_as_token_in_expectation():
    for seed in range(6):
        V, K = 4, 3
        p_fn, q_fn = random_model(V, 100 + seed, seed % 2 == 0), random_model(V, 200 + seed)
        token = oracle.chain(p_fn, q_fn, K, "token", V).expected_accepted
        block = oracle.chain(p_fn, q_fn, K, "block", V).expected_accepted
        assert block >= token - 1e-12


def test_ragged_rows_equal_the_same_rows_verified_alone():
    torch.manual_seed(2)
    B, K, V = 16, 4, 6
    p = torch.softmax(torch.randn(B, K + 1, V), -1)
    q = torch.softmax(torch.randn(B, K, V), -1)
    x = torch.multinomial(q.reshape(-1, V), 1).view(B, K)
    n = torch.randint(0, K + 1, (B,))
    seed = torch.arange(B) * 7
    for method in ("token", "block", "target_only", "greedy"):
        qq = q if method in SAMPLED else None
        res = ss.verify_chain(p, x, qq, num_drafts=n, method=method, rng=ss.Philox(seed))
        for b in range(B):
            k = int(n[b])
            alone = ss.verify_chain(p[b : b + 1, : k + 1], x[b : b + 1, :k], None if qq is None else q[b : b + 1, :k],
                                    method=method, rng=ss.Philox(int(seed[b])))
            assert res.tokens[b, : k + 1].tolist() == alone.tokens[0].tolist()
            assert (res.tokens[b, k + 1 :] == -1).all()
            torch.testing.assert_close(res.expected_accepted[b : b + 1], alone.expected_accepted)


def test_a_request_verifies_the_same_whatever_its_neighbours():
    torch.manual_seed(3)
    B, K, V = 24, 3, 50
    logits = torch.randn(B, K + 1, V) * 2
    q = torch.softmax(torch.randn(B, K, V), -1)
    x = torch.multinomial(q.reshape(-1, V), 1).view(B, K)
    params = SP(temperature=torch.rand(B) + 0.5, top_k=torch.randint(0, 20, (B,)), top_p=torch.rand(B) * 0.5 + 0.5)
    seed, off = torch.randint(0, 2**40, (B,)), torch.randint(0, 9, (B,))
    for method, qq in (("token", q), ("block", q), ("target_only", None)):
        full = ss.verify_chain_from_logits(logits, x, params, draft_probs=qq, method=method, rng=ss.Philox(seed, off))
        perm = torch.randperm(B)
        sub = SP(params.temperature[perm], params.top_k[perm], params.top_p[perm])
        moved = ss.verify_chain_from_logits(logits[perm], x[perm], sub, draft_probs=None if qq is None else qq[perm],
                                            method=method, rng=ss.Philox(seed[perm], off[perm]))
        assert torch.equal(moved.tokens, full.tokens[perm]), method


def test_target_only_from_logits_draws_what_sample_from_logits_draws():
    torch.manual_seed(4)
    B, K, V = 32, 4, 300
    logits = torch.randn(B, K + 1, V) * 3
    mask = torch.rand(B, K + 1, V) > 0.2
    params = SP(temperature=torch.where(torch.rand(B) < 0.3, 0.0, 0.8), top_k=torch.randint(0, 40, (B,)),
                top_p=torch.rand(B) * 0.4 + 0.6, min_p=0.02)
    rng = ss.Philox(torch.arange(B), 5)
    draws = ss.sample_from_logits(logits, params, rng, vocab_mask=mask).tokens
    # drafts: mostly the draws themselves, with a mismatch planted at a random position
    cut = torch.randint(0, K + 1, (B,))
    drafts = torch.where(torch.arange(K) < cut[:, None], draws[:, :K], (draws[:, :K] + 1) % V)
    res = ss.verify_chain_from_logits(logits, drafts, params, rng=rng, vocab_mask=mask)
    assert torch.equal(res.num_accepted, cut)
    assert torch.equal(res.tokens.gather(1, cut[:, None])[:, 0], draws.gather(1, cut[:, None])[:, 0])
    # and the emitted tokens respect the mask and the greedy rows
    emitted = res.tokens.gather(1, cut[:, None])[:, 0]
    assert mask[torch.arange(B), cut, emitted].all()


def test_from_logits_equals_verify_chain_on_the_processed_probabilities():
    torch.manual_seed(5)
    B, K, V = 40, 3, 80
    logits = torch.randn(B, K + 1, V) * 2
    mask = torch.rand(B, K + 1, V) > 0.1
    params = SP(temperature=torch.rand(B) + 0.3, top_k=torch.randint(0, 30, (B,)), top_p=torch.rand(B) * 0.3 + 0.7,
                min_p=torch.rand(B) * 0.05)
    probs = ss.logits_to_probs(logits, params, mask)
    q = torch.softmax(torch.randn(B, K, V), -1)
    x = torch.multinomial(q.reshape(-1, V), 1).view(B, K)
    for method in ("token", "block", "target_only"):
        qq = q if method in SAMPLED else None
        rng = ss.Philox(torch.arange(B), 1)
        a = ss.verify_chain_from_logits(logits, x, params, draft_probs=qq, method=method, rng=rng, vocab_mask=mask)
        b = ss.verify_chain(probs, x, qq, method=method, rng=rng)
        assert (a.tokens == b.tokens).all(1).float().mean() > 0.97, method  # equal but for float rounding
        assert torch.equal(a.num_accepted, b.num_accepted), method
        torch.testing.assert_close(a.expected_accepted, b.expected_accepted)


def test_mixed_greedy_and_sampled_requests_in_one_batch():
    torch.manual_seed(6)
    B, K, V = 8, 3, 20
    logits = torch.randn(B, K + 1, V)
    greedy = torch.arange(B) % 2 == 0
    params = SP(temperature=torch.where(greedy, 0.0, 1.0), top_k=5)
    drafts = logits[:, :K].argmax(-1)
    res = ss.verify_chain_from_logits(logits, drafts, params, rng=ss.Philox(torch.arange(B)))
    assert (res.num_accepted[greedy] == K).all()  # greedy rows accept their argmax drafts
    assert torch.equal(res.tokens[greedy, K], logits[greedy, K].argmax(-1))


def test_a_float64_temperature_below_float32_is_sampled_as_the_same_scalar_is():
    """A positive temperature float32 rounds to 0 (1e-46) acts as 2**-126 given as a scalar: a draw among the tied
    largest logits. Given as a float64 tensor it became 0, greedy: always the lowest of them."""
    B, K = 64, 1
    logits = torch.tensor([1.0, 1.0, 0.0]).expand(B, K + 1, 3)
    drafts = torch.zeros(B, K, dtype=torch.long)
    rng = ss.Philox(torch.arange(B))
    scalar = ss.verify_chain_from_logits(logits, drafts, SP(temperature=1e-46), rng=rng)
    tensor = ss.verify_chain_from_logits(logits, drafts, SP(temperature=torch.full((B,), 1e-46, dtype=torch.float64)),
                                         rng=rng)
    assert set(scalar.tokens[:, 0].tolist()) == {0, 1}  # tied largest logits: either, never the smaller
    assert torch.equal(tensor.tokens, scalar.tokens)
    sampled = ss.sample_from_logits(logits[:, 0], SP(temperature=torch.full((B,), 1e-46, dtype=torch.float64)), rng)
    assert torch.equal(sampled.tokens, ss.sample_from_logits(logits[:, 0], SP(temperature=1e-46), rng).tokens)


def test_draft_ids_outside_the_vocabulary_are_never_accepted():
    B, K, V = 4, 3, 5
    p = torch.full((B, K + 1, V), 1 / V)
    x = torch.tensor([[0, 7, 1], [-1, 0, 0], [2, 2, 5], [1, 1, 1]])
    for method, q in (("token", p[:, :K]), ("block", p[:, :K]), ("target_only", None), ("greedy", None)):
        res = ss.verify_chain(p, x, q, method=method, rng=ss.Philox(0))
        assert (res.num_accepted[:3] <= torch.tensor([1, 0, 2])).all(), method
        assert ((res.tokens >= -1) & (res.tokens < V)).all()


def test_zero_probability_drafts_are_never_accepted():
    B, K, V = 2000, 1, 3
    p = torch.tensor([0.0, 0.5, 0.5]).expand(B, K + 1, V)
    q = torch.tensor([0.5, 0.25, 0.25]).expand(B, K, V)
    x = torch.zeros(B, K, dtype=torch.long)
    for method in SAMPLED:
        res = ss.verify_chain(p, x, q, method=method, rng=ss.Philox(torch.arange(B)))
        assert (res.num_accepted == 0).all() and (res.tokens[:, 0] != 0).all()


def test_outputs_stay_in_range_on_nan_and_degenerate_rows():
    B, K, V = 6, 3, 5
    p = torch.softmax(torch.randn(B, K + 1, V), -1)
    p[0] = float("nan")
    p[1] = 0.0
    p[2, 1] = float("inf")
    p[3] = -1.0
    q = torch.softmax(torch.randn(B, K, V), -1)
    q[4] = float("nan")
    q[5] = 0.0
    x = torch.randint(0, V, (B, K))
    for method in ("token", "block", "target_only", "greedy"):
        res = ss.verify_chain(p, x, q if method in SAMPLED else None, method=method, rng=ss.Philox(1))
        assert ((res.tokens >= -1) & (res.tokens < V)).all(), method
        n = res.num_accepted
        assert ((n >= 0) & (n <= K)).all() and (res.tokens.gather(1, n[:, None]) >= 0).all()
    logits = torch.randn(B, K + 1, V)
    logits[0] = float("nan")
    logits[1] = -float("inf")
    for method in ("token", "block", "target_only", "greedy"):
        res = ss.verify_chain_from_logits(logits, x, SP(top_p=0.9), draft_probs=q if method in SAMPLED else None,
                                          method=method, rng=ss.Philox(1))
        assert ((res.tokens >= -1) & (res.tokens < V)).all(), method


def test_no_drafts_emits_one_token():
    p = torch.softmax(torch.randn(3, 1, 7), -1)
    for method, q in (("token", torch.zeros(3, 0, 7)), ("block", torch.zeros(3, 0, 7)), ("target_only", None)):
        res = ss.verify_chain(p, torch.zeros(3, 0, dtype=torch.long), q, method=method, rng=ss.Philox(0))
        assert res.tokens.shape == (3, 1) and (res.num_accepted == 0).all() and (res.tokens >= 0).all()


def test_inputs_are_not_modified_and_result_shapes():
    B, K, V = 3, 2, 6
    p = torch.softmax(torch.randn(B, K + 1, V), -1)
    q = torch.softmax(torch.randn(B, K, V), -1)
    x = torch.randint(0, V, (B, K), dtype=torch.int32)
    copies = (p.clone(), q.clone(), x.clone())
    for method in ("token", "block"):
        res = ss.verify_chain(p, x, q, method=method)
        assert res.tokens.shape == (B, K + 1) and res.tokens.dtype == torch.int64
        assert res.num_accepted.dtype == torch.int64 and res.expected_accepted.dtype == torch.float32
        assert torch.equal(res.num_emitted, res.num_accepted + 1)
    logits = torch.randn(B, K + 1, V)
    lc = logits.clone()
    ss.verify_chain_from_logits(logits, x, SP(top_k=3), draft_probs=q, method="block")
    assert all(torch.equal(a, b) for a, b in zip(copies, (p, q, x))) and torch.equal(logits, lc)


def test_auto_picks_token_with_draft_probs_and_target_only_without():
    torch.manual_seed(7)
    B, K, V = 10, 3, 8
    p = torch.softmax(torch.randn(B, K + 1, V), -1)
    q = torch.softmax(torch.randn(B, K, V), -1)
    x = torch.randint(0, V, (B, K))
    rng = ss.Philox(torch.arange(B))
    auto, token = ss.verify_chain(p, x, q, rng=rng), ss.verify_chain(p, x, q, method="token", rng=rng)
    assert torch.equal(auto.tokens, token.tokens)
    auto, target_only = ss.verify_chain(p, x, rng=rng), ss.verify_chain(p, x, method="target_only", rng=rng)
    assert torch.equal(auto.tokens, target_only.tokens)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(method="token", draft_probs=None), ["draft_probs", "a tensor [B, K, V] for method 'token'", "None"]),
        (dict(method="target_only"), ["draft_probs", "None for method 'target_only'"]),
        (dict(method="spec"), ["method", "'spec'", "token"]),
        (dict(num_drafts=torch.tensor([1, 5])), ["num_drafts", "[0, K] = [0, 3]", "got 5", "request 1"]),
        (dict(num_drafts=torch.tensor([1])), ["num_drafts", "[B] = [2]", "[1]"]),
        (dict(x=torch.zeros(2, 4, dtype=torch.long)), ["draft_tokens", "[B, K]", "[2, 3]", "[2, 4]"]),
        (dict(x=torch.zeros(2, 3)), ["draft_tokens", "integer", "float32"]),
        (dict(q=torch.rand(2, 3, 4)), ["draft_probs", "[B, K, V] = [2, 3, 5]", "[2, 3, 4]"]),
        (dict(p=torch.rand(2, 5)), ["target_probs", "3 dimensions", "[2, 5]"]),
        (dict(rng=5), ["rng", "Philox"]),
    ],
)
def test_bad_chain_inputs_are_named(kwargs, fragments):
    p = kwargs.pop("p", torch.full((2, 4, 5), 0.2))
    x = kwargs.pop("x", torch.zeros(2, 3, dtype=torch.long))
    q = kwargs.pop("q", torch.full((2, 3, 5), 0.2))
    if "draft_probs" in kwargs:
        q = kwargs.pop("draft_probs")
    with pytest.raises(ValueError) as err:
        ss.verify_chain(p, x, q, **kwargs)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


@pytest.mark.parametrize("B", [2, 9])  # (request 0 is rejected: B = 1 would hold no request that accepts)
def test_a_request_that_accepts_every_draft_draws_its_bonus_whatever_its_padding_rows_hold(B):
    # draft_probs rows past num_drafts are padding (torch.empty in an engine): a request that accepted its drafts
    # draws its bonus from p; NaN there made it p - NaN * 0, a row without mass, and token 0 of probability 0
    V, K = 5, 3
    p = torch.zeros(B, K + 1, V)
    p[..., 3] = 1.0  # the target is sure of token 3 everywhere
    q = torch.full((B, K, V), 1 / V)
    x = torch.full((B, K), 3)
    x[0, 0] = 1  # request 0 is rejected at once (its residual is read), the others accept their drafts
    num = torch.tensor([K] + [1 + b % K for b in range(1, B)])
    results = {}
    for pad in (0.2, float("nan"), float("inf"), -7.0):
        padded = q.clone()
        for b in range(B):
            padded[b, num[b]:] = pad
        for method in ("token", "block"):
            for op, target in ((ss.verify_chain, p), (ss.verify_chain_from_logits, p.log())):
                res = op(target, x, draft_probs=padded, num_drafts=num, method=method, rng=ss.Philox(torch.arange(B)))
                results.setdefault((method, op.__name__), []).append(res.tokens.tolist())
    for key, runs in results.items():
        assert all(r == runs[0] for r in runs), key
        assert runs[0][0][:2] == [3, -1] and all(row[: num[b] + 1] == [3] * (int(num[b]) + 1)
                                                 for b, row in enumerate(runs[0][1:], 1)), key


def test_expected_accepted_stays_in_zero_to_k_whatever_the_values():
    # rows that are not distributions (unnormalised, negative, inf, NaN) took it to 7.65, 14.8, -0.76 or inf at K = 3
    K, V = 3, 2
    x = torch.zeros(4, K, dtype=torch.long)
    q = torch.tensor([0.9, 0.1]).expand(4, K, V)
    p = torch.tensor([[1.0, 1.0], [5.0, 0.0], [-3.0, 1.0], [float("inf"), 0.0]])[:, None].expand(4, K + 1, V)
    for method in ("token", "block", "target_only"):
        for target in (p, torch.where(torch.arange(4)[:, None, None] == 3, float("nan"), p)):
            res = ss.verify_chain(target, x, q if method != "target_only" else None, method=method, rng=ss.Philox(1))
            e = res.expected_accepted
            assert bool(((e >= 0) & (e <= K)).all()), (method, e)


def test_full_validation_of_chain_values():
    p = torch.full((2, 3, 4), 0.25)
    q = torch.full((2, 2, 4), 0.25)
    x = torch.tensor([[0, 1], [2, 9]])
    ss.verify_chain(p, x, q)  # structure only: an out-of-range draft is simply rejected
    with pytest.raises(ValueError, match=r"draft_tokens: expected token ids in \[0, 4\), got 9 .*request 1"):
        ss.verify_chain(p, x, q, validate="full")
    ss.verify_chain(p, x, q, num_drafts=torch.tensor([2, 1]), validate="full")  # beyond num_drafts: ignored
    # so are the draft rows past a request's drafts and the target rows past its bonus row (padding: they raised)
    pad_p, pad_q = p.clone(), q.clone()
    pad_q[1, 1], pad_p[1, 2] = float("nan"), float("nan")
    ss.verify_chain(pad_p, x, pad_q, num_drafts=torch.tensor([2, 1]), validate="full")
    ss.verify_chain_from_logits(pad_p.log(), x, draft_probs=pad_q, num_drafts=torch.tensor([2, 1]), validate="full")
    for row in (0, 1):  # request 1's rows up to its bonus row are read
        bad = p.clone()
        bad[1, row] = float("nan")
        with pytest.raises(ValueError, match=r"target_probs: expected finite probabilities.*request 1"):
            ss.verify_chain(bad, x, q, num_drafts=torch.tensor([2, 1]), validate="full")
    bad = q.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"draft_probs: expected finite probabilities.*request 1"):
        ss.verify_chain(p, x, bad, num_drafts=torch.tensor([2, 1]), validate="full")
    q2 = q.clone()
    q2[1, 0, 0] = -0.5
    with pytest.raises(ValueError, match=r"draft_probs: expected probabilities >= 0.*request 1"):
        ss.verify_chain(p, x.clamp(max=3), q2, validate="full")
    logits = torch.zeros(2, 3, 4)
    logits[0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"target_logits: expected logits without NaN.*request 0"):
        ss.verify_chain_from_logits(logits, x.clamp(max=3), validate="full")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_chains_draw_no_randomness_as_greedy_trees(monkeypatch, backend):
    """A greedy chain drew K+1 uniforms it never read: it advanced a caller's (or torch's global) generator, and
    ``Uniforms()`` without a sample stream was refused; a greedy tree draws none. A Philox of another batch is
    still named."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("SPECSAMPLER_BACKEND", backend)
    B, K, V = 2, 3, 6
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, K + 1, V, generator=g)
    x = logits[:, :K].argmax(-1)
    want = ss.verify_chain_from_logits(logits, x, method="greedy", rng=ss.Philox(torch.arange(B))).tokens
    calls = (lambda rng: ss.verify_chain(logits.softmax(-1), x, method="greedy", rng=rng),
             lambda rng: ss.verify_chain_from_logits(logits, x, method="greedy", rng=rng))
    for call in calls:
        gen, global_state = torch.Generator().manual_seed(9), torch.get_rng_state()
        state = gen.get_state()
        for rng in (gen, None, ss.Uniforms()):
            assert torch.equal(call(rng).tokens, want)
        assert torch.equal(gen.get_state(), state) and torch.equal(torch.get_rng_state(), global_state)
        with pytest.raises(ValueError, match="Philox"):
            call(ss.Philox(torch.arange(B + 1)))
