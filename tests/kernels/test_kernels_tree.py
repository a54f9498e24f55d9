"""The Triton tree-verification kernels against the PyTorch reference (:func:`specsampler.verify_tree`).

Without CUDA the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1). Both
sides draw on the same streams: Philox (in the kernel, or precomputed at the documented
counters) and a torch.Generator (its uniforms precomputed in the order the reference draws
them). Paths, accepted counts and tokens must be identical: a difference could only come from
float rounding (the kernels sum blocks in another order), where a uniform falls within
rounding of a boundary, which these few thousand draws do not hit, or where two rows are equal
in exact arithmetic (a residual and a renormalised q), which the random inputs avoid.
"""

import pytest
import torch
from kernelcheck import DEVICE, assert_traversal_slots_outcome, traversal_slots_case

import specsampler as ss
from specsampler import TokenTree
from specsampler.rng import STREAM_ACCEPT, STREAM_SAMPLE, uniform

pytest.importorskip("triton")
from specsampler.kernels.tree import verify_tree as tree_kernel  # noqa: E402

WALKS = [("greedy", "iid"), ("target_only", "iid"), ("rrs", "iid"), ("rrs", "without_replacement"),
         ("traversal", "iid"), ("traversal", "without_replacement")]
SAMPLED = ("rrs", "traversal")


def _parents(kind: str, N: int, gen: torch.Generator) -> list[int]:
    """One request's parents: a chain, a star, a random tree, a deep one or a bushy one (2 or 3
    children per node), with absent nodes anywhere after the root (a random tree's) or at the
    end (the others')."""
    rand = lambda: float(torch.rand((), generator=gen))
    size = int(torch.randint(1, N + 1, (), generator=gen))
    fan = 2 + int(rand() < 0.5)
    parents = [-1]
    for i in range(1, N):
        present = [v for v in range(i) if v == 0 or parents[v] >= 0]
        if kind == "chain":
            parents.append(i - 1 if i < size else -1)
        elif kind == "star":
            parents.append(0 if i < size else -1)
        elif kind == "bushy":
            parents.append((i - 1) // fan if i < size else -1)
        elif kind == "deep":
            parents.append(present[-1] if rand() < 0.7 else present[int(rand() * len(present))])
        else:
            parents.append(-1 if rand() < 0.2 else present[int(rand() * len(present))])
    return parents


def _distributions(B: int, N: int, V: int, gen: torch.Generator, zeros: bool) -> torch.Tensor:
    """float32 ``[B, N, V]``: rows from flat to peaked, some with exact zeros if asked."""
    temp = torch.tensor([0.3, 2.0, 6.0])[torch.randint(0, 3, (B, 1, 1), generator=gen)]
    w = torch.softmax(torch.randn(B, N, V, generator=gen) * temp, -1)
    sparse = (torch.rand(B, N, 1, generator=gen) < 0.3) & zeros
    w = torch.where(sparse & (w < w.amax(-1, keepdim=True) * 0.2), 0.0, w)
    return w / w.sum(-1, keepdim=True)


def _case(method: str, sampling: str, B: int, N: int, V: int, seed: int, mixes=(0.0, 0.3, 0.6, 0.9, 1.0)):
    """Random inputs ``(p, x, q, tree)``: mixed tree shapes, drafts often the target's likely
    tokens (so that long paths occur), duplicate sibling tokens, out-of-range tokens; draft
    rows ``mix * target + (1 - mix) * other`` per request, ``mix`` from ``mixes`` (1: residuals
    without mass), shared by siblings without replacement."""
    gen = torch.Generator().manual_seed(seed)
    kinds = ["chain", "star", "random", "deep", "bushy"]
    tree = TokenTree.from_parents(torch.tensor([_parents(kinds[(b + seed) % 5], N, gen) for b in range(B)]))
    par = tree.parents.clamp(min=0)
    p = _distributions(B, N, V, gen, zeros=True)
    p_parent = p.gather(1, par[..., None].expand(B, N, V))
    mix = torch.tensor(mixes)[torch.randint(0, len(mixes), (B, 1, 1), generator=gen)]
    # the other part without zeros: no residual comes out proportional to q by construction
    q = mix * p_parent + (1 - mix) * _distributions(B, N, V, gen, zeros=False)
    if sampling == "without_replacement":  # every child holds its parent's first child's q
        first = tree.first_child.gather(1, par).clamp(min=0)
        q = q.gather(1, first[..., None].expand(B, N, V))
    from_p = torch.multinomial(p_parent.reshape(-1, V), 1, generator=gen).view(B, N)
    from_q = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, N)
    x = torch.where(torch.rand(B, N, generator=gen) < 0.5, from_p, from_q)
    # duplicates: a node takes its previous sibling's token
    prev = torch.full((B, N), -1)
    for b in range(B):
        for v in range(N):
            c, last = int(tree.first_child[b, v]), -1
            while c >= 0:
                prev[b, c], last, c = last, c, int(tree.next_sibling[b, c])
    dup = (prev >= 0) & (torch.rand(B, N, generator=gen) < 0.15)
    x = torch.where(dup, x.gather(1, prev.clamp(min=0)), x)
    bad = torch.tensor([-1, V, V + 5, -7])[torch.randint(0, 4, (B, N), generator=gen)]
    x = torch.where(torch.rand(B, N, generator=gen) < 0.07, bad, x)
    return p.to(DEVICE), x.to(DEVICE), (q.to(DEVICE) if method in SAMPLED else None), tree.to(DEVICE)


