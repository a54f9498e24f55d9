import pytest
import torch
from stats import assert_counts_match, assert_exact

import specsampler as ss
from conftest import mc_trials
from specsampler import SamplingParams as SP
from specsampler import TokenTree, oracle
from specsampler.verify.exactness import (
    Table,
    encode,
    encode_dist,
    random_model,
    shape_parents,
    tree_inputs,
    tree_monte_carlo,
)

SHAPES = [[2, 2], [3, 1], [1, 2, 1], [2, 2, 2]]
LOSSLESS = [("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid"),
            ("traversal", "without_replacement"), ("target_only", "top_k"), ("target_only", "iid"),
            ("greedy", "iid")]


@pytest.mark.montecarlo
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("method, drafting", LOSSLESS)
def test_verify_tree_matches_the_oracle_and_the_target(method, drafting, shape):
    V = 4 if len(shape) < 3 else 3
    mc = tree_monte_carlo(method, shape, V, mc_trials(200_000, 40_000), seed=sum(shape) + 17, draft_sampling=drafting,
                          zeros=len(shape) == 2)
    assert_exact(mc, f"{method}/{drafting} {shape}")


def _pad(p, x, q, parents, N):
    """Pad a batch of trees of n nodes to N nodes (absent nodes)."""
    T, n, V = p.shape
    pad = N - n
    p = torch.cat([p, torch.full((T, pad, V), 1.0 / V)], 1)
    q = torch.cat([q, torch.full((T, pad, V), 1.0 / V)], 1)
    x = torch.cat([x, torch.zeros(T, pad, dtype=torch.long)], 1)
    return p, x, q, parents + [-1] * pad


def _mirrored(shape):
    """Renumber a breadth-first tree so that every sibling list runs from high to low index:
    returns the new id of each old node, and child lists (old ids) in the original order."""
    parents = shape_parents(shape)
    kids = {v: [c for c in range(len(parents)) if parents[c] == v] for v in range(len(parents))}
    order, queue = [], [0]
    while queue:
        v = queue.pop(0)
        order.append(v)
        queue += kids[v][::-1]
    new_id = [0] * len(parents)
    for i, v in enumerate(order):
        new_id[v] = i
    return new_id, kids


@pytest.mark.montecarlo
@pytest.mark.parametrize("method, drafting", [("rrs", "without_replacement"), ("traversal", "iid"),
                                              ("rrs", "iid"), ("target_only", "top_k")])
def test_mixed_shapes_and_sgl_style_child_lists_in_one_batch_are_exact(method, drafting):
    """Half the batch a [3, 1] tree, half a [1, 2] tree, given as first-child/next-sibling lists in
    drawing order over nodes numbered so that each sibling list runs from high to low index."""
    V, T, N = 4, mc_trials(200_000, 40_000) // 2, 7
    target, draft = random_model(V, 5), random_model(V, 6)
    P, Q = Table(target, V, 2), Table(draft, V, 1)
    gen = torch.Generator().manual_seed(1)
    ps, xs, qs, fcs, nss = [], [], [], [], []
    for shape in ([3, 1], [1, 2]):
        p, x, q, _ = tree_inputs(P, Q, shape, T, drafting, gen)
        new_id, kids = _mirrored(shape)
        n = len(new_id)
        perm = torch.tensor([new_id.index(i) for i in range(n)])  # old id at each new position
        p, x, q = _pad(p[:, perm], x[:, perm], q[:, perm], [], N)[:3]
        fc, ns = torch.full((T, N), -1), torch.full((T, N), -1)
        for v, ks in kids.items():
            if ks:
                fc[:, new_id[v]] = new_id[ks[0]]
                for a, b in zip(ks, ks[1:]):
                    ns[:, new_id[a]] = new_id[b]
        ps.append(p), xs.append(x), qs.append(q), fcs.append(fc), nss.append(ns)
    p, x, q = torch.cat(ps), torch.cat(xs), torch.cat(qs)
    tree = TokenTree.from_first_child_next_sibling(torch.cat(fcs), torch.cat(nss))
    assert (tree.sibling_rank[:T, 1:4] == torch.tensor([2, 1, 0])).all()  # link order is not index order
    sampled = method in ("rrs", "traversal")
    res = ss.verify_tree(p, x, tree, q if sampled else None, method=method,
                         draft_sampling="iid" if drafting == "top_k" else drafting, rng=ss.Philox(torch.arange(2 * T)))
    for half, shape in ((slice(0, T), [3, 1]), (slice(T, 2 * T), [1, 2])):
        exact = oracle.tree(target, draft, shape, method, V, draft_sampling=drafting)
        expected = encode_dist(exact.sequences, 3, V)
        codes = encode(res.tokens[half, :3], V)
        keys = sorted(set(expected) | set(codes.unique().tolist()))
        counts = torch.bincount(torch.searchsorted(torch.tensor(keys), codes), minlength=len(keys))
        assert_counts_match(counts.numpy(), [expected.get(k, 0.0) for k in keys], label=f"{method} {shape}")


