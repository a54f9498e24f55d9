"""specsampler.mlc: MLC-LLM's Sampler (sampling, renormalisation, verification), its configs,
random generators, results, metrics and trace recorder."""

import json
import math

import pytest
import torch

import specsampler as ss
from conftest import mc_trials
from specsampler.mlc import (
    EventTraceRecorder,
    GenerationConfig,
    RandomGenerator,
    Sampler,
    SampleResult,
    SpecDecodeMetrics,
)
from specsampler.validation import ValidationError
from specsampler.verify import oracle
from specsampler.verify.exactness import (
    Table,
    chi_square,
    encode,
    encode_dist,
    random_model,
    shape_parents,
    tree_inputs,
)

SAMPLE_METHODS = ["batch_sample_tokens_with_prob_before_top_p", "batch_sample_tokens_with_prob_after_top_p"]


def _sample(sampler, method, probs, indices, cfgs, seeds):
    """Call a sampling method with fresh generators; returns (results, generators)."""
    rngs = [RandomGenerator(s) for s in seeds]
    out = getattr(sampler, method)(probs, indices, [f"r{i}" for i in range(len(indices))], cfgs, rngs)
    return out, rngs


def _random_cfgs(n, seed):
    g = torch.Generator().manual_seed(seed)
    cfgs = []
    for i in range(n):
        kind = i % 4
        cfgs.append(GenerationConfig(
            temperature=0.0 if kind == 0 else 1.0,
            top_p=float(torch.rand(1, generator=g)) * 0.5 + 0.5 if kind in (1, 3) else 1.0,
            top_k=int(torch.randint(1, 8, (1,), generator=g)) if kind == 2 else 0,
            min_p=0.05 if kind == 3 else 0.0,
            logprobs=kind != 1, top_logprobs=kind + 1 if kind != 1 else 0))
    return cfgs


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("method", SAMPLE_METHODS)
def test_sample_indices_map_each_result_to_its_row(method):
    V = 9
    probs = torch.zeros(5, V)
    probs[torch.arange(5), torch.tensor([4, 0, 8, 2, 6])] = 1.0  # row r is one-hot at a token of its own
    indices = [3, 3, 0, 4, 1, 0, 2]  # permuted and repeated
    out, _ = _sample(Sampler.create_cpu_sampler(), method, probs, indices, [GenerationConfig()] * 7, range(7))
    assert [r.get_token_id() for r in out] == [int(probs[i].argmax()) for i in indices]
    assert all(r.sampled_token_id[1] == 1.0 for r in out)
    renorm = Sampler.create_cpu_sampler().batch_renormalize_probs_by_top_p(
        probs, torch.tensor(indices), [f"r{i}" for i in range(7)], [GenerationConfig(top_p=0.9)] * 7)
    assert torch.equal(renorm, probs)  # every row, read by the same indices (one-hot rows: unchanged)


@pytest.mark.parametrize("method", SAMPLE_METHODS)
def test_a_sample_depends_only_on_its_row_config_and_generator(method):
    torch.manual_seed(0)
    n, V = 16, 50
    probs = torch.softmax(torch.randn(n, V) * 2, -1)
    cfgs = _random_cfgs(n, 1)
    seeds = [1000 + 7 * i for i in range(n)]
    sampler = Sampler.create_cpu_sampler()
    full, rngs = _sample(sampler, method, probs, list(range(n)), cfgs, seeds)
    assert [r.offset for r in rngs] == [1] * n
    perm = torch.randperm(n).tolist()
    neighbours = torch.softmax(torch.randn(n, V), -1)  # other rows and other configs around it
    mixed = torch.cat([probs, neighbours])
    permuted, _ = _sample(sampler, method, mixed, perm + list(range(n, 2 * n)),
                          [cfgs[i] for i in perm] + _random_cfgs(n, 2), [seeds[i] for i in perm] + seeds)
    for pos, i in enumerate(perm):
        assert permuted[pos] == full[i]
    for i in (0, 5, 11):
        alone, _ = _sample(sampler, method, probs[i : i + 1], [0], [cfgs[i]], [seeds[i]])
        assert alone[0] == full[i]


def test_consecutive_calls_draw_anew_and_the_same_seeds_replay():
    V, n = 1000, 12
    probs = torch.full((1, V), 1.0 / V)
    sampler = Sampler.create_cpu_sampler()
    cfgs, ids = [GenerationConfig()] * n, [f"r{i}" for i in range(n)]
    rngs = [RandomGenerator(i) for i in range(n)]
    first = sampler.batch_sample_tokens_with_prob_after_top_p(probs, [0] * n, ids, cfgs, rngs)
    second = sampler.batch_sample_tokens_with_prob_after_top_p(probs, [0] * n, ids, cfgs, rngs)
    assert [r.offset for r in rngs] == [2] * n and [r.seed for r in rngs] == list(range(n))
    assert sum(a.get_token_id() != b.get_token_id() for a, b in zip(first, second)) >= n - 1
    fresh = [RandomGenerator(i) for i in range(n)]
    assert sampler.batch_sample_tokens_with_prob_after_top_p(probs, [0] * n, ids, cfgs, fresh) == first
    assert sampler.batch_sample_tokens_with_prob_after_top_p(probs, [0] * n, ids, cfgs, fresh) == second
    # one generator serving two samples of a call reads two offsets: its draws differ
    shared = RandomGenerator(5)
    twice = sampler.batch_sample_tokens_with_prob_after_top_p(probs, [0, 0], ["a", "a"], cfgs[:2], [shared, shared])
    assert shared.offset == 2 and twice[0] != twice[1]


