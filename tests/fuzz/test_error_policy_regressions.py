"""Regression tests for what the fuzz suite found, each named after the behaviour it restores, on both
back ends where the op has a kernel (the kernels in the Triton interpreter on CPU tensors)."""

from __future__ import annotations

import pytest
import torch
from fuzzkit import BACKENDS, bounds_checked, use_backend

import specsampler as ss

B = 64  # requests: with these seeds every case below hits its bad branch in many of them


@pytest.fixture(params=BACKENDS)
def backend(request):
    with use_backend(request.param), bounds_checked(request.param == "triton"):
        yield request.param


@pytest.mark.parametrize("make", [
    lambda: ss.SamplingParams(temperature=torch.tensor(-1.0)),
    lambda: ss.SamplingParams(top_p=torch.tensor(0.0)),
    lambda: ss.SamplingParams(min_p=torch.tensor(float("nan"))),
])
def test_a_scalar_tensor_parameter_with_a_bad_value_is_rejected(make):
    # 0-d tensors skipped the value check (first_request found no request in them) and sampled with temperature -1
    with pytest.raises(ss.ValidationError, match=r"sample_from_logits: SamplingParams\.\w+: expected .*, got"):
        ss.sample_from_logits(torch.randn(2, 5), make())


def test_a_scalar_tensor_filter_with_a_bad_value_is_rejected():
    with pytest.raises(ss.ValidationError, match="top_p_renorm: top_p: expected a value in"):
        ss.top_p_renorm(torch.rand(2, 5), torch.tensor(float("nan")))


@pytest.mark.parametrize("from_logits", [False, True])
def test_token_verification_of_an_empty_batch_returns_empty_results(backend, from_logits):
    # B = 0 crashed reshaping the draft rows with -1
    target, drafts, q = torch.rand(0, 3, 5), torch.zeros(0, 2, dtype=torch.int64), torch.rand(0, 2, 5)
    verify = ss.verify_chain_from_logits if from_logits else ss.verify_chain
    res = verify(target, drafts, draft_probs=q, method="token") if from_logits else verify(target, drafts, q,
                                                                                            method="token")
    assert res.tokens.shape == (0, 3) and res.num_accepted.shape == (0,)


@pytest.mark.parametrize("from_logits", [False, True])
def test_block_verification_never_emits_an_out_of_range_draft_whatever_the_draft_probs(backend, from_logits):
    # Negative draft probabilities gave the weights w_i mass after a draft that can never be accepted (a_i = 0):
    # h_i > 0 let tau pass it, and the out-of-range draft 7 (V = 3) was emitted
    V = 3
    target = torch.full((B, 3, V), 1 / V)
    q = torch.full((B, 2, V), -0.5)
    drafts = torch.tensor([[7, 1]] * B)
    rng = ss.Philox(torch.arange(B))
    if from_logits:
        res = ss.verify_chain_from_logits(target.log(), drafts, draft_probs=q, method="block", rng=rng)
    else:
        res = ss.verify_chain(target, drafts, q, method="block", rng=rng)
    assert bool((res.num_accepted == 0).all())
    assert bool(((res.tokens[:, 0] >= 0) & (res.tokens[:, 0] < V)).all()) and bool((res.tokens[:, 1:] == -1).all())


def _traversal_case():
    """Root -> node 1 (token 4, outside V = 3: never acceptable) -> node 2 (token 1); q = -0.5 everywhere.
    Deleting node 2 gave node 1 w = max(0 * Mb - q, 0) with mass, so a(1) = 0.6 and node 1 was accepted."""
    V = 3
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 1]] * B))
    target = torch.full((B, 3, V), 1 / V)
    q = torch.full((B, 3, V), -0.5)
    drafts = torch.tensor([[0, 4, 1]] * B)
    return V, tree, target, q, drafts


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("draft_sampling", ["iid", "without_replacement"])
def test_traversal_never_accepts_an_out_of_range_draft_whatever_the_draft_probs(backend, from_logits,
                                                                                draft_sampling):
    V, tree, target, q, drafts = _traversal_case()
    rng = ss.Philox(torch.arange(B))
    kw = dict(method="traversal", draft_sampling=draft_sampling, rng=rng)
    if from_logits:
        res = ss.verify_tree_from_logits(target.log(), drafts, tree, draft_probs=q, **kw)
    else:
        res = ss.verify_tree(target, drafts, tree, q, **kw)
    assert bool((res.num_accepted == 0).all()), f"accepted node 1 (token 4 >= V) in {int(res.num_accepted.sum())}"
    assert bool(((res.tokens[:, 0] >= 0) & (res.tokens[:, 0] < V)).all())