# ----------------------------------------------------------------------------- chains as trees


def _chain_as_tree(p, x, q, n=None):
    """Chain inputs [B, K+1, V], [B, K], [B, K, V] as a chain-shaped tree of K+1 nodes."""
    B, K1, V = p.shape
    parents = torch.arange(-1, K1 - 1).expand(B, K1).clone()
    if n is not None:
        parents[torch.arange(K1) > n[:, None]] = -1
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), x], 1)
    draft = torch.cat([torch.zeros(B, 1, V), q], 1) if q is not None else None
    return p, tokens, TokenTree.from_parents(parents), draft


@pytest.mark.parametrize("chain_method, tree_method", [("token", "rrs"), ("block", "traversal"),
                                                       ("target_only", "target_only"), ("greedy", "greedy")])
def test_a_chain_shaped_tree_verifies_as_the_chain_method(chain_method, tree_method):
    torch.manual_seed(0)
    B, K, V = 300, 4, 6
    p = torch.softmax(torch.randn(B, K + 1, V) * 3, -1)
    q = torch.softmax(torch.randn(B, K, V), -1)
    # drafts agree with the (peaked) target often enough to walk deep
    x = torch.where(torch.rand(B, K) < 0.5, p[:, :K].argmax(-1), torch.multinomial(q.reshape(-1, V), 1).view(B, K))
    n = torch.randint(0, K + 1, (B,))
    sampled = chain_method in ("token", "block")
    rng = ss.Philox(torch.arange(B) * 3, 2)
    chain = ss.verify_chain(p, x, q if sampled else None, num_drafts=n, method=chain_method, rng=rng)
    tp, tx, tree, tq = _chain_as_tree(p, x, q if sampled else None, n)
    tree_res = ss.verify_tree(tp, tx, tree, tq, method=tree_method, rng=rng)
    assert torch.equal(tree_res.num_accepted, chain.num_accepted)
    assert torch.equal(tree_res.tokens[:, : K + 1], chain.tokens)
    assert torch.equal(tree_res.last_node, chain.num_accepted)
    assert (tree_res.num_accepted >= 2).sum() > 20  # walks deeper than one step happen
    if chain.expected_accepted is not None and tree_res.expected_accepted is not None:
        torch.testing.assert_close(tree_res.expected_accepted, chain.expected_accepted)


# ----------------------------------------------------------------------------- exact behaviour


def test_duplicate_siblings_the_first_in_sibling_order_wins():
    # root's children 1, 2, 3 all carry token 5; link order 3 -> 1 -> 2
    p = torch.zeros(1, 4, 8)
    p[0, :, 5] = 1.0
    x = torch.tensor([[0, 5, 5, 5]])
    by_index = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 0]]))
    by_links = TokenTree.from_first_child_next_sibling(torch.tensor([[3, -1, -1, -1]]), torch.tensor([[-1, 2, -1, 1]]))
    for method in ("greedy", "target_only"):
        assert ss.verify_tree(p, x, by_index, method=method, rng=ss.Philox(0)).path[0].tolist() == [0, 1]
        assert ss.verify_tree(p, x, by_links, method=method, rng=ss.Philox(0)).path[0].tolist() == [0, 3]
    res = ss.verify_tree(p, x, by_index, method="target_only")
    assert res.expected_accepted.item() == pytest.approx(1.0)  # the shadowed duplicates are never reached