def test_random_generator_draws_a_63_bit_seed_when_none_is_given():
    seeds = {RandomGenerator().seed for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2**63 for s in seeds)
    big = RandomGenerator(2**64 - 1)  # any int: folded into the int64 Philox key
    Sampler.create_cpu_sampler().batch_sample_tokens_with_prob_after_top_p(
        torch.ones(1, 4), [0], ["a"], [GenerationConfig()], [big])
    assert big.offset == 1


def test_tokens_outside_the_nucleus_are_never_sampled_before_top_p():
    n = 4000
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    sampler = Sampler.create_cpu_sampler()
    cfgs = [GenerationConfig(top_p=0.75)] * n
    before, _ = _sample(sampler, SAMPLE_METHODS[0], probs, [0] * n, cfgs, range(n))
    counts = torch.bincount(torch.tensor([r.get_token_id() for r in before]), minlength=4)
    assert counts[2:].sum() == 0
    assert abs(counts[0] / n - 2 / 3) < 0.03
    # the probability reported is the input row's, not the renormalised one
    assert {r.sampled_token_id[1] for r in before} == {0.5, 0.25}
    # after top-p: the row is used as it is, so the tokens past the nucleus are drawn too
    after, _ = _sample(sampler, SAMPLE_METHODS[1], probs, [0] * n, cfgs, range(n))
    assert {r.get_token_id() for r in after} == {0, 1, 2, 3}


def test_before_top_p_equals_after_top_p_on_the_renormalised_rows():
    torch.manual_seed(1)
    n, V = 40, 30
    probs = torch.softmax(torch.randn(n, V) * 2, -1)
    cfgs = _random_cfgs(n, 3)
    idx = torch.randperm(n).tolist()
    sampler = Sampler.create_cpu_sampler()
    ids = [f"r{i}" for i in range(n)]
    before, _ = _sample(sampler, SAMPLE_METHODS[0], probs, idx, cfgs, range(n))
    renormed = sampler.batch_renormalize_probs_by_top_p(probs, idx, ids, cfgs)
    after, _ = _sample(sampler, SAMPLE_METHODS[1], renormed, idx, cfgs, range(n))  # as MLC's engine reads it
    assert [r.get_token_id() for r in before] == [r.get_token_id() for r in after]
    for r, i in zip(before, idx):
        assert r.sampled_token_id[1] == pytest.approx(float(probs[i, r.get_token_id()]), abs=0)