@pytest.mark.parametrize("draft_sampling", ["iid", "without_replacement"])
def test_traversal_accepts_nothing_under_a_zero_weight_whatever_the_draft_probs(backend, draft_sampling):
    # the same walk with an in-range token of target probability 0 at node 1: a(1) = 0 must stay 0
    V, tree, target, q, drafts = _traversal_case()
    drafts = torch.tensor([[0, 2, 1]] * B)
    target[:, 0, 2] = 0.0
    res = ss.verify_tree(target, drafts, tree, q, method="traversal", draft_sampling=draft_sampling,
                         rng=ss.Philox(torch.arange(B)))
    assert bool((res.num_accepted == 0).all())


def test_compact_kv_rejects_a_negative_cache_position():
    # cache_lens + path < 0 indexed from the end of the cache (or raised an IndexError on an empty one)
    cache = torch.randn(1, 2, 6, 3)
    before = cache.clone()
    with pytest.raises(ss.ValidationError, match=r"compact_kv: cache_lens \+ path: expected positions inside the "
                                                  r"cache \(< S = 6\) and not negative, got -3"):
        ss.compact_kv(cache, torch.tensor([-3]), torch.tensor([[0, 1]]), torch.tensor([1]))
    assert torch.equal(cache, before)


def test_compact_kv_rejects_a_destination_past_the_cache():
    # a path that steps back (node 0 twice) keeps its sources inside while cache_lens + j runs past the end:
    # an IndexError before
    cache = torch.randn(1, 2, 4, 3)
    with pytest.raises(ss.ValidationError, match=r"compact_kv: cache_lens \+ j: expected positions inside"):
        ss.compact_kv(cache, torch.tensor([3]), torch.tensor([[0, 0]]), torch.tensor([1]))


@pytest.mark.parametrize("from_logits", [False, True])
def test_greedy_tree_verification_rejects_a_philox_of_another_batch(backend, from_logits):
    # greedy draws no uniforms, so the PyTorch walk never looked at the seeds (the kernel path did)
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0]] * 2))
    verify = ss.verify_tree_from_logits if from_logits else ss.verify_tree
    with pytest.raises(ss.ValidationError, match=r"Philox.seed: expected shape \[B\] = \[2\], got \[3\]"):
        verify(torch.rand(2, 2, 5), torch.zeros(2, 2, dtype=torch.int64), tree, method="greedy",
               rng=ss.Philox(torch.zeros(3, dtype=torch.int64)))


def test_full_validation_rejects_probabilities_whose_sum_overflows():
    # finite values summing past float32's largest: every normalisation made the row 0 (the MLC sampler's next
    # filter then rejected its own input, an all-zero row, naming none of the caller's arguments)
    big = torch.finfo(torch.float32).max
    probs = torch.tensor([[big, big, 0.0], [0.2, 0.3, 0.5]])
    with pytest.raises(ss.ValidationError, match=r"top_k_renorm: probs \(row sum\): expected each distribution to "
                                                  r"have a positive sum \(finite in float32\), got inf \(request 0\)"):
        ss.top_k_renorm(probs, 2, validate="full")
    sampler = ss.mlc.Sampler.create_cpu_sampler()
    with pytest.raises(ss.ValidationError, match=r"probs \(row sum\)"):
        sampler.batch_renormalize_probs_by_top_p(probs, [0], ["r"], [ss.mlc.GenerationConfig()], validate="full")