def test_greedy_walks_the_argmax_path():
    torch.manual_seed(1)
    B, V = 50, 5
    tree = TokenTree.from_parents(torch.tensor([shape_parents([2, 2, 1])] * B))
    p = torch.softmax(torch.randn(B, tree.size, V) * 3, -1)
    x = torch.randint(0, V, (B, tree.size))
    res = ss.verify_tree(p, x, tree, method="greedy")
    for b in range(B):
        v, path = 0, [0]
        while True:
            y = int(p[b, v].argmax())
            kids = [c for c in range(tree.size) if int(tree.parents[b, c]) == v and int(x[b, c]) == y]
            if not kids:
                break
            v = kids[0]
            path.append(v)
        assert res.path[b, : len(path)].tolist() == path and res.num_accepted[b] == len(path) - 1
        assert res.tokens[b, len(path) - 1] == int(p[b, v].argmax())


def test_expected_accepted_of_a_deterministic_tree_is_the_sum_of_path_products():
    torch.manual_seed(2)
    parents = shape_parents([2, 2])
    tree = TokenTree.from_parents(torch.tensor([parents]))
    p = torch.softmax(torch.randn(1, 7, 9), -1)
    x = torch.tensor([[0, 1, 2, 3, 4, 5, 6]])
    expected = 0.0
    for v in range(1, 7):
        prod, u = 1.0, v
        while u != 0:
            prod *= float(p[0, parents[u], x[0, u]])
            u = parents[u]
        expected += prod
    res = ss.verify_tree(p, x, tree, method="target_only")
    assert res.expected_accepted.item() == pytest.approx(expected, rel=1e-5)
    logits = p.log()
    from_logits = ss.verify_tree_from_logits(logits, x, tree, method="target_only", expected_accepted=True)
    assert from_logits.expected_accepted.item() == pytest.approx(expected, rel=1e-4)
    assert ss.verify_tree_from_logits(logits, x, tree, method="target_only").expected_accepted is None


def test_a_request_verifies_the_same_whatever_its_neighbours():
    torch.manual_seed(3)
    B, N, V = 12, 7, 30
    trees = [shape_parents([2, 2]), shape_parents([3, 1])[:7], shape_parents([1, 1, 1]) + [-1, -1, -1]]
    parents = torch.tensor([trees[b % 3] for b in range(B)])
    tree = TokenTree.from_parents(parents)
    logits = torch.randn(B, N, V) * 2
    q = torch.softmax(torch.randn(B, N, V), -1)
    x = torch.randint(0, V, (B, N))
    params = SP(temperature=torch.rand(B) + 0.5, top_k=torch.randint(0, 10, (B,)), top_p=torch.rand(B) * 0.3 + 0.7)
    seed = torch.randint(0, 2**40, (B,))
    for method in ("target_only", "rrs", "traversal", "greedy"):
        qq = q if method in ("rrs", "traversal") else None
        for sampling in ("iid", "without_replacement"):
            full = ss.verify_tree_from_logits(logits, x, tree, params, draft_probs=qq, method=method,
                                              draft_sampling=sampling, rng=ss.Philox(seed))
            for b in (0, 4, 11):
                sub = SP(params.temperature[b : b + 1], params.top_k[b : b + 1], params.top_p[b : b + 1])
                one = TokenTree.from_parents(parents[b : b + 1])
                q1 = None if qq is None else qq[b : b + 1]
                alone = ss.verify_tree_from_logits(logits[b : b + 1], x[b : b + 1], one, sub, draft_probs=q1,
                                                   method=method, draft_sampling=sampling,
                                                   rng=ss.Philox(seed[b : b + 1]))
                D = alone.path.shape[1]
                assert alone.tokens[0].tolist() == full.tokens[b, :D].tolist(), (method, sampling, b)
                assert alone.path[0].tolist() == full.path[b, :D].tolist()