def test_temperature_zero_is_greedy_with_ties_to_the_lower_id():
    probs = torch.tensor([[0.1, 0.4, 0.1, 0.4], [0.7, 0.1, 0.1, 0.1]])
    sampler = Sampler.create_cpu_sampler()
    cfgs = [GenerationConfig(temperature=0.0), GenerationConfig(temperature=1e-6, top_p=0.3)] * 50
    out, _ = _sample(sampler, SAMPLE_METHODS[0], probs, [0, 1] * 50, cfgs, range(100))
    assert [r.get_token_id() for r in out] == [1, 0] * 50
    assert out[0].sampled_token_id[1] == pytest.approx(0.4)
    renormed = sampler.batch_renormalize_probs_by_top_p(probs, [0, 1], ["a", "b"], cfgs[:2])
    assert torch.equal(renormed, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_renormalize_applies_top_k_top_p_and_min_p_as_the_renorm_ops():
    torch.manual_seed(2)
    n, V = 24, 40
    probs = torch.softmax(torch.randn(n, V) * 2, -1)
    idx = torch.randperm(n)
    sampler = Sampler.create_cpu_sampler()
    ids = [f"r{i}" for i in range(n)]
    top_p = torch.rand(n) * 0.6 + 0.4
    only_p = [GenerationConfig(top_p=float(p)) for p in top_p]
    out = sampler.batch_renormalize_probs_by_top_p(probs, idx, ids, only_p)
    assert out.dtype == torch.float32 and out.shape == (n, V)
    torch.testing.assert_close(out[idx], ss.top_p_renorm(probs[idx], top_p), atol=1e-6, rtol=1e-5)
    cfgs = _random_cfgs(n, 4)
    out = sampler.batch_renormalize_probs_by_top_p(probs, idx, ids, cfgs)[idx]
    params = ss.SamplingParams(temperature=torch.tensor([c.temperature for c in cfgs]),
                               top_k=torch.tensor([c.top_k for c in cfgs]),
                               top_p=torch.tensor([c.top_p for c in cfgs]),
                               min_p=torch.tensor([c.min_p for c in cfgs]))
    torch.testing.assert_close(out, ss.logits_to_probs(probs[idx].log(), params), atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- logprobs


def test_top_prob_tokens_are_sorted_and_as_many_as_top_logprobs():
    probs = torch.tensor([[0.1, 0.3, 0.05, 0.3, 0.25], [0.2, 0.2, 0.2, 0.2, 0.2]])
    cfgs = [GenerationConfig(logprobs=True, top_logprobs=3), GenerationConfig(logprobs=True, top_logprobs=2),
            GenerationConfig(logprobs=True), GenerationConfig()]
    for method in SAMPLE_METHODS:
        out, _ = _sample(Sampler.create_cpu_sampler(), method, probs, [0, 1, 0, 0], cfgs, range(4))
        assert [t for t, _ in out[0].top_prob_tokens] == [1, 3, 4]  # ties: the lower id first
        assert [p for _, p in out[0].top_prob_tokens] == pytest.approx([0.3, 0.3, 0.25])
        assert [t for t, _ in out[1].top_prob_tokens] == [0, 1]
        assert out[2].top_prob_tokens == [] and out[3].top_prob_tokens == []
        assert all(isinstance(t, int) and isinstance(p, float) for t, p in out[0].top_prob_tokens)


def test_logprob_json_follows_openai_layout():
    res = SampleResult((7, 0.25), [(7, 0.25), (3, 0.0)])
    doc = json.loads(res.get_logprob_json())
    assert list(doc) == ["token", "logprob", "bytes", "top_logprobs"]
    assert doc["token"] == "7" and doc["bytes"] == [55] and doc["logprob"] == pytest.approx(math.log(0.25))
    assert doc["top_logprobs"] == [{"token": "7", "logprob": pytest.approx(math.log(0.25)), "bytes": [55]},
                                   {"token": "3", "logprob": pytest.approx(math.log(1e-10)), "bytes": [51]}]
    assert res.get_logprob_json(logprob=False) == ""
    assert json.loads(SampleResult((1, 1.0)).get_logprob_json())["top_logprobs"] == []
    assert res.get_token_id() == 7


def test_logprob_json_uses_the_tokenizer_and_escapes_the_token():
    class HFLike:
        def convert_ids_to_tokens(self, i):
            return {7: 'a"b\\é', 3: "\n"}[i]

    class DecodeOnly:
        def decode(self, ids):
            return "tok" + str(ids[0])

    res = SampleResult((7, 0.5), [(7, 0.5), (3, 0.5)])
    doc = json.loads(res.get_logprob_json(HFLike()))
    assert doc["token"] == 'a"b\\é' and doc["bytes"] == list('a"b\\é'.encode())
    assert doc["top_logprobs"][1]["token"] == "\n" and doc["top_logprobs"][1]["bytes"] == [10]
    assert json.loads(res.get_logprob_json(DecodeOnly()))["token"] == "tok7"


# ----------------------------------------------------------------------------- verification


def _requests(shapes, V, seed):
    """MLC verification inputs for requests of the given request-local parent lists."""
    g = torch.Generator().manual_seed(seed)
    lengths = [len(p) for p in shapes]
    total = sum(lengths)
    probs = torch.softmax(torch.randn(total, V, generator=g) * 2, -1)
    draft_probs = torch.softmax(torch.randn(total, V, generator=g), -1)
    cum = [0]
    for n in lengths:
        cum.append(cum[-1] + n)
    parents = [p for ps in shapes for p in ps]
    drafts = []
    for b, ps in enumerate(shapes):
        rows = draft_probs[cum[b] + 1 : cum[b] + len(ps)]
        # half the drafts follow the target's argmax at the parent, so walks go deep
        argmax = probs[[cum[b] + p for p in ps[1:]]].argmax(-1) if len(ps) > 1 else torch.zeros(0, dtype=torch.long)
        drawn = torch.multinomial(rows, 1, generator=g)[:, 0] if len(ps) > 1 else argmax
        pick = torch.where(torch.rand(len(ps) - 1, generator=g) < 0.5, argmax, drawn)
        drafts.append([SampleResult((int(t), float(rows[j, t]))) for j, t in enumerate(pick.tolist())])
    return probs, cum, parents, drafts, draft_probs


def _padded(probs, cum, parents, drafts, draft_probs):
    """The same requests as verify_tree's [B, N, V] inputs, built entry by entry."""
    B, V = len(cum) - 1, probs.shape[1]
    N = max(cum[b + 1] - cum[b] for b in range(B))
    p, q = torch.zeros(B, N, V), torch.zeros(B, N, V)
    x, par = torch.zeros(B, N, dtype=torch.long), torch.full((B, N), -1)
    for b in range(B):
        for j in range(cum[b + 1] - cum[b]):
            p[b, j], q[b, j], par[b, j] = probs[cum[b] + j], draft_probs[cum[b] + j], parents[cum[b] + j]
            if j:
                x[b, j] = drafts[b][j - 1].get_token_id()
    return p, x, ss.TokenTree.from_parents(par), q


MIXED = [[-1, 0, 1, 2, 3], shape_parents([2, 2]), [-1], shape_parents([3, 1]), [-1, 0], shape_parents([1, 2, 1])]


@pytest.mark.parametrize("method, drafting", [("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid")])
def test_verify_mixed_chains_and_trees_in_one_call_equals_verify_tree(method, drafting):
    shapes = MIXED * 3
    V, B = 8, len(shapes)
    probs, cum, parents, drafts, q = _requests(shapes, V, seed=3)
    cfgs = [GenerationConfig(logprobs=b % 2 == 0, top_logprobs=2 * (b % 2 == 0)) for b in range(B)]
    seeds = [31 * b + 5 for b in range(B)]
    rngs = [RandomGenerator(s) for s in seeds]
    for r in rngs:
        r.offset = 3
    ids = [f"req{b}" for b in range(B)]
    results, last = Sampler.create_cpu_sampler().batch_verify_draft_tokens_with_prob_after_top_p(
        probs, ids, cum, cfgs, rngs, drafts, parents, q, method=method, draft_sampling=drafting)
    assert [r.offset for r in rngs] == [4] * B
    p, x, tree, qq = _padded(probs, cum, parents, drafts, q)
    ref = ss.verify_tree(p, x, tree, qq, method=method, draft_sampling=drafting,
                         rng=ss.Philox(torch.tensor(seeds), torch.full((B,), 3)))
    assert last == ref.last_node.tolist()
    assert max(last) >= 3  # some walks go deep
    for b in range(B):
        n = int(ref.num_accepted[b])
        assert len(results[b]) == n + 1  # the accepted drafts, then exactly one more token
        assert [r.get_token_id() for r in results[b]] == ref.tokens[b, : n + 1].tolist()
        assert 0 <= last[b] < cum[b + 1] - cum[b]  # request-local
        # each token's probability: the target's at the row it was drawn at (its parent; the final: last node)
        path = ref.path[b, : n + 1].tolist()
        for k, r in enumerate(results[b]):
            row = probs[cum[b] + path[k]]
            assert r.sampled_token_id[1] == float(row[r.get_token_id()])
            if cfgs[b].logprobs:
                order = sorted(range(V), key=lambda t: (-float(row[t]), t))[:2]
                assert [t for t, _ in r.top_prob_tokens] == order
            else:
                assert r.top_prob_tokens == []
    # each request alone, with a fresh generator at the same state, verifies the same
    for b in (1, 2, 5, 9):
        n_b = cum[b + 1] - cum[b]
        alone_rng = RandomGenerator(seeds[b])
        alone_rng.offset = 3
        alone, alone_last = Sampler.create_cpu_sampler().batch_verify_draft_tokens_with_prob_after_top_p(
            probs[cum[b] : cum[b + 1]], [ids[b]], [0, n_b], [cfgs[b]], [alone_rng], [drafts[b]],
            parents[cum[b] : cum[b + 1]], q[cum[b] : cum[b + 1]], method=method, draft_sampling=drafting)
        assert alone[0] == results[b] and alone_last[0] == last[b]


def test_draft_probs_equal_to_the_target_accept_every_draft():
    shapes = [[-1, 0, 1, 2], [-1, 0], [-1, 0, 1, 2, 3, 4]]
    V = 6
    probs, cum, parents, drafts, _ = _requests(shapes, V, seed=4)
    q = torch.zeros_like(probs)
    for g, p in enumerate(parents):  # node g was drawn from its parent's target row
        if p >= 0:
            b = max(i for i in range(len(cum) - 1) if cum[i] <= g)
            q[g] = probs[cum[b] + p]
    cfgs = [GenerationConfig()] * 3
    results, last = Sampler.create_cpu_sampler().batch_verify_draft_tokens_with_prob_after_top_p(
        probs, ["a", "b", "c"], cum, cfgs, [RandomGenerator(i) for i in range(3)], drafts, parents, q)
    assert last == [3, 1, 5]
    for b in range(3):
        assert [r.get_token_id() for r in results[b][:-1]] == [d.get_token_id() for d in drafts[b]]
        assert len(results[b]) == len(drafts[b]) + 1


def test_target_only_needs_no_draft_probs_and_equals_verify_tree():
    shapes = MIXED * 2
    V, B = 5, len(MIXED) * 2
    probs, cum, parents, drafts, q = _requests(shapes, V, seed=5)
    cfgs = [GenerationConfig()] * B
    sampler = Sampler.create_cpu_sampler()
    results, last = sampler.batch_verify_draft_tokens_with_prob_after_top_p(
        probs, [str(b) for b in range(B)], cum, cfgs, [RandomGenerator(b) for b in range(B)], drafts, parents, None,
        method="target_only")
    p, x, tree, _ = _padded(probs, cum, parents, drafts, q)
    ref = ss.verify_tree(p, x, tree, method="target_only", rng=ss.Philox(torch.arange(B)))
    assert last == ref.last_node.tolist()
    assert [[r.get_token_id() for r in rs] for rs in results] == [
        ref.tokens[b, : int(ref.num_accepted[b]) + 1].tolist() for b in range(B)]
    # draft_probs, when given, are ignored by target_only
    again, _ = sampler.batch_verify_draft_tokens_with_prob_after_top_p(
        probs, [str(b) for b in range(B)], cum, cfgs, [RandomGenerator(b) for b in range(B)], drafts, parents, q,
        method="target_only")
    assert again == results


@pytest.mark.montecarlo
def test_verification_through_the_sampler_is_exact():
    """A [2, 1] tree and a chain drafted i.i.d. (V = 4), verified in ONE call: each shape's emitted
    sequences against the oracle's exact distribution (chi-square)."""
    V, T = 4, mc_trials(200_000, 50_000)
    target, draft = random_model(V, 21, zeros=True), random_model(V, 22)
    gen = torch.Generator().manual_seed(0)
    groups = []
    for shape, trials in (([2, 1], T), ([1, 1], T // 5)):
        P, Q = Table(target, V, len(shape)), Table(draft, V, len(shape) - 1)
        p, x, q, _ = tree_inputs(P, Q, shape, trials, "iid", gen)
        groups.append((shape, trials, p, x, q))
    probs = torch.cat([p.reshape(-1, V) for *_, p, _, _ in groups])
    draft_probs = torch.cat([q.reshape(-1, V) for *_, q in groups])
    parents, drafts, lengths = [], [], []
    for shape, trials, _, x, _ in groups:
        parents += shape_parents(shape) * trials
        lengths += [x.shape[1]] * trials
        drafts += [[SampleResult((t, 0.0)) for t in row[1:]] for row in x.tolist()]
    cum = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)]).tolist()
    B = len(lengths)
    results, _ = Sampler.create_cpu_sampler().batch_verify_draft_tokens_with_prob_after_top_p(
        probs, ["r"] * B, cum, [GenerationConfig()] * B, [RandomGenerator(b) for b in range(B)], drafts, parents,
        draft_probs)
    start = 0
    for shape, trials, *_ in groups:
        D = len(shape)
        seqs = [[r.get_token_id() for r in rs] + [-1] * (D + 1 - len(rs)) for rs in results[start : start + trials]]
        start += trials
        exact = oracle.tree(target, draft, shape, "rrs", V)
        p_value, impossible = chi_square(encode(torch.tensor(seqs), V), encode_dist(exact.sequences, D + 1, V))
        assert impossible == 0 and p_value > 1e-4, (shape, p_value, impossible)


# ----------------------------------------------------------------------------- CPU and GPU samplers


def _all_methods(sampler, probs, draft_probs):
    """Every method of a sampler on fixed inputs (fresh generators); returns the results."""
    cfgs = _random_cfgs(6, 7)
    ids = [f"r{i}" for i in range(6)]
    idx = [5, 0, 1, 3, 2, 4]
    rngs = lambda: [RandomGenerator(i) for i in range(6)]
    renorm = sampler.batch_renormalize_probs_by_top_p(probs, idx, ids, cfgs)
    before = sampler.batch_sample_tokens_with_prob_before_top_p(probs, idx, ids, cfgs, rngs())
    after = sampler.batch_sample_tokens_with_prob_after_top_p(renorm, idx, ids, cfgs, rngs())
    shapes = [[-1, 0, 1], [-1], [-1, 0, 0, 1, 1], [-1, 0, 0]]
    _, cum, parents, drafts, _ = _requests(shapes, probs.shape[1], seed=8)
    verified = sampler.batch_verify_draft_tokens_with_prob_after_top_p(
        probs[: cum[-1]], ids[:4], cum, cfgs[:4], rngs()[:4], drafts, parents, draft_probs[: cum[-1]])
    return renorm, before, after, verified


def test_cpu_and_gpu_samplers_agree_on_cpu_tensors():
    torch.manual_seed(9)
    probs = torch.softmax(torch.randn(12, 20) * 2, -1)
    q = torch.softmax(torch.randn(12, 20), -1)
    cpu = _all_methods(Sampler.create_cpu_sampler(), probs, q)
    gpu_path = _all_methods(Sampler.create_gpu_sampler(16, 20, "cpu"), probs, q)
    assert torch.equal(cpu[0], gpu_path[0]) and gpu_path[0].device.type == "cpu"
    assert cpu[1:] == gpu_path[1:]


@pytest.mark.gpu
def test_gpu_sampler_on_cuda_keeps_tensors_on_the_device_and_agrees_with_the_cpu_sampler():
    torch.manual_seed(10)
    probs = torch.softmax(torch.randn(12, 20) * 2, -1)
    q = torch.softmax(torch.randn(12, 20), -1)
    gpu = Sampler.create_gpu_sampler(16, 20, "cuda")
    assert gpu.device.type == "cuda" and Sampler.supports_gpu_sampler(gpu.device)
    on_gpu = _all_methods(gpu, probs.cuda(), q.cuda())
    cpu = _all_methods(Sampler.create_cpu_sampler(), probs, q)
    assert on_gpu[0].is_cuda
    torch.testing.assert_close(on_gpu[0].cpu(), cpu[0])
    for a, b in zip(on_gpu[1:3], cpu[1:3]):
        assert [r.get_token_id() for r in a] == [r.get_token_id() for r in b]
    assert on_gpu[3][1] == cpu[3][1]


def test_cpu_sampler_moves_inputs_to_the_cpu_and_gpu_sampler_checks_its_limits():
    probs = torch.full((4, 8), 0.125)
    cfgs, ids = [GenerationConfig()] * 3, ["a", "b", "c"]
    out = Sampler.create_cpu_sampler().batch_renormalize_probs_by_top_p(probs.double(), [0, 1, 2], ids, cfgs)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    small = Sampler.create_gpu_sampler(2, 8, "cpu")
    with pytest.raises(ValueError, match=r"probs: expected at most max_num_sample = 2 rows, got 4 rows"):
        small.batch_renormalize_probs_by_top_p(probs, [0, 1], ids[:2], cfgs[:2])
    # more samples than max_num_sample: MLC's GPU sampler draws them in chunks (they were refused)
    drawn = small.batch_sample_tokens_with_prob_after_top_p(probs, [0, 1, 2], ids, cfgs,
                                                            [RandomGenerator(i) for i in range(3)])
    assert len(drawn) == 3 and all(0 <= r.get_token_id() < 8 for r in drawn)
    with pytest.raises(ValueError, match=r"probs: expected at most vocab_size = 4 columns, got \[4, 8\]"):
        Sampler.create_gpu_sampler(8, 4, "cpu").batch_renormalize_probs_by_top_p(probs, [0], ["a"], cfgs[:1])
    with pytest.raises(ValueError, match=r"cum_verify_lengths: expected at most max_num_sample = 2 nodes"):
        small.batch_verify_draft_tokens_with_prob_after_top_p(
            probs[:3], ["a"], [0, 3], cfgs[:1], [RandomGenerator(0)], [[SampleResult((1, 0.1))] * 2], [-1, 0, 1],
            probs[:3])
    meta = Sampler.create_gpu_sampler(8, 8, "meta")
    with pytest.raises(ValueError, match=r"probs: expected a tensor on the sampler's device meta, got one on cpu"):
        meta.batch_sample_tokens_with_prob_after_top_p(probs, [0], ["a"], cfgs[:1], [RandomGenerator(0)])


@pytest.mark.parametrize("device, expected", [
    ("cuda", True), ("cuda:1", True), (torch.device("cuda", 0), True), ("hip", True), ("hip:0", True),
    ("cpu", False), (torch.device("cpu"), False), ("mps", False), ("meta", False), ("vulkan", False)])
def test_supports_gpu_sampler_for_cuda_and_rocm_devices(device, expected):
    assert Sampler.supports_gpu_sampler(device) is expected


# ----------------------------------------------------------------------------- metrics and traces


def test_spec_decode_metrics_json_layout():
    m = SpecDecodeMetrics()
    assert m.is_empty()
    for draft_length, accept_length in ((3, 1), (3, 3), (2, 2), (4, 2), (5, 1)):
        m.update(draft_length, accept_length)
    assert not m.is_empty()
    doc = m.as_json()
    assert list(doc) == ["draft_count", "accept_count", "accept_prob", "accept_rate", "accept_len"]
    assert doc["draft_count"] == [5, 5, 4, 2, 1]
    assert doc["accept_count"] == [5, 3, 1, 0, 0]
    assert doc["accept_prob"] == pytest.approx(
        {"accept_prob{step=0}": 1.0, "accept_prob{step=1}": 0.6, "accept_prob{step=2}": 0.25,
         "accept_prob{step=3}": 0.0, "accept_prob{step=4}": 0.0})
    assert doc["accept_rate"] == pytest.approx(
        {"accept_rate{step=1}": 0.6, "accept_rate{step=2}": 1 / 3, "accept_rate{step=3}": 0.0,
         "accept_rate{step=4}": 0.0})
    assert doc["accept_len"] == pytest.approx(
        {"accept_len{step=0}": 1.0, "accept_len{step=1}": 1.6, "accept_len{step=2}": 1.85,
         "accept_len{step=3}": 1.85, "accept_len{step=4}": 1.85})
    json.dumps(doc)
    m.reset()
    assert m.is_empty() and m.as_json()["accept_prob"] == {}
    with pytest.raises(ValueError, match="accept_length: expected an int >= 1, got 0"):
        m.update(3, 0)
    with pytest.raises(ValueError, match="draft_length: expected an int >= accept_length = 3, got 2"):
        m.update(2, 3)


def test_trace_records_begin_and_end_of_every_call_per_request(tmp_path):
    rec = EventTraceRecorder()
    sampler = Sampler.create_cpu_sampler(trace_recorder=rec)
    probs = torch.softmax(torch.randn(6, 10), -1)
    cfgs = [GenerationConfig()] * 2
    sampler.batch_renormalize_probs_by_top_p(probs, [0, 1], ["a", "b"], cfgs)
    sampler.batch_sample_tokens_with_prob_before_top_p(probs, [0, 1], ["a", "b"], cfgs,
                                                       [RandomGenerator(0), RandomGenerator(1)])
    sampler.batch_sample_tokens_with_prob_after_top_p(probs, [2], ["c"], cfgs[:1], [RandomGenerator(2)])
    sampler.batch_verify_draft_tokens_with_prob_after_top_p(
        probs[:5], ["a", "c"], [0, 3, 5], cfgs, [RandomGenerator(0), RandomGenerator(2)],
        [[SampleResult((1, 0.1)), SampleResult((2, 0.1))], [SampleResult((3, 0.1))]], [-1, 0, 0, -1, 0], probs[:5])
    rec.add_event("b", "prefill done")
    path = tmp_path / "trace.json"
    rec.save(path)
    doc = json.loads(path.read_text())
    assert json.loads(rec.dump_json()) == doc
    events = doc["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == {"a", "b", "c"} and len(set(names.values())) == 3
    calls = {"a": ["batch_renormalize_probs_by_top_p", "batch_sample_tokens_with_prob_before_top_p",
                   "batch_verify_draft_tokens_with_prob_after_top_p"],
             "b": ["batch_renormalize_probs_by_top_p", "batch_sample_tokens_with_prob_before_top_p"],
             "c": ["batch_sample_tokens_with_prob_after_top_p", "batch_verify_draft_tokens_with_prob_after_top_p"]}
    for request, tid in names.items():
        track = [e for e in events if e.get("tid") == tid and e["ph"] in "BEi"]
        spans = [e for e in track if e["ph"] in "BE"]
        assert [e["ph"] for e in spans] == ["B", "E"] * len(calls[request])
        assert [e["name"] for e in spans[::2]] == calls[request] == [e["name"] for e in spans[1::2]]
        assert all(b["ts"] <= e["ts"] for b, e in zip(spans[::2], spans[1::2]))
        assert all(e["pid"] == 1 for e in track)
    instant = [e for e in events if e["ph"] == "i"]
    assert instant == [{"name": "prefill done", "ph": "i", "ts": instant[0]["ts"], "pid": 1, "tid": names["b"],
                        "s": "t"}]


# ----------------------------------------------------------------------------- configs and errors


def test_generation_config_defaults_and_ranges():
    cfg = GenerationConfig(stop_token_ids=[2, 3], logit_bias={5: -100.0})
    assert (cfg.n, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (cfg.frequency_penalty, cfg.presence_penalty, cfg.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (cfg.logprobs, cfg.top_logprobs, cfg.seed, cfg.max_tokens) == (False, 0, None, None)
    assert cfg.stop_token_ids == (2, 3)
    GenerationConfig(logprobs=True, top_logprobs=20, temperature=0, top_p=1e-3, min_p=1, presence_penalty=-2)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n=0), "GenerationConfig.n: expected an int >= 1, got 0"),
    (dict(temperature=-0.1), "GenerationConfig.temperature: expected a finite number >= 0, got -0.1"),
    (dict(top_p=0.0), "GenerationConfig.top_p: expected a number in (0, 1], got 0.0"),
    (dict(top_k=1.5), "GenerationConfig.top_k: expected an int"),
    (dict(min_p=1.5), "GenerationConfig.min_p: expected a number in [0, 1], got 1.5"),
    (dict(frequency_penalty=3), "GenerationConfig.frequency_penalty: expected a number in [-2, 2], got 3"),
    (dict(repetition_penalty=0), "GenerationConfig.repetition_penalty: expected a finite number > 0, got 0"),
    (dict(top_logprobs=2), "GenerationConfig.top_logprobs: expected 0 unless logprobs is True, got 2"),
    (dict(logprobs=True, top_logprobs=21), "GenerationConfig.top_logprobs: expected an int in [0, 20], got 21"),
    (dict(logit_bias={1: 200}), "GenerationConfig.logit_bias: expected None or a dict"),
    (dict(max_tokens=0), "GenerationConfig.max_tokens: expected None or an int >= 1, got 0"),
    (dict(stop_token_ids=[-1]), "GenerationConfig.stop_token_ids: expected a sequence of token ids >= 0"),
])
def test_bad_generation_config_names_the_field(kwargs, fragment):
    with pytest.raises(ValidationError) as err:
        GenerationConfig(**kwargs)
    assert fragment in str(err.value)