def _uniforms(method: str, rng, B: int, N: int):
    """``(u_accept, u_sample)`` as the reference draws them, in its order (accept first)."""
    ua = uniform(rng, "test", B, N, STREAM_ACCEPT, DEVICE) if method in SAMPLED else None
    us = uniform(rng, "test", B, N, STREAM_SAMPLE, DEVICE) if method != "greedy" else None
    return ua, us


def _run(p, x, tree, q, method, sampling, block_v=None, **randomness):
    return tree_kernel(p, x, tree.first_child, tree.next_sibling, q, method, sampling, tree.max_depth,
                       block_v=block_v, **randomness)


def _assert_same(kernel, ref, what):
    """The kernel's outputs are the reference's: path, count, y, and the emitted tokens and last node it also
    assembles (as the PyTorch walks' results are assembled)."""
    path, n, y, tokens, last = kernel
    assert torch.equal(path, ref.path), what
    assert torch.equal(n, ref.num_accepted), what
    assert torch.equal(y, ref.tokens.gather(1, ref.num_accepted[:, None])[:, 0]), what
    assert torch.equal(tokens, ref.tokens) and torch.equal(last, ref.last_node), what


@pytest.mark.parametrize("method, sampling", WALKS)
def test_kernel_walks_equal_the_reference_on_random_trees(method, sampling):
    """Random trees and values, V from 3 to 200 in blocks of 32 (mostly small V, where
    rejections, removals and residuals change the most); uniforms from a torch.Generator
    (drawn as the reference draws them) and from Philox streams; empty, partial and full-depth
    paths all occur."""
    lengths = set()
    for case, V in enumerate([3, 4, 5, 6, 3, 8, 4, 12, 29, 50, 200, 5]):
        B, N = 8, 10
        p, x, q, tree = _case(method, sampling, B, N, V, seed=case + 100 * len(method + sampling))
        if case % 2:
            keys = torch.Generator().manual_seed(case)
            rng = ss.Philox(torch.randint(-(2**40), 2**40, (B,), generator=keys).to(DEVICE),
                            torch.randint(0, 2**35, (B,), generator=keys).to(DEVICE))
            ua, us = _uniforms(method, rng, B, N)
        else:
            ua, us = _uniforms(method, torch.Generator().manual_seed(case), B, N)
            rng = torch.Generator().manual_seed(case)
        ref = ss.verify_tree(p, x, tree, q, method=method, draft_sampling=sampling, rng=rng)
        got = _run(p, x, tree, q, method, sampling, block_v=32, u_accept=ua, u_sample=us)
        _assert_same(got, ref, f"{method}/{sampling} case {case}")
        depth = tree.depth.amax(1)
        lengths |= {"none" if n == 0 else "all" if n == d else "some" for n, d in zip(got[1].tolist(), depth.tolist())}
    assert lengths == {"none", "some", "all"}, lengths