def _drafts_near_the_target(B: int, V: int, seed: int):
    """A tree of 10 nodes a request (parents ``[B, N]``), target logits ``[B, N, V]``, draft rows near the target's
    at each node's parent and drafts drawn from them (the residuals then move the mass among a row's top tokens)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([shape_parents([3, 2, 1])] * B)
    N = parents.shape[1]
    logits = torch.randn(B, N, V, generator=g) * 2
    at_parent = logits.gather(1, parents.clamp(min=0)[..., None].expand(B, N, V))
    q = torch.softmax(at_parent * 3 + torch.randn(B, N, V, generator=g), -1)
    x = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, N)
    return parents, logits, q, x


@pytest.mark.parametrize("method", ["rrs", "traversal"])
@pytest.mark.parametrize("sampling", ["iid", "without_replacement"])
def test_walks_holding_top_k_rows_by_their_candidates_equal_the_dense_walks(method, sampling, monkeypatch):
    # rows of top-k (and greedy) requests are held by their candidates, the draft rows read at them: the same
    # paths and tokens as over whole rows, with rejections, deletions, drafts out of range or off the candidates,
    # draft rows of zeros, a mask leaving fewer tokens than k, and rows without mass
    import specsampler.verify.walks as walks

    B, V = 10, 2048
    parents, logits, q, x = _drafts_near_the_target(B, V, 7)
    x[3, 2] = V + 5  # out of range: never accepted
    q[6, 1] = 0.0  # a draft row of zeros
    logits[4, :, 50:] = -float("inf")  # 50 tokens left, fewer than k = 64
    logits[5, 0] = -float("inf")  # a root without mass whose k = 40 candidates are NaN, none of them id 0
    logits[5, 0, 1000:1040] = float("nan")
    params = SP(temperature=torch.tensor([3.0, 2.7, 0.0, 3.3, 3.0, 3.0, 2.9, 3.0, 4.0, 3.0]),
                top_k=torch.tensor([64, 5, 0, 64, 64, 40, 1, 64, 64, 20]),
                top_p=torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0, 1.0, 1.0, 0.95, 1.0, 1.0]))
    seen = []
    held = walks.TargetRows.held
    monkeypatch.setattr(walks.TargetRows, "held", lambda self, b, node, width: seen.append(width)
                        or held(self, b, node, width))
    seeds = [torch.arange(B) * 7 + s for s in range(8)]

    def verify(seed, b=slice(None)):  # every request, or request 5 alone (its rows then keep only its 40)
        one = SP(*(getattr(params, f)[b] for f in ("temperature", "top_k", "top_p")))
        return ss.verify_tree_from_logits(logits[b], x[b], TokenTree.from_parents(parents[b]), one, draft_probs=q[b],
                                          method=method, draft_sampling=sampling, rng=ss.Philox(seed[b]))

    calls = [(seed, slice(None)) for seed in seeds] + [(seeds[0], slice(5, 6))]
    held_rows = [verify(*call) for call in calls]
    assert seen and set(seen) == {64, 40}
    monkeypatch.setattr(walks, "_few_candidates", lambda rp, V: 0)  # whole rows
    for call, out in zip(calls, held_rows):
        dense = verify(*call)
        for field in ("path", "tokens", "num_accepted", "last_node"):
            assert torch.equal(getattr(out, field), getattr(dense, field)), field
    accepted = torch.stack([out.num_accepted for out in held_rows[:-1]])
    assert accepted.max() > 1 and accepted.min() == 0
    assert held_rows[-1].tokens[0, 0] == 0  # a row without mass draws token 0, not its first candidate


@pytest.mark.parametrize("method", ["rrs", "traversal"])
@pytest.mark.parametrize("sampling", ["iid", "without_replacement"])
@pytest.mark.parametrize("rng_kind", ["philox", "generator"])
def test_top_k_requests_beside_top_p_ones_are_held_by_their_candidates_with_the_dense_walks_tokens(
        method, sampling, rng_kind, monkeypatch):
    # a batch mixing top-k and greedy requests (rows held by their candidates) with top-p ones and one
    # whose draft rows hold a negative value (whole rows): each group walked apart, on the whole batch's uniforms,
    # gives the tokens of the batch walked over whole rows; a generator is drawn from once per stream
    import specsampler.verify.tree as tree_module
    import specsampler.verify.walks as walks

    B, V = 8, 2048
    parents, logits, q, x = _drafts_near_the_target(B, V, 11)
    q[5, 2, 7] = -0.01  # a bad draft row: request 5 walks its whole rows
    params = SP(temperature=torch.tensor([3.0, 2.5, 0.0, 3.0, 2.0, 3.0, 3.0, 2.7]),
                top_k=torch.tensor([64, 0, 0, 20, 0, 64, 64, 5]),
                top_p=torch.tensor([1.0, 0.9, 1.0, 0.9, 0.95, 1.0, 1.0, 1.0]))
    seen = []
    held = walks.TargetRows.held
    monkeypatch.setattr(walks.TargetRows, "held", lambda self, b, node, width: seen.append(width)
                        or held(self, b, node, width))
    tree = TokenTree.from_parents(parents)

    def verify(seed):
        rng = ss.Philox(torch.arange(B) + seed) if rng_kind == "philox" else torch.Generator().manual_seed(seed)
        out = ss.verify_tree_from_logits(logits, x, tree, params, draft_probs=q, method=method,
                                         draft_sampling=sampling, rng=rng)
        return out, None if rng_kind == "philox" else torch.rand(3, generator=rng)

    apart = [verify(seed) for seed in range(6)]
    assert 64 in seen and 0 in seen  # both groups, each as it can be held
    monkeypatch.setattr(walks, "_few_candidates", lambda rp, V: 0)  # every request over whole rows, one walk
    monkeypatch.setattr(tree_module, "walk_held_apart", lambda walk, c, rows, rng, op: walk(c, rows, rng, op))
    for seed, (out, after) in enumerate(apart):
        dense, dense_after = verify(seed)
        for field in ("path", "tokens", "num_accepted", "last_node"):
            assert torch.equal(getattr(out, field), getattr(dense, field)), (seed, field)
        assert after is None or torch.equal(after, dense_after)
    assert torch.stack([out.num_accepted for out, _ in apart]).max() > 1


@pytest.mark.parametrize("method", ["target_only", "rrs", "greedy"])
def test_from_logits_reads_only_the_rows_on_the_walk(method):
    torch.manual_seed(4)
    B, V = 64, 12
    parents = torch.tensor([shape_parents([2, 2, 2])] * B)
    tree = TokenTree.from_parents(parents)
    N = tree.size
    logits = torch.randn(B, N, V)
    q = torch.softmax(torch.randn(B, N, V), -1)
    x = torch.randint(0, V, (B, N))
    qq = q if method == "rrs" else None
    params = SP(temperature=0.9, top_p=0.8)
    res = ss.verify_tree_from_logits(logits, x, tree, params, draft_probs=qq, method=method, rng=ss.Philox(7))
    on_path = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        on_path[b, res.path[b][res.path[b] >= 0]] = True
    poisoned = torch.where(on_path[..., None], logits, float("nan"))
    again = ss.verify_tree_from_logits(poisoned, x, tree, params, draft_probs=qq, method=method, rng=ss.Philox(7))
    assert torch.equal(again.tokens, res.tokens) and torch.equal(again.path, res.path)
    assert (~on_path).sum() > B * (N - 4)  # most rows were never read


def test_from_logits_equals_verify_tree_on_the_processed_probabilities():
    torch.manual_seed(5)
    B, V = 40, 50
    tree = TokenTree.from_parents(torch.tensor([shape_parents([2, 1, 1])] * B))
    N = tree.size
    logits = torch.randn(B, N, V) * 2
    mask = torch.rand(B, N, V) > 0.1
    params = SP(temperature=torch.rand(B) + 0.3, top_k=torch.randint(0, 20, (B,)), top_p=torch.rand(B) * 0.3 + 0.7)
    probs = ss.logits_to_probs(logits, params, mask)
    q = torch.softmax(torch.randn(B, N, V), -1)
    x = torch.where(torch.rand(B, N) < 0.5, probs.argmax(-1).gather(1, tree.parents.clamp(min=0)),
                    torch.randint(0, V, (B, N)))
    for method in ("target_only", "rrs", "traversal"):
        qq = q if method != "target_only" else None
        rng = ss.Philox(torch.arange(B), 3)
        a = ss.verify_tree_from_logits(logits, x, tree, params, draft_probs=qq, method=method, rng=rng, vocab_mask=mask)
        b = ss.verify_tree(probs, x, tree, qq, method=method, rng=rng)
        assert (a.tokens == b.tokens).all(1).float().mean() > 0.97, method
        assert torch.equal(a.num_accepted, b.num_accepted), method


def test_outputs_stay_in_range_on_nan_degenerate_and_out_of_vocabulary_inputs():
    B, V = 6, 5
    tree = TokenTree.from_parents(torch.tensor([shape_parents([2, 2])] * B))
    N = tree.size
    p = torch.softmax(torch.randn(B, N, V), -1)
    p[0] = float("nan")
    p[1] = 0.0
    p[2, 1] = -1.0
    q = torch.softmax(torch.randn(B, N, V), -1)
    q[3] = float("nan")
    q[4] = 0.0
    x = torch.randint(-3, V + 3, (B, N))
    for method in ("greedy", "target_only", "rrs", "traversal"):
        for sampling in ("iid", "without_replacement"):
            res = ss.verify_tree(p, x, tree, q if method in ("rrs", "traversal") else None, method=method,
                                 draft_sampling=sampling, rng=ss.Philox(1))
            assert ((res.tokens >= -1) & (res.tokens < V)).all(), method
            n = res.num_accepted
            assert (res.tokens.gather(1, n[:, None]) >= 0).all()
            # accepted nodes are real nodes with in-vocabulary tokens, linked parent to child
            for b in range(B):
                path = res.path[b, : int(n[b]) + 1].tolist()
                assert path[0] == 0 and all(int(tree.parents[b, c]) == a for a, c in zip(path, path[1:]))
                assert all(0 <= int(x[b, c]) < V for c in path[1:])


def test_rrs_residual_that_vanishes_does_not_crash():
    # target equal to the draft: the residual after a rejection is empty
    B, V = 200, 3
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 0]] * B))
    p = torch.tensor([0.5, 0.5, 0.0]).expand(B, 4, V).contiguous()
    x = torch.tensor([[0, 2, 2, 1]]).expand(B, 4)
    for sampling in ("iid", "without_replacement"):
        res = ss.verify_tree(p, x, tree, p, method="rrs", draft_sampling=sampling, rng=ss.Philox(torch.arange(B)))
        assert ((res.tokens[:, 0] >= 0) & (res.tokens[:, 0] < 2)).all()  # never the probability-0 token 2


def test_without_replacement_removes_rejected_tokens_from_the_shared_draft():
    # p puts everything on token 1; the first child (token 0) is rejected for sure.  With the shared q
    # renormalised without token 0, the second child (token 1) is accepted for sure: q'(1) = 1 <= p(1).
    B = 500
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * B))
    p = torch.tensor([0.0, 1.0, 0.0]).expand(B, 3, 3).contiguous()
    q = torch.tensor([0.5, 0.25, 0.25]).expand(B, 3, 3).contiguous()
    x = torch.tensor([[0, 0, 1]]).expand(B, 3)
    res = ss.verify_tree(p, x, tree, q, method="rrs", draft_sampling="without_replacement",
                         rng=ss.Philox(torch.arange(B)))
    assert (res.path[:, 1] == 2).all()


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(method="rrs", draft_probs=None), ["draft_probs", "a tensor [B, N, V] for method 'rrs'", "None"]),
        (dict(method="target_only"), ["draft_probs", "None for method 'target_only'"]),
        (dict(method="beam"), ["method", "'beam'"]),
        (dict(draft_sampling="random"), ["draft_sampling", "'random'", "iid"]),
        (dict(tree=TokenTree.from_parents(torch.tensor([[-1, 0, 0]]))), ["tree", "B = 2", "N = 4", "B = 1, N = 3"]),
        (dict(tree="tree"), ["tree", "TokenTree", "str"]),
        (dict(x=torch.zeros(2, 3, dtype=torch.long)), ["draft_tokens", "[B, N] = [2, 4]", "[2, 3]"]),
        (dict(q=torch.rand(2, 4, 6)), ["draft_probs", "[B, N, V] = [2, 4, 5]", "[2, 4, 6]"]),
        (dict(p=torch.rand(2, 4)), ["target_probs", "3 dimensions"]),
    ],
)
def test_bad_tree_inputs_are_named(kwargs, fragments):
    p = kwargs.pop("p", torch.full((2, 4, 5), 0.2))
    x = kwargs.pop("x", torch.zeros(2, 4, dtype=torch.long))
    q = kwargs.pop("q", torch.full((2, 4, 5), 0.2))
    tree = kwargs.pop("tree", TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]] * 2)))
    if "draft_probs" in kwargs:
        q = kwargs.pop("draft_probs")
    with pytest.raises(ValueError) as err:
        ss.verify_tree(p, x, tree, q, **kwargs)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_full_validation_of_tree_values_ignores_padding_rows():
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, -1]] * 2))
    p = torch.full((2, 4, 5), 0.2)
    p[:, 3] = float("nan")  # an absent node's row: padding
    q = p.clone()
    x = torch.tensor([[0, 1, 2, 0], [0, 1, 7, 0]])
    ss.verify_tree(p, x.clamp(max=4), tree, q, validate="full")
    with pytest.raises(ValueError, match=r"draft_tokens: expected token ids in \[0, 5\), got 7 .*request 1"):
        ss.verify_tree(p, x, tree, q, validate="full")
    p2 = p.clone()
    p2[0, 1, 2] = -0.5
    with pytest.raises(ValueError, match=r"target_probs: expected probabilities >= 0.*request 0"):
        ss.verify_tree(p2, x.clamp(max=4), tree, q, validate="full")


def test_inputs_are_not_modified():
    torch.manual_seed(6)
    B, V = 4, 7
    tree = TokenTree.from_parents(torch.tensor([shape_parents([2, 2])] * B))
    p = torch.softmax(torch.randn(B, 7, V), -1)
    q = torch.softmax(torch.randn(B, 7, V), -1)
    logits = torch.randn(B, 7, V)
    x = torch.randint(0, V, (B, 7))
    before = [t.clone() for t in (p, q, logits, x)]
    for method in ("rrs", "traversal"):
        for sampling in ("iid", "without_replacement"):
            ss.verify_tree(p, x, tree, q, method=method, draft_sampling=sampling)
            ss.verify_tree_from_logits(logits, x, tree, SP(top_p=0.9), draft_probs=q, method=method,
                                       draft_sampling=sampling)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, q, logits, x)))


@pytest.mark.parametrize("method", ["greedy", "target_only", "rrs", "traversal"])
def test_a_batch_of_no_requests_gives_int64_results_of_the_documented_shapes(method):
    # rrs and traversal walked their requests on the host and built the results from empty lists: float32 [0]
    V, N = 6, 4
    tree = ss.TokenTree.from_parents(torch.zeros(0, N, dtype=torch.long))
    p, x = torch.zeros(0, N, V), torch.zeros(0, N, dtype=torch.long)
    q = p if method in ("rrs", "traversal") else None
    for res in (ss.verify_tree(p, x, tree, q, method=method, rng=ss.Philox(1)),
                ss.verify_tree_from_logits(p, x, tree, draft_probs=q, method=method, rng=ss.Philox(1))):
        assert res.path.dtype == res.tokens.dtype == res.num_accepted.dtype == res.last_node.dtype == torch.int64
        assert res.path.shape == res.tokens.shape == (0, 1) and res.num_accepted.shape == res.last_node.shape == (0,)