def _verify_call(**change):
    probs = torch.full((5, 4), 0.25)
    args = dict(probs=probs, request_ids=["a", "b"], cum_verify_lengths=[0, 3, 5],
                generation_cfg=[GenerationConfig()] * 2, rngs=[RandomGenerator(0), RandomGenerator(1)],
                draft_output_tokens=[[SampleResult((1, 0.1)), SampleResult((2, 0.1))], [SampleResult((3, 0.1))]],
                token_tree_parent_ptr=[-1, 0, 0, -1, 0], draft_probs=probs)
    args.update(change)
    return lambda: Sampler.create_cpu_sampler().batch_verify_draft_tokens_with_prob_after_top_p(
        **{k: v for k, v in args.items() if k not in ("method", "draft_sampling")},
        method=args.get("method", "rrs"), draft_sampling=args.get("draft_sampling", "iid"))


def test_full_validation_of_verification_skips_the_roots_draft_rows():
    draft = torch.full((5, 4), 0.25)
    draft[[0, 3]] = math.nan  # a root's token was not drafted: its row is never read
    results, last = _verify_call(draft_probs=draft, validate="full")()
    assert len(results) == 2 and len(last) == 2


def _sample_call(**change):
    args = dict(probs=torch.full((3, 4), 0.25), sample_indices=[0, 2], request_ids=["a", "b"],
                generation_cfg=[GenerationConfig()] * 2, rngs=[RandomGenerator(0), RandomGenerator(1)])
    args.update(change)
    return lambda: Sampler.create_cpu_sampler().batch_sample_tokens_with_prob_before_top_p(**args)