@pytest.mark.parametrize("method, sampling", [w for w in WALKS if w[0] != "greedy"])
def test_in_kernel_philox_draws_the_reference_streams(method, sampling):
    """Per-request seeds (negative, beyond 32 bits) and offsets (beyond 32 bits), uniforms
    computed in the kernel at (stream, node); default block size."""
    B, N, V = 8, 9, 6
    p, x, q, tree = _case(method, sampling, B, N, V, seed=3, mixes=(0.0, 0.3))  # many rejections
    seed = torch.tensor([0, 1, -5, 2**40 + 3, -(2**50), 77, 2**63 - 1, -(2**63)], device=DEVICE)
    offset = torch.tensor([0, 2**33 + 1, 5, 9, 2**32, 1, 2**62, 3], device=DEVICE)
    ref = ss.verify_tree(p, x, tree, q, method=method, draft_sampling=sampling, rng=ss.Philox(seed, offset))
    _assert_same(_run(p, x, tree, q, method, sampling, seed=seed, offset=offset), ref, f"{method}/{sampling}")


@pytest.mark.parametrize("method, sampling", [w for w in WALKS if w[0] != "greedy"])
def test_in_kernel_philox_uses_the_counter_of_each_node(method, sampling):
    """A star with uniform rows whose children are accepted with probability 1/4 to 1/2 (iid
    drafts one-hot at their tokens; without replacement the shared q is [.5, .5, 0, 0]): which
    child is accepted, and every token, hang on the uniforms at the nodes' counters."""
    B, V = 16, 4
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 0]] * B)).to(DEVICE)
    p = torch.full((B, 4, V), 0.25, device=DEVICE)
    x = torch.tensor([[0, 0, 1, 2]], device=DEVICE).expand(B, 4).contiguous()
    q = torch.eye(V)[[0, 0, 1, 2]]
    if sampling == "without_replacement":
        q = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).expand(4, V)
    q = q.expand(B, 4, V).contiguous().to(DEVICE) if method in SAMPLED else None
    seed = torch.randint(-(2**62), 2**62, (B,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    offset = torch.arange(B, device=DEVICE) * (2**31 + 7)
    ref = ss.verify_tree(p, x, tree, q, method=method, draft_sampling=sampling, rng=ss.Philox(seed, offset))
    got = _run(p, x, tree, q, method, sampling, seed=seed, offset=offset)
    _assert_same(got, ref, f"{method}/{sampling}")
    assert len(set(zip(got[1].tolist(), got[2].tolist()))) >= 4  # the outcomes vary


def _siblings(first: int, ns: list[int]) -> list[int]:
    """A child list, in sibling order."""
    out = []
    while first >= 0:
        out.append(first)
        first = ns[first]
    return out


def _preorder(fc: list[int], ns: list[int]) -> list[int]:
    """Present nodes in depth-first order (the order traversal tests leaves in)."""
    order, todo = [], [0]
    while todo:
        v = todo.pop()
        order.append(v)
        todo += _siblings(fc[v], ns)[::-1]
    return order


def _unread(tree: TokenTree, b: int, path: list[int], method: str, sampling: str) -> tuple[set[int], set[int]]:
    """Nodes of request b whose target rows, and whose draft rows, a walk along ``path`` never needs."""
    fc, ns = tree.first_child[b].tolist(), tree.next_sibling[b].tolist()
    N = len(fc)
    if method == "traversal":  # leaves off the path, and every node after the last node's subtree
        order = _preorder(fc, ns)
        last, depth = order.index(path[-1]), tree.depth[b].tolist()
        end = next((i for i in range(last + 1, len(order)) if depth[order[i]] <= depth[path[-1]]), len(order))
        later = set(order[end:]) | (set(range(N)) - set(order))
        leaves = {v for v in order if fc[v] < 0 and v not in path}
        return leaves | later, later | {0}
    target = set(range(N)) - set(path)
    if method != "rrs":
        return target, set()
    tested = set()
    for v, nxt in zip(path, path[1:] + [None]):
        for c in _siblings(fc[v], ns):
            tested.add(c)
            if c == nxt or sampling == "without_replacement":
                break
    return target, set(range(N)) - tested


@pytest.mark.parametrize("method, sampling", WALKS)
def test_rows_off_the_walk_are_never_read(method, sampling):
    """Rows a walk does not need are NaN-poisoned: identical results (the kernel never loads
    them; the reference, which reads rows of whole steps, agrees on what a walk needs)."""
    B, N, V = 6, 9, 20
    p, x, q, tree = _case(method, sampling, B, N, V, seed=5)
    ua, us = _uniforms(method, torch.Generator().manual_seed(1), B, N)
    path, n, y, *assembled = _run(p, x, tree, q, method, sampling, u_accept=ua, u_sample=us)
    p_bad, q_bad = p.clone(), None if q is None else q.clone()
    poisoned = 0
    for b in range(B):
        rows_p, rows_q = _unread(tree, b, path[b, : int(n[b]) + 1].tolist(), method, sampling)
        p_bad[b, list(rows_p)] = float("nan")
        if q_bad is not None:
            q_bad[b, list(rows_q)] = float("nan")
        poisoned += len(rows_p)
    again = _run(p_bad, x, tree, q_bad, method, sampling, u_accept=ua, u_sample=us)
    assert all(torch.equal(a, b) for a, b in zip(again, (path, n, y)))
    assert poisoned > B  # the test poisons something
    ref = ss.verify_tree(p_bad, x, tree, q_bad, method=method, draft_sampling=sampling,
                         rng=torch.Generator().manual_seed(1))
    _assert_same((path, n, y, *assembled), ref, "reference on the poisoned rows")


@pytest.mark.parametrize("sampling", ["iid", "without_replacement"])
@pytest.mark.parametrize("method", SAMPLED)
def test_residual_without_mass_keeps_the_previous_distribution(method, sampling):
    """Three children of the root, all rejected (a token out of range, then tokens r or Mb gives
    0): the residual is [0, 0, .5, .5] after the first two (updated twice, the second time
    into the spare row) and without mass after the third, so the draw keeps [0, 0, .5, .5].
    Dyadic values keep every step exact (a stays 1)."""
    B, V = 16, 4
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 0]] * B)).to(DEVICE)
    p = torch.tensor([0.125, 0.125, 0.375, 0.375], device=DEVICE).expand(B, 4, V).contiguous()
    q = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 2 + [[0.0, 0.5, 0.25, 0.25], [0.0, 0.0, 0.5, 0.5]], device=DEVICE)
    q = q.expand(B, 4, V).contiguous()
    if sampling == "without_replacement":
        q = q[:, [1, 1, 1, 1]].contiguous()  # the first child's q, shared
    x = torch.tensor([[0, -1, 1, 1]], device=DEVICE).expand(B, 4).contiguous()
    rng = ss.Philox(torch.arange(B, device=DEVICE))
    ua, us = _uniforms(method, rng, B, 4)
    got = _run(p, x, tree, q, method, sampling, u_accept=ua, u_sample=us)
    _assert_same(got, ss.verify_tree(p, x, tree, q, method=method, draft_sampling=sampling, rng=rng), method)
    assert (got[1] == 0).all() and ((got[2] == 2) | (got[2] == 3)).all()
    assert (got[2] == 2).any() and (got[2] == 3).any()


