"""The plain per-request loops of specsampler.verify.reference give the same tokens as the vectorised walks
and as the kernels (interpreter), on the same Philox streams: three readings of one algorithm agree."""

import pytest
import torch

import specsampler as ss
from specsampler.verify import reference

CHAIN_METHODS = ["token", "block", "target_only", "greedy"]
TREE_CASES = [(m, s) for m in ("rrs", "traversal") for s in ("iid", "without_replacement")] + [
    ("target_only", "iid"), ("greedy", "iid")]


def _dist(*shape, sharp=2.0, gen=None):
    return torch.softmax(sharp * torch.randn(*shape, generator=gen), -1)


def chain_case(seed, B=6, K=4, V=7):
    g = torch.Generator().manual_seed(seed)
    q = _dist(B, K, V, gen=g)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    drafts[0, 1] = V + 3  # out of range: never accepted
    p = 0.5 * _dist(B, K + 1, V, gen=g) + 0.5 * torch.nn.functional.pad(q, (0, 0, 0, 1), value=1 / V)
    num_drafts = torch.randint(0, K + 1, (B,), generator=g)
    num_drafts[1] = K
    return p, drafts, q, num_drafts


def tree_case(seed, B=5, V=6):
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 4], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, -1, -1, -1, -1],
                            [-1, 0, 0, 1, 1, 3, 3, 6], [-1, 0, 1, 1, 0, 4, 2, 2]])[:B]
    tree = ss.TokenTree.from_parents(parents)
    N = parents.shape[1]
    q = _dist(B, N, V, gen=g)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, N)
    drafts[min(3, B - 1), 2] = -4  # out of range: never accepted
    p = 0.5 * _dist(B, N, V, gen=g) + 0.5 * q[:, torch.tensor([1] * N)]
    return p, drafts, tree, q


def _chain_res(p, drafts, q, num_drafts, method, rng):
    res = ss.verify_chain(p, drafts, None if method in ("target_only", "greedy") else q, num_drafts=num_drafts,
                          method=method, rng=rng)
    return res.tokens.long(), res.num_accepted.long()


def _tree_res(p, drafts, tree, q, method, sampling, rng):
    res = ss.verify_tree(p, drafts, tree, q if method in ("rrs", "traversal") else None, method=method,
                         draft_sampling=sampling, rng=rng)
    return res.path.long(), res.tokens.long(), res.num_accepted.long()


@pytest.mark.parametrize("method", CHAIN_METHODS)
def test_chain_reference_loop_equals_the_vectorised_walk(method):
    for seed in range(12):
        p, drafts, q, num_drafts = chain_case(seed)
        rng = ss.Philox(torch.arange(p.shape[0]) * 7 + seed, offset=3)
        want = reference.verify_chain(p, drafts, q, num_drafts=num_drafts, method=method, rng=rng)
        got = _chain_res(p, drafts, q, num_drafts, method, rng)
        for w, g_ in zip(want, got):
            assert torch.equal(w, g_), (method, seed)


@pytest.mark.parametrize("method, sampling", TREE_CASES)
def test_tree_reference_loop_equals_the_vectorised_walk(method, sampling):
    for seed in range(12):
        p, drafts, tree, q = tree_case(seed)
        rng = ss.Philox(torch.arange(p.shape[0]) + 100 * seed)
        want = reference.verify_tree(p, drafts, tree, q, method=method, draft_sampling=sampling, rng=rng)
        got = _tree_res(p, drafts, tree, q, method, sampling, rng)
        for w, g_ in zip(want, got):
            assert torch.equal(w, g_), (method, sampling, seed)


@pytest.mark.parametrize("method, sampling", TREE_CASES[:4])
def test_a_few_requests_walked_by_their_loops_equal_the_batched_walk_whatever_the_values(method, sampling, monkeypatch):
    """verify_tree walks rrs and traversal of up to LOOPED_BATCH_PROBS requests on the CPU by the plain loops: the
    batched walk's paths and tokens on unnormalised rows, NaN, inf, negative and zero entries, drafts out of range
    and absent nodes."""
    from specsampler.verify import tree as tree_module

    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        B, V = int(torch.randint(1, tree_module.LOOPED_BATCH_PROBS + 1, (1,), generator=g)), 6
        p, drafts, tree, q = tree_case(seed, B, V)
        for rows in (p, q):
            m = torch.rand(rows.shape, generator=g) < 0.2
            rows.copy_({0: rows * 3, 1: rows.masked_fill(m, float("nan")), 2: rows.masked_fill(m, -0.3),
                        3: rows.masked_fill(m, float("inf")), 4: rows.masked_fill(m, 0.0)}[seed % 5])
        drafts[0, -1] = V + 1
        rng = ss.Philox(torch.arange(B) + seed)
        looped = _tree_res(p, drafts, tree, q, method, sampling, rng)
        monkeypatch.setattr(tree_module, "LOOPED_BATCH_PROBS", 0)
        batched = _tree_res(p, drafts, tree, q, method, sampling, rng)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(looped, batched)), (method, sampling, seed)