@pytest.mark.parametrize("call, fragments", [
    (_sample_call(sample_indices=[0, 3]), ["sample_indices[1]: expected a row index of probs in [0, 3), got 3",
                                           "(request 1)"]),
    (_sample_call(sample_indices=[0, 1.0]), ["sample_indices[1]: expected an int, got 1.0"]),
    (_sample_call(request_ids=["a"]), ["request_ids: expected 2 entries (one per sample), got 1 entries"]),
    (_sample_call(generation_cfg=[GenerationConfig(), {}]), ["generation_cfg[1]: expected a GenerationConfig, "
                                                              "got dict"]),
    (_sample_call(rngs=[RandomGenerator(0)]), ["rngs: expected 2 entries (one per sample), got 1 entries"]),
    (_sample_call(probs=torch.ones(4)), ["probs: expected 2 dimensions, got shape [4]"]),
    (_sample_call(probs=torch.ones(3, 4, dtype=torch.long)), ["probs: expected a floating-point tensor"]),
    (_sample_call(validate="all"), ["validate: expected one of ('structure', 'full'), got 'all'"]),
    (_verify_call(cum_verify_lengths=[0, 3, 4]), ["cum_verify_lengths[2]: expected the number of rows of probs, 5, "
                                                  "got 4"]),
    (_verify_call(cum_verify_lengths=[0, 5]), ["cum_verify_lengths: expected B + 1 = 3 entries"]),
    (_verify_call(cum_verify_lengths=[0, 5, 5]), ["cum_verify_lengths[2]: expected > cum_verify_lengths[1] = 5",
                                                  "(request 1)"]),
    (_verify_call(draft_output_tokens=[[SampleResult((1, 0.1))], [SampleResult((3, 0.1))]]),
     ["draft_output_tokens[0]: expected 2 draft tokens", "got 1 (request 0)"]),
    (_verify_call(draft_output_tokens=[[SampleResult((1, 0.1)), SampleResult((9, 0.1))], [SampleResult((3, 0.1))]]),
     ["draft_output_tokens[0][1].sampled_token_id[0]: expected a token id in [0, 4), got 9 (request 0)"]),
    (_verify_call(token_tree_parent_ptr=[-1, 0, 0, -1, -1]),
     ["token_tree_parent_ptr[4] (node 1): expected a request-local parent index in [0, 1), got -1 (request 1)"]),
    (_verify_call(token_tree_parent_ptr=[-1, 0, 2, -1, 0]),
     ["token_tree_parent_ptr[2] (node 2): expected a request-local parent index in [0, 2), got 2 (request 0)"]),
    (_verify_call(token_tree_parent_ptr=[0, 0, 0, -1, 0]),
     ["token_tree_parent_ptr[0] (node 0): expected -1 (node 0 is the request's root), got 0"]),
    (_verify_call(token_tree_parent_ptr=[-1, 0, 0, -1]), ["token_tree_parent_ptr: expected 5 entries"]),
    (_verify_call(probs=torch.full((5, 4), 0.25).index_put_((torch.tensor(4), torch.tensor(1)), torch.tensor(math.nan)),
                  validate="full"),  # named in the caller's flat layout, not verify_tree's padded one
     ["batch_verify_draft_tokens_with_prob_after_top_p: probs: expected finite probabilities, got nan at index "
      "[4, 1] (request 1)"]),
    (_verify_call(draft_probs=torch.full((5, 4), 0.25).index_put_((torch.tensor(4), torch.tensor(2)),
                                                                  torch.tensor(-1.0)), validate="full"),
     ["draft_probs: expected probabilities >= 0, got -1.0 at index [4, 2] (request 1)"]),
    (_verify_call(draft_probs=None), ["draft_probs: expected a tensor [num_nodes, V] for method 'rrs', got None"]),
    (_verify_call(draft_probs=torch.ones(5, 3)), ["draft_probs: expected shape [num_nodes, V] (as probs) = [5, 4], "
                                                  "got [5, 3]"]),
    (_verify_call(method="beam"), ["method: expected one of ('greedy', 'target_only', 'rrs', 'traversal'), "
                                   "got 'beam'"]),
    (_verify_call(draft_sampling="top_k"), ["draft_sampling: expected one of ('iid', 'without_replacement')"]),
    (_verify_call(rngs=[RandomGenerator(0), 1]), ["rngs[1]: expected a RandomGenerator, got int (request 1)"]),
    (lambda: Sampler.create_gpu_sampler(0, 10, "cpu"), ["max_num_sample: expected an int >= 1, got 0"]),
    (lambda: Sampler.create_gpu_sampler(4, 10, "nowhere"), ["device: expected a device torch can allocate on"]),
    (lambda: Sampler.create_cpu_sampler(trace_recorder="trace"), ["trace_recorder: expected None or an "
                                                                  "EventTraceRecorder, got str"]),
    (lambda: Sampler.supports_gpu_sampler(0), ["device: expected a torch.device or a device string, got int"]),
    (lambda: RandomGenerator(1.5), ["seed: expected None or an int, got 1.5"]),
])
def test_bad_inputs_name_the_argument(call, fragments):
    with pytest.raises(ValidationError) as err:
        call()
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_inputs_are_not_modified_and_empty_batches_work():
    probs, cum, parents, drafts, q = _requests(MIXED, 6, seed=6)
    before = probs.clone(), q.clone()
    cfgs = [GenerationConfig(top_p=0.8, logprobs=True, top_logprobs=2)] * len(MIXED)
    sampler = Sampler.create_cpu_sampler()
    sampler.batch_verify_draft_tokens_with_prob_after_top_p(
        probs, ["r"] * len(MIXED), cum, cfgs, [RandomGenerator(0)] * len(MIXED), drafts, parents, q)
    sampler.batch_renormalize_probs_by_top_p(probs, [0, 1], ["a", "b"], cfgs[:2])
    sampler.batch_sample_tokens_with_prob_before_top_p(probs, [0, 1], ["a", "b"], cfgs[:2],
                                                       [RandomGenerator(0), RandomGenerator(1)])
    assert torch.equal(before[0], probs) and torch.equal(before[1], q)
    assert torch.equal(sampler.batch_renormalize_probs_by_top_p(probs, [], [], []), probs)
    assert sampler.batch_sample_tokens_with_prob_before_top_p(probs, [], [], [], []) == []
    assert sampler.batch_verify_draft_tokens_with_prob_after_top_p(
        probs[:0], [], [0], [], [], [], [], probs[:0]) == ([], [])