@pytest.mark.parametrize("sampling", ["iid", "without_replacement"])
def test_traversal_slots_keep_their_own_scratch_rows(sampling):
    """A node pushed into the slot of a deleted leaf whose Mb was swapped in from the spare row must
    not write over a row still in use (:func:`kernelcheck.traversal_slots_case`)."""
    B = 16
    tree, p, q, x = traversal_slots_case(sampling, B)
    rng = ss.Philox(torch.arange(B, device=DEVICE) + 1000)
    ua, us = _uniforms("traversal", rng, B, 7)
    got = _run(p, x, tree, q, "traversal", sampling, u_accept=ua, u_sample=us)
    _assert_same(got, ss.verify_tree(p, x, tree, q, method="traversal", draft_sampling=sampling, rng=rng), sampling)
    assert_traversal_slots_outcome(*got[:3])


@pytest.mark.parametrize("method, sampling", WALKS)
def test_root_only_trees_draw_from_the_root_row(method, sampling):
    """N = 1 (max_depth 0): the path is the root, the token is drawn from its row."""
    B, V = 4, 7
    tree = TokenTree.from_parents(torch.full((B, 1), -1)).to(DEVICE)
    p = torch.softmax(torch.randn(B, 1, V, generator=torch.Generator().manual_seed(2)), -1).to(DEVICE)
    x = torch.zeros(B, 1, dtype=torch.int64, device=DEVICE)
    q = p if method in SAMPLED else None
    rng = ss.Philox(torch.arange(B, device=DEVICE) + 9)
    ua, us = _uniforms(method, rng, B, 1)
    got = _run(p, x, tree, q, method, sampling, u_accept=ua, u_sample=us)
    assert got[0].shape == (B, 1) and (got[0] == 0).all() and (got[1] == 0).all()
    _assert_same(got, ss.verify_tree(p, x, tree, q, method=method, draft_sampling=sampling, rng=rng), method)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["target_only", "traversal"])