def test_an_empty_vocab_mask_row_is_quoted_by_its_count_of_allowed_tokens():
    # the message quoted the bad flag itself ("got True")
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[1, 2] = False
    with pytest.raises(ss.ValidationError, match=r"vocab_mask: expected at least one allowed token per row, got 0 "
                                                  r"at index \[2\] \(request 1\)"):
        ss.sample_from_logits(torch.randn(2, 3, 5), vocab_mask=mask, validate="full")


def test_a_row_whose_largest_logit_is_not_finite_has_no_mass(backend):
    # the kernels described such a row with m = 0 and kept exp(x) weights: token 2 of [inf, 0, 1] was drawn with
    # log-probability +88 (+inf for [inf]; a NaN among the kept weights, +87); the reference gives no mass
    logits = torch.tensor([[float("inf"), 0.0, 1.0], [float("inf"), float("-inf"), 0.0], [float("nan"), 0.0, 1.0]])
    for params in (ss.SamplingParams(), ss.SamplingParams(top_k=2), ss.SamplingParams(top_p=0.5, min_p=0.1)):
        out = ss.sample_from_logits(logits, params, ss.Philox(torch.arange(3)))
        assert bool(((out.tokens >= 0) & (out.tokens < 3)).all())
        assert bool((out.logprobs[:2] == float("-inf")).all()), out.logprobs
        assert bool((out.logprobs[2] <= 0).all()), out.logprobs  # NaN: no mass, or (kernels) a cut leaving it out


def test_full_validation_of_tree_logits_skips_the_rows_of_absent_nodes():
    # absent nodes are padding: their rows were checked (as "logits", not "target_logits") by a second pass
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, -1]]))
    logits = torch.randn(1, 3, 4)
    logits[0, 2] = float("nan")
    mask = torch.ones(1, 3, 4, dtype=torch.bool)
    mask[0, 2] = False
    res = ss.verify_tree_from_logits(logits, torch.tensor([[0, 1, 9]]), tree, method="target_only", vocab_mask=mask,
                                     rng=ss.Philox(0), validate="full")
    assert 0 <= int(res.tokens[0, res.num_accepted[0]]) < 4
    logits[0, 1, 0] = float("nan")
    with pytest.raises(ss.ValidationError, match=r"verify_tree_from_logits: target_logits: expected logits without "
                                                  r"NaN or \+inf, got nan at index \[1, 0\] \(request 0\)"):
        ss.verify_tree_from_logits(logits, torch.tensor([[0, 1, 9]]), tree, method="target_only", rng=ss.Philox(0),
                                   validate="full")


def test_finite_logits_far_from_zero_keep_their_distribution(backend):
    # exp2(x * c - top * c) by a multiply-add offsets a row by the rounding of top * c: from |top * c| >= 2**24 the
    # offset overflows, and logits of 1e10 gave a row of zeros, 1e15 NaN, [3e37, 0] drew token 1 (probability 0).
    # The kernels compute exp((x - m) / T), but logits_to_probs runs processing on either back end.
    logits = torch.tensor([[1e10, 0.0, 1.0], [3e37, 0.0, -3e37], [-1e15, -1e15, 0.0]])
    for T in (1.0, 0.5):
        params = ss.SamplingParams(temperature=T)
        torch.testing.assert_close(ss.logits_to_probs(logits, params),
                                   torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))
        out = ss.sample_from_logits(logits, params, ss.Philox(torch.arange(3)), num_logprobs=1)
        assert out.tokens.tolist() == [0, 0, 2] and bool((out.logprobs == 0).all())