def test_full_validation_checks_the_probability_values():
    probs = torch.full((3, 4), 0.25)
    probs[1, 2] = float("nan")
    sampler = Sampler.create_cpu_sampler()
    cfgs, rngs = [GenerationConfig()] * 2, [RandomGenerator(0), RandomGenerator(1)]
    sampler.batch_sample_tokens_with_prob_before_top_p(probs, [0, 2], ["a", "b"], cfgs, rngs, validate="full")
    for method in SAMPLE_METHODS:
        with pytest.raises(ValidationError, match=r"probs: expected finite probabilities, got nan .*\(request 1\)"):
            getattr(sampler, method)(probs, [0, 1], ["a", "b"], cfgs, rngs, validate="full")
    q = probs.clone()
    q[1] = -1.0
    with pytest.raises(ValidationError, match=r"draft_probs: expected probabilities >= 0.*\(request 0\)"):
        sampler.batch_verify_draft_tokens_with_prob_after_top_p(
            probs.fill_(0.25), ["a"], [0, 3], cfgs[:1], rngs[:1], [[SampleResult((1, 0.1))] * 2], [-1, 0, 1], q,
            validate="full")


def test_renormalize_returns_every_row_as_mlcs_engine_reads_it():
    # the rows of the samples only were returned: MLC's EAGLE and Medusa verification (sample_indices = one row per
    # request, then every draft node's row read by the verification) failed on a row count
    from specsampler.mlc import SampleResult

    torch.manual_seed(0)
    V = 5
    probs, q = torch.softmax(torch.randn(6, V), -1), torch.softmax(torch.randn(6, V), -1)
    cfgs, ids = [GenerationConfig(top_p=0.9)] * 2, ["r0", "r1"]
    drafts = [[SampleResult((1, 0.2)), SampleResult((2, 0.2))], [SampleResult((3, 0.2)), SampleResult((0, 0.2))]]
    for sampler in (Sampler.create_cpu_sampler(), Sampler.create_gpu_sampler(64, V, "cpu")):
        renorm = sampler.batch_renormalize_probs_by_top_p(probs, [0, 1], ids, cfgs)
        assert renorm.shape == probs.shape and torch.equal(renorm[2:], probs[2:])
        torch.testing.assert_close(renorm[:2], ss.top_p_renorm(probs[:2], 0.9))
        results, _ = sampler.batch_verify_draft_tokens_with_prob_after_top_p(
            renorm, ids, [0, 3, 6], cfgs, [RandomGenerator(1), RandomGenerator(2)], drafts, [-1, 0, 1, -1, 0, 1], q)
        assert len(results) == 2 and all(0 <= s.get_token_id() < V for r in results for s in r)
    with pytest.raises(ValueError, match=r"generation_cfg\[1\]: expected the config of the other samples of row 0"):
        Sampler.create_cpu_sampler().batch_renormalize_probs_by_top_p(
            probs, [0, 0], ids, [GenerationConfig(top_p=0.9), GenerationConfig(top_p=0.5)])