def test_half_precision_rows_are_read_as_float32(method, dtype):
    B, N, V = 8, 9, 6
    p, x, q, tree = _case(method, "iid", B, N, V, seed=6, mixes=(0.0, 0.6))
    p, q = p.to(dtype), None if q is None else q.to(dtype)
    rng = ss.Philox(torch.arange(B, device=DEVICE))
    ua, us = _uniforms(method, rng, B, N)
    got = _run(p, x, tree, q, method, "iid", u_accept=ua, u_sample=us)
    _assert_same(got, ss.verify_tree(p, x, tree, q, method=method, rng=rng), f"{method} {dtype}")


@pytest.mark.parametrize("method, sampling", WALKS)
def test_outputs_stay_in_range_on_nan_and_degenerate_rows(method, sampling):
    """NaN, all-zero and negative rows (which the reference does not promise to match): paths
    follow parent links through usable nodes, tokens stay in [0, V)."""
    B, N, V = 6, 7, 5
    p, x, q, tree = _case(method, sampling, B, N, V, seed=8)
    p[0], p[1], p[2, :, 1] = float("nan"), 0.0, -1.0
    if q is not None:
        q[3], q[4] = float("nan"), 0.0
    ua, us = _uniforms(method, ss.Philox(1), B, N)
    path, n, y, *_ = _run(p, x, tree, q, method, sampling, u_accept=ua, u_sample=us)
    assert ((y >= 0) & (y < V)).all()
    for b in range(B):
        walk = path[b, : int(n[b]) + 1].tolist()
        assert walk[0] == 0 and (path[b, int(n[b]) + 1 :] == -1).all()
        assert all(int(tree.parents[b, c]) == a for a, c in zip(walk, walk[1:]))
        assert all(0 <= int(x[b, c]) < V for c in walk[1:])


def test_launcher_rejects_missing_randomness_and_unknown_methods():
    p = torch.full((1, 1, 3), 1 / 3)
    links = torch.full((1, 1), -1)
    with pytest.raises(ValueError, match="method"):
        tree_kernel(p, links, links, links, None, "beam", "iid", 0, seed=1)
    with pytest.raises(ValueError, match="u_sample"):
        tree_kernel(p, links, links, links, p, "rrs", "iid", 0, u_sample=torch.rand(1, 1))
    with pytest.raises(ValueError, match="draft_probs"):
        tree_kernel(p, links, links, links, None, "traversal", "iid", 0, seed=1)