def test_nan_uniforms_given_by_the_caller_draw_tokens_in_range(backend):
    """A NaN in Uniforms made the draws' target NaN: token V (sample, chains, trees) or an index error
    (sample_from_logits). NaN is read as 0: the first token with mass."""
    nan = torch.full((2, 3), float("nan"))
    rng = ss.Uniforms(sample=nan, accept=nan)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).repeat(2, 1)
    assert ss.sample(p, rng=rng).tolist() == [1, 1]
    assert ss.sample_from_logits(torch.log(p), rng=rng).tokens.tolist() == [1, 1]
    chain = ss.verify_chain(p[:, None].repeat(1, 3, 1), torch.tensor([[2, 2], [1, 3]]), p[:, None].repeat(1, 2, 1),
                            method="token", rng=rng)
    assert ((chain.tokens >= -1) & (chain.tokens < 4)).all() and (chain.tokens[:, 0] >= 0).all()
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * 2))
    res = ss.verify_tree(p[:, None].repeat(1, 3, 1), torch.tensor([[0, 2, 1]] * 2), tree, p[:, None].repeat(1, 3, 1),
                         method="rrs", rng=rng)
    assert ((res.tokens >= -1) & (res.tokens < 4)).all() and (res.tokens[:, 0] >= 0).all()


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, torch.tensor([1e-40, 0.0])])
def test_a_subnormal_temperature_samples_the_largest_logit(backend, temperature):
    """log2(e) / T overflowed float32 below 2**-126: every weight NaN, token 0 with log-probability -inf. Such a
    temperature acts as 2**-126, the limit T -> 0+: the largest logit, log-probability 0."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 16, generator=g)
    params = ss.SamplingParams(temperature=temperature)
    out = ss.sample_from_logits(logits, params, ss.Philox(torch.arange(2)))
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs.tolist() == [0.0, 0.0]
    if backend == "torch":
        probs = ss.logits_to_probs(logits, params)
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 16).float())


def test_a_top_k_past_int64_is_off():
    """SamplingParams(top_k=2**63) was accepted, then every op failed converting it to int64."""
    g = torch.Generator().manual_seed(6)
    logits, probs = torch.randn(3, 20, generator=g), torch.rand(3, 20, generator=g)
    for k in (2**63, 2**70):
        out = ss.sample_from_logits(logits, ss.SamplingParams(top_k=k), ss.Philox(torch.arange(3)))
        assert out.tokens.tolist() == ss.sample_from_logits(logits, None, ss.Philox(torch.arange(3))).tokens.tolist()
        assert torch.allclose(ss.top_k_renorm(probs, k), probs / probs.sum(-1, keepdim=True))


@pytest.mark.parametrize("op, name, bad", [(ss.top_p_renorm, "top_p", 1.5), (ss.top_k_renorm, "top_k", 2.5),
                                           (ss.min_p_renorm, "min_p", -1.0),
                                           (ss.top_p_renorm, "top_p", torch.tensor([0.5, 1.5]))])
def test_the_filters_errors_name_the_filter_and_its_argument(op, name, bad):
    """They named SamplingParams and its field, which the caller never wrote."""
    with pytest.raises(ss.ValidationError, match=rf"^{op.__name__}: {name}: expected .*, got"):
        op(torch.rand(2, 8), bad, validate="full")


def test_a_vocab_mask_whose_values_cannot_be_read_is_not_called_a_shape_error():
    with pytest.raises(ss.ValidationError, match=r"vocab_mask: expected a tensor whose values can be read on logits' "
                                                 r"device cpu, got one on meta"):
        ss.sample_from_logits(torch.randn(2, 50), vocab_mask=torch.ones(2, 50, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize(("name", "call"), [
    ("SamplingParams.temperature", lambda x, meta: ss.sample_from_logits(
        x, ss.SamplingParams(temperature=torch.ones(2, device=meta)))),
    ("Philox.seed", lambda x, meta: ss.sample_from_logits(x, rng=ss.Philox(torch.arange(2, device=meta)))),
    ("Philox.offset", lambda x, meta: ss.sample_from_logits(x, rng=ss.Philox(0, torch.zeros(2, dtype=torch.int64,
                                                                                             device=meta)))),
    ("Uniforms.sample", lambda x, meta: ss.sample_from_logits(x, rng=ss.Uniforms(torch.rand(2, 1, device=meta)))),
])
def test_a_parameter_or_key_on_another_device_than_the_inputs_or_the_cpu_is_rejected_by_name(name, call):
    # they are copied to the inputs' device; from a device that cannot be read (here meta) the copy raised
    # NotImplementedError, not an error naming the argument
    with pytest.raises(ss.ValidationError, match=rf"sample_from_logits: {name}: expected a tensor on cpu .* or the "
                                                 rf"CPU, got one on meta"):
        call(torch.randn(2, 5), torch.device("meta"))


def test_a_parameter_tensor_on_the_inputs_device_passes_the_device_check_and_means_its_scalar():
    x = torch.randn(2, 5)
    rng = ss.Philox(torch.arange(2))
    want = ss.sample_from_logits(x, ss.SamplingParams(temperature=0.5), rng=rng)
    got = ss.sample_from_logits(x, ss.SamplingParams(temperature=torch.full((2,), 0.5)), rng=rng)
    assert torch.equal(want.tokens, got.tokens)


_P, _Q, _X = torch.rand(2, 3, 5), torch.rand(2, 2, 5), torch.randint(0, 5, (2, 2))


@pytest.mark.parametrize(("op", "name", "call"), [
    ("verify_chain", "target_probs", lambda m: ss.verify_chain(_P.to(m), _X.to(m), _Q.to(m), method="token")),
    ("verify_chain", "target_probs", lambda m: ss.verify_chain(_P.to(m), _X.to(m))),
    ("verify_chain_from_logits", "target_logits", lambda m: ss.verify_chain_from_logits(_P.to(m), _X.to(m))),
    ("sample_from_logits", "logits", lambda m: ss.sample_from_logits(_P[:, 0].to(m))),
    ("logits_to_probs", "logits", lambda m: ss.logits_to_probs(_P[:, 0].to(m))),
    ("TokenTree.from_parents", "parents", lambda m: ss.TokenTree.from_parents(torch.tensor([[-1, 0]], device=m))),
    ("TokenTree.from_mask", "mask", lambda m: ss.TokenTree.from_mask(torch.eye(2, dtype=torch.bool, device=m)[None])),
    ("verify_tree", "target_probs", lambda m: ss.verify_tree(
        _P.to(m), _X[:, :1].expand(2, 3).to(m), ss.TokenTree.from_parents(torch.tensor([[-1, 0, 1]] * 2)))),
])
def test_main_inputs_without_values_are_named(op, name, call):
    # a 'meta' tensor is a shape only: reading it raised torch's RuntimeError or NotImplementedError deep inside,
    # and a target_only chain returned a meta "result"
    with pytest.raises(ss.ValidationError, match=rf"^{op}: {name}: expected a tensor holding values, got a tensor "
                                                 r"on the 'meta' device"):
        call(torch.device("meta"))


def _zero_at_3(shape: tuple[int, ...]) -> torch.Tensor:
    """Target rows of 4 tokens where token 3 has probability 0 (token 1 holds the mass)."""
    p = torch.zeros(*shape, 4)
    p[..., 1] = 1.0
    return p


_PATH = ss.TokenTree.from_parents(torch.tensor([[-1, 0]]))  # a root and one child


@pytest.mark.parametrize("q_x", [-0.5, float("-inf")])
def test_a_draft_of_target_probability_zero_is_never_accepted_whatever_its_draft_probability(backend, q_x):
    """A negative draft probability (not checked by default) passed ``u q(x) < p(x)`` at p(x) = 0: token and rrs
    accepted a draft the target never samples (the correction then comes from a residual of such garbage)."""
    q = torch.full((1, 1, 4), 0.25)
    q[..., 3] = q_x
    for seed in range(8):
        out = ss.verify_chain(_zero_at_3((1, 2)), torch.tensor([[3]]), q, method="token", rng=ss.Philox(seed))
        assert out.num_accepted.tolist() == [0]
        for sampling in ("iid", "without_replacement"):
            res = ss.verify_tree(_zero_at_3((1, 2)), torch.tensor([[0, 3]]), _PATH, q.expand(1, 2, 4), method="rrs",
                                 draft_sampling=sampling, rng=ss.Philox(seed))
            assert res.num_accepted.tolist() == [0]


@pytest.mark.parametrize("method", ["token", "block", "rrs", "traversal"])
def test_uniforms_outside_the_unit_interval_act_as_the_nearer_end(backend, method):
    """Acceptance uniforms were used as given: -1 accepted a draft of target probability 0, 2 rejected drafts that
    the nearer end (just below 1) accepts. They read as 0 and as the largest float32 below 1, as the draws do."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 3, 6, generator=g), -1)
    p[0, 0, 3] = 0.0
    q = torch.softmax(torch.randn(4, 3, 6, generator=g), -1)
    x = torch.randint(0, 6, (4, 2), generator=g)
    x[0, 0] = 3
    below_one = 1.0 - 2.0**-24

    def run(accept: float, sample: float):
        rng = ss.Uniforms(sample=torch.full((4, 3), sample), accept=torch.full((4, 3), accept))
        if method in ("token", "block"):
            return ss.verify_chain(p, x, q[:, :2], method=method, rng=rng).tokens.tolist()
        tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * 4))
        return ss.verify_tree(p, torch.cat([x[:, :1], x], 1), tree, q, method=method, rng=rng).tokens.tolist()

    for outside, end in ((-1.0, 0.0), (2.0, below_one), (float("inf"), below_one), (float("-inf"), 0.0)):
        assert run(outside, 0.5) == run(end, 0.5), (outside, end)
        assert run(0.5, outside) == run(0.5, end), (outside, end)
    assert run(-1.0, 0.5)[0][0] != 3