@pytest.mark.parametrize("method, sampling", TREE_CASES[:4])
def test_wide_rows_walked_by_the_loops_beyond_a_few_requests_equal_the_batched_walk(method, sampling, monkeypatch):
    """Over wide rows verify_tree walks more requests by the plain loops (the batched walks' passes grow with V): the
    batched walk's paths and tokens."""
    from specsampler.verify import tree as tree_module

    B, V = 8, 8192
    assert B > tree_module.LOOPED_BATCH_PROBS and tree_module._looped(method, B, V)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        p, drafts, tree, q = tree_case(seed, 5, V)
        p, drafts, q = p.repeat(2, 1, 1)[:B], drafts.repeat(2, 1)[:B], q.repeat(2, 1, 1)[:B]
        p = p + 0.1 * torch.rand(p.shape, generator=g)  # unnormalised rows, the requests no longer alike
        tree = ss.TokenTree.from_parents(tree.parents.repeat(2, 1)[:B])
        rng = ss.Philox(torch.arange(B) + seed)
        looped = _tree_res(p, drafts, tree, q, method, sampling, rng)
        monkeypatch.setattr(tree_module, "_looped", lambda *args: False)
        batched = _tree_res(p, drafts, tree, q, method, sampling, rng)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(looped, batched)), (method, sampling, seed)


def test_reference_loops_equal_the_kernels(monkeypatch):
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    p, drafts, q, num_drafts = chain_case(5)
    rng = ss.Philox(torch.arange(p.shape[0]))
    for method in CHAIN_METHODS:
        want = reference.verify_chain(p, drafts, q, num_drafts=num_drafts, method=method, rng=rng)
        assert all(torch.equal(w, g) for w, g in zip(want, _chain_res(p, drafts, q, num_drafts, method, rng))), method
    p, drafts, tree, q = tree_case(3)
    rng = ss.Philox(torch.arange(p.shape[0]))
    for method, sampling in TREE_CASES:
        want = reference.verify_tree(p, drafts, tree, q, method=method, draft_sampling=sampling, rng=rng)
        got = _tree_res(p, drafts, tree, q, method, sampling, rng)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), (method, sampling)


def _outputs(res):
    return res.tokens, res.num_accepted, res.expected_accepted


@pytest.mark.parametrize("method", ["token", "block"])
def test_a_lone_request_chain_walked_by_its_loop_equals_the_batched_walk(method, monkeypatch):
    """The generation loop's entry walks a lone request's token or block chain by its plain loop on the CPU: the
    batched walk's tokens and counts, for every number of drafts, top-p and plain rows, short and long rows, rows
    without mass and odd logits."""
    from specsampler.params import SamplingParams
    from specsampler.sampling.ops import _small_constants
    from specsampler.verify import chain as chain_module

    assert chain_module.LOOPED_BATCH >= 1
    seen = set()
    for seed in range(48):
        g = torch.Generator().manual_seed(seed)
        K, V = 4, (64, 256, 1500)[seed % 3]
        params = SamplingParams(temperature=0.9, top_p=(1.0, 0.8)[seed % 2])
        q = _dist(1, K, V, sharp=3.0, gen=g)
        drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(1, K)
        logits = torch.log(0.7 * q + 0.3 * _dist(1, K, V, gen=g)) * 1.1
        logits = torch.cat([logits, torch.randn(1, 1, V, generator=g)], 1)
        row = int(torch.randint(0, K + 1, (1,), generator=g))
        if seed % 4 == 1:  # rows a model's odd logits make: without mass, NaN, inf; a draft row without mass
            logits[0, row] = float("-inf")
        elif seed % 4 == 2:
            logits[0, row, ::3] = float("nan")
        elif seed % 4 == 3:
            if seed % 8 == 3:
                logits[0, row] = float("inf")
            q[0, min(row, K - 1)] = 0.0
        num = torch.tensor([seed % (K + 1)])
        usable = torch.arange(K)[None] < num[:, None]
        rp = params.rows("t", 1, K + 1, torch.device("cpu"), False)
        u = {s: torch.rand(1, K + 1, generator=g) for s in (ss.rng.STREAM_SAMPLE, ss.rng.STREAM_ACCEPT)}
        args = (logits, drafts, q, num, usable, method, params, rp, None, lambda s, n, u=u: u[s][:, :n],
                _small_constants(rp, V))
        looped = _outputs(chain_module._verify_chain_prepared(*args))
        monkeypatch.setattr(chain_module, "LOOPED_BATCH", 0)
        batched = _outputs(chain_module._verify_chain_prepared(*args))
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(looped, batched)), (method, seed)
        seen.add(int(looped[1]) == int(num))
    assert seen == {True, False}  # chains accepted whole and chains stopped by a rejection