@pytest.mark.parametrize("row", ["zero", "nan", "masked"])
def test_target_only_accepts_no_draft_at_a_row_without_mass(backend, row):
    """A row without mass draws token 0; a draft 0 there, of target probability 0, was accepted and the walk went
    on (chains and trees, from probabilities and logits). Now the draw is the emitted token."""
    V = 5
    probs = torch.softmax(torch.randn(2, 3, V, generator=torch.Generator().manual_seed(4)), -1)
    logits = probs.log()
    mask = torch.ones(2, 3, V, dtype=torch.bool)
    if row == "zero":
        probs[:, 0] = 0.0
        logits[:, 0] = float("-inf")
    elif row == "nan":  # a NaN logit leaves its row without mass (a NaN probability is read as 0)
        logits[:, 0, 2] = float("nan")
    else:
        mask[:, 0] = False
    x = torch.zeros(2, 2, dtype=torch.int64)
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 1]] * 2))
    results = [ss.verify_chain_from_logits(logits, x, vocab_mask=mask, method="target_only", rng=ss.Philox(0)),
               ss.verify_tree_from_logits(logits, torch.zeros(2, 3, dtype=torch.int64), tree, vocab_mask=mask,
                                          method="target_only", rng=ss.Philox(0))]
    if row == "zero":
        results += [ss.verify_chain(probs, x, method="target_only", rng=ss.Philox(0)),
                    ss.verify_tree(probs, torch.zeros(2, 3, dtype=torch.int64), tree, method="target_only",
                                   rng=ss.Philox(0))]
    for res in results:
        assert res.num_accepted.tolist() == [0, 0]
        assert res.tokens[:, 0].tolist() == [0, 0] and (res.tokens[:, 1:] == -1).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_probability_takes_no_top_k_place(bad):
    """NaN and +inf probabilities are read as weight 0, but they led the top-k order and took one of the k places:
    ``top_k_renorm([[0.2, nan, 0.3, 0.5]], 2)`` kept token 3 alone."""
    probs = torch.tensor([[0.2, bad, 0.3, 0.5], [0.2, 0.0, 0.3, 0.5]])
    out = ss.top_k_renorm(probs, 2)
    assert torch.equal(out[0], out[1]) and out[1].tolist() == [0.0, 0.0, 0.375, 0.625]
    assert ss.top_k_renorm(probs, 3)[0].tolist() == ss.top_k_renorm(probs, 3)[1].tolist()
