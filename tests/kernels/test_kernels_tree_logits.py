"""The tree-verification-from-logits kernel (run in the Triton interpreter without a GPU) against
specsampler.verify_tree_from_logits.

Both run on the same random streams (in-kernel Philox, or the uniforms a torch.Generator gives the
reference, in its order: target_only STREAM_SAMPLE; rrs and traversal STREAM_ACCEPT, then
STREAM_SAMPLE; greedy none), so paths, accepted counts and tokens must be identical. The kernel's
sums are taken in another order than torch's; over these cases no acceptance test or draw falls on a
float rounding tie, so no mismatch is allowed. Small ``chunk``/``cand`` configurations of the row
descriptors send rows through every path (kept tokens in registers, or passes over the whole row) on
small vocabularies.
"""

import os
from typing import NamedTuple

import pytest
import torch
from kernelcheck import (
    DEVICE,
    assert_traversal_slots_outcome,
    recorded_loads,
    row_reads,
    to_device,
    traversal_slots_case,
)

import specsampler as ss
from specsampler import SamplingParams as SP
from specsampler import TokenTree
from specsampler.rng import STREAM_ACCEPT, uniform

pytest.importorskip("triton")
from specsampler.kernels import sampling as ksampling  # noqa: E402
from specsampler.kernels import tree as ktree  # noqa: E402

WALKS = [("greedy", "iid"), ("target_only", "iid"), ("rrs", "iid"), ("rrs", "without_replacement"),
         ("traversal", "iid"), ("traversal", "without_replacement")]
SAMPLED = ("rrs", "traversal")
CONFIGS = [(8, 16), (16, 32), (4, 16)]  # (chunk, cand) of the row descriptors
CASES = {"greedy": 12, "target_only": 8}  # random cases per walk (6 for the others): the benchmarked walks get more


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    """The reference runs its PyTorch code whatever SPECSAMPLER_BACKEND says."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")


class Case(NamedTuple):
    logits: torch.Tensor  # [B, N, V]
    params: SP
    mask: torch.Tensor | None  # bool [B * N, V], contiguous
    x: torch.Tensor  # [B, N]
    q: torch.Tensor | None  # [B, N, V]
    tree: TokenTree


def _parents(g, N: int) -> list[int]:
    """One request's parents: a chain, a star, a deep or a bushy random tree; absent nodes at the end
    (chain, star) or anywhere after the root (random trees)."""
    style = int(torch.randint(0, 4, (1,), generator=g))
    size = int(torch.randint(1, N + 1, (1,), generator=g))
    parents = [-1]
    for i in range(1, N):
        present = [v for v in range(i) if v == 0 or parents[v] >= 0]
        r = float(torch.rand(1, generator=g))
        pick = present[int(torch.randint(0, len(present), (1,), generator=g))]
        if style == 0:
            parents.append(i - 1 if i < size else -1)
        elif style == 1:
            parents.append(0 if i < size else -1)
        elif r < 0.15:
            parents.append(-1)
        else:
            parents.append(present[-1] if style == 2 and r < 0.75 else pick)
    return parents


def _random_logits(g, shape, kind):
    if kind == "ties":  # integer-valued: exact ties, also at the argmax and the top-k / top-p cuts
        return torch.randint(-3, 3, shape, generator=g).float()
    if kind == "peaked":
        return torch.randn(shape, generator=g) + 10.0 * (torch.rand(shape, generator=g) < 0.03)
    return torch.randn(shape, generator=g) * float(torch.empty(1).uniform_(0.3, 5.0, generator=g))


def _random_params(g, B, V):
    """Per-request params mixing greedy, top-k, top-p, both, min-p, none and all (k out of range too)."""
    kind = torch.randint(0, 7, (B,), generator=g)
    temperature = torch.where(kind == 0, 0.0, torch.empty(B).uniform_(0.4, 2.0, generator=g))
    top_k = torch.randint(-1, V + 3, (B,), generator=g)
    small = torch.rand(B, generator=g) < 0.6  # k up to 14: kept tokens in registers with cand 16
    top_k = torch.where(small, torch.randint(1, 15, (B,), generator=g), top_k)
    top_k = torch.where((kind == 1) | (kind == 3) | (kind == 6), top_k.clamp(min=1), 0)
    top_p = torch.where((kind == 2) | (kind == 3) | (kind == 6), torch.empty(B).uniform_(0.1, 0.98, generator=g), 1.0)
    min_p = torch.where((kind == 4) | (kind == 6), torch.empty(B).uniform_(0.0, 0.3, generator=g), 0.0)
    return SP(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _children(tree: TokenTree, b: int, v: int) -> list[int]:
    out, c = [], int(tree.first_child[b, v])
    while c >= 0:
        out.append(c)
        c = int(tree.next_sibling[b, c])
    return out


def _case(g, method, sampling, B, N, V, kind, masked=True) -> Case:
    """Random inputs: drafts drawn from the processed parent row (target_only, greedy) or from q, a
    tilted processed parent row (rrs, traversal; without replacement shared by siblings); then at
    most nodes one child's token is planted as its parent's most likely token (so that long paths
    are accepted); duplicate sibling tokens, out-of-range tokens."""
    tree = TokenTree.from_parents(torch.tensor([_parents(g, N) for _ in range(B)]))
    logits = _random_logits(g, (B, N, V), kind)
    params = _random_params(g, B, V)
    mask = None
    if masked and bool(torch.rand(1, generator=g) < 0.6):
        mask = torch.rand(B, N, V, generator=g) < 0.8
        mask |= torch.arange(V) == torch.randint(0, V, (B, N, 1), generator=g)  # every row keeps a token
    p = ss.logits_to_probs(logits, params, mask)
    parent = tree.parents.clamp(min=0)
    p_parent = p.gather(1, parent[..., None].expand(B, N, V))
    q = None
    if method in SAMPLED:
        tilt = torch.rand(B, 1, 1, generator=g) * torch.where(torch.rand(B, 1, 1, generator=g) < 0.5, 2.0, 0.3)
        q = p_parent * torch.exp(tilt * torch.randn(B, N, V, generator=g))
        other = torch.softmax(torch.randn(B, N, V, generator=g), -1)  # drafts where p is 0
        q = 0.95 * q / q.sum(-1, keepdim=True).clamp(min=1e-30) + 0.05 * other
        if sampling == "without_replacement":  # every child holds its parent's first child's q
            first = tree.first_child.gather(1, parent).clamp(min=0)
            q = q.gather(1, first[..., None].expand(B, N, V))
        x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, N)
    else:
        x = torch.multinomial(p_parent.reshape(-1, V) + 1e-6, 1, generator=g).view(B, N)
    x = torch.where(torch.rand(B, N, generator=g) < 0.05, torch.randint(0, V, (B, N), generator=g), x)
    for b in range(B):
        for v in range(N):
            kids = _children(tree, b, v)
            for earlier, c in zip(kids, kids[1:]):
                if float(torch.rand(1, generator=g)) < 0.15:  # a sibling repeating an earlier one's token
                    x[b, c] = x[b, earlier]
            if kids and float(torch.rand(1, generator=g)) < 0.7:  # plant one child's token at the top
                c = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
                bump = float(torch.randint(1, 4, (1,), generator=g)) if kind == "ties" else float(
                    torch.empty(1).uniform_(0.5, 6.0, generator=g))
                logits[b, v, x[b, c]] = logits[b, v].max() + bump
                if mask is not None:
                    mask[b, v, x[b, c]] = True
    bad = torch.tensor([-1, V, V + 7, -9])[torch.randint(0, 4, (B, N), generator=g)]
    x = torch.where(torch.rand(B, N, generator=g) < 0.05, bad, x)
    flat = None if mask is None else mask.reshape(B * N, V).contiguous()
    return Case(logits, params, flat, x, q, tree)


def _reference(c: Case, method, sampling, rng):
    B, N, V = c.logits.shape
    mask = None if c.mask is None else c.mask.view(B, N, V)
    return ss.verify_tree_from_logits(c.logits, c.x, c.tree, c.params, draft_probs=c.q, method=method,
                                      draft_sampling=sampling, rng=rng, vocab_mask=mask)


def _row_params(params: SP, B: int, N: int) -> tuple:
    rp = params.rows("test", B, N, torch.device(DEVICE), False)
    return rp.temperature, rp.top_k, rp.top_p, rp.min_p


def _kernel(c: Case, method, sampling, rng, cfg=CONFIGS[0], block_v=32):
    """The kernel with rng a Philox (uniforms in the kernel), or a torch.Generator whose uniforms are
    drawn here as the reference draws them."""
    B, N, V = c.logits.shape
    seed = offset = u_accept = u_sample = None
    if isinstance(rng, ss.Philox):
        seed, offset = rng.keys("test", B, c.logits.device)
    else:
        u_accept = torch.rand(B, N, generator=rng, device=rng.device).to(DEVICE) if method in SAMPLED else None
        u_sample = torch.rand(B, N, generator=rng, device=rng.device).to(DEVICE) if method != "greedy" else None
    return ktree.verify_tree_from_logits(c.logits, c.x, c.tree.first_child, c.tree.next_sibling, c.q, method,
                                         sampling, c.tree.max_depth, *_row_params(c.params, B, N), c.mask, seed,
                                         offset, u_accept, u_sample, block_v=block_v, chunk=cfg[0], cand=cfg[1])


def _same(kernel, ref, label):
    path, n, y, tokens, last = kernel
    assert torch.equal(n, ref.num_accepted), f"{label}: num_accepted {n} != {ref.num_accepted}"
    assert torch.equal(path, ref.path), f"{label}: path\n{path}\n!= reference\n{ref.path}"
    ref_y = ref.tokens.gather(1, ref.num_accepted[:, None])[:, 0]
    assert torch.equal(y, ref_y), f"{label}: y {y} != reference {ref_y}"
    # what the kernel assembles as the PyTorch walks' results are assembled
    assert torch.equal(tokens, ref.tokens), f"{label}: tokens\n{tokens}\n!= reference\n{ref.tokens}"
    assert torch.equal(last, ref.last_node), f"{label}: last node {last} != reference {ref.last_node}"


@pytest.mark.parametrize("method, sampling", WALKS)
def test_kernel_walks_equal_the_reference_on_random_trees(method, sampling):
    """Random trees, per-request params and masks, V from 3 to 300, fp32/fp16/bf16 logits; uniforms
    from in-kernel Philox streams and from a torch.Generator; every path-length class occurs."""
    g = torch.Generator().manual_seed(WALKS.index((method, sampling)))
    lengths = set()
    for case in range(CASES.get(method, 6)):
        B, N = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 10, (1,), generator=g))
        V = (3, 5, 300, 40, 130, 17, 64, 257, 4, 100, 9, 200)[case]
        kind = ("peaked", "ties", "normal")[case % 3]
        c = _case(g, method, sampling, B, N, V, kind)
        if case % 3 == 1:
            c = c._replace(logits=c.logits.to((torch.float16, torch.bfloat16)[case % 2]))
        c = to_device(c)
        if case % 2:
            rng = ss.Philox(torch.randint(-(2**62), 2**62, (B,), generator=g).to(DEVICE),
                            torch.randint(0, 2**40, (B,), generator=g).to(DEVICE))
            ref, out_rng = _reference(c, method, sampling, rng), rng
        else:
            ref = _reference(c, method, sampling, torch.Generator().manual_seed(case))
            out_rng = torch.Generator().manual_seed(case)
        out = _kernel(c, method, sampling, out_rng, CONFIGS[case % 3], block_v=(32, 128, 64)[case % 3])
        _same(out, ref, f"{method}/{sampling} case {case} {kind} B={B} N={N} V={V} {c.logits.dtype} {c.params}")
        depth = c.tree.depth.amax(1)
        lengths |= {"none" if n == 0 else "all" if n == d else "some" for n, d in zip(ref.num_accepted.tolist(),
                                                                                       depth.tolist())}
    assert lengths == {"none", "some", "all"}, lengths


def test_target_only_draws_the_tokens_of_sample_from_logits():
    """At each node of the path the draw is sample_from_logits' token for that row with the node's
    uniform (its kernel with the same descriptor configuration, and its reference): the walk moves
    to the child carrying it and emits the last one."""
    g = torch.Generator().manual_seed(7)
    B, N, V = 4, 6, 150
    c = to_device(_case(g, "target_only", "iid", B, N, V, "peaked"))
    rng = ss.Philox(torch.tensor([11, -12, 2**40 + 13, 14], device=DEVICE),
                    torch.tensor([0, 5, 2**33, 2], device=DEVICE))
    cfg = CONFIGS[1]
    path, n, y, *_ = _kernel(c, "target_only", "iid", rng, cfg)
    rp = _row_params(c.params, B, N)
    mask = None if c.mask is None else c.mask.view(B, N, V)
    draws = ss.sample_from_logits(c.logits, c.params, rng, vocab_mask=mask).tokens
    index = torch.arange(N, device=DEVICE).repeat(B)  # a row's draw index is its node
    kernel_draws, _ = ksampling.sample_from_logits(c.logits.view(-1, V), *rp, c.mask, rng.seed.repeat_interleave(N),
                                                   rng.offset.repeat_interleave(N), index, chunk=cfg[0], cand=cfg[1])
    assert torch.equal(kernel_draws.view(B, N), draws)
    for b in range(B):
        walk = path[b, : int(n[b]) + 1].tolist()
        assert [int(c.x[b, v]) for v in walk[1:]] == [int(draws[b, v]) for v in walk[:-1]]
        assert int(y[b]) == int(draws[b, walk[-1]])
    assert int(n.max()) >= 2


def _preorder(tree: TokenTree, b: int) -> list[int]:
    order, todo = [], [0]
    while todo:
        v = todo.pop()
        order.append(v)
        todo += _children(tree, b, v)[::-1]
    return order


def _needed_rows(tree: TokenTree, b: int, walk: list[int], method: str, sampling: str) -> tuple[set, set]:
    """The target rows (logits and mask) and draft rows of request b that a walk ending with ``walk``
    needs; every other row must never be read."""
    last, kids = walk[-1], lambda v: _children(tree, b, v)
    if method == "traversal":  # the nodes pushed: depth-first order up to the end of the last node's subtree
        order, depth = _preorder(tree, b), tree.depth[b].tolist()
        i = order.index(last)
        end = next((j for j in range(i + 1, len(order)) if depth[order[j]] <= depth[last]), len(order))
        pushed = order[:end]
        target = {v for v in pushed if kids(v)} | {last}
        drafts = {kids(v)[0] for v in pushed if kids(v)} if sampling == "without_replacement" else set(pushed) - {0}
        return target, drafts
    drafts = set()
    if method == "rrs":
        for v, nxt in zip(walk, walk[1:] + [None]):
            tested = kids(v) if nxt is None else kids(v)[: kids(v).index(nxt) + 1]
            drafts |= set(tested[:1] if sampling == "without_replacement" else tested)
    return set(walk), drafts


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records loads in the Triton interpreter")
@pytest.mark.parametrize("method, sampling", WALKS)
def test_rows_the_walk_does_not_need_are_never_loaded(method, sampling, monkeypatch):
    """Every load the kernel makes is recorded: none falls in a logits, mask or draft row the walk does
    not need (target_only, greedy, rrs: off the path; rrs also draft rows of untested children;
    traversal: leaves off the path and nodes after the last node's subtree). Those rows NaN-poisoned,
    the results stay those of the reference. greedy reads each row of its path exactly once."""
    g = torch.Generator().manual_seed(40 + WALKS.index((method, sampling)))
    B, N, V = 4, 9, 70
    c = _case(g, method, sampling, B, N, V, "peaked", masked=False)
    c = c._replace(mask=torch.rand(B * N, V, generator=g) < 0.9)
    rng = ss.Philox(torch.randint(0, 2**62, (B,), generator=g), torch.zeros(B, dtype=torch.int64))
    first = path, n, *_ = _kernel(c, method, sampling, rng)
    needed = [_needed_rows(c.tree, b, path[b, : int(n[b]) + 1].tolist(), method, sampling) for b in range(B)]
    unneeded = torch.ones(B, N, dtype=torch.bool), torch.ones(B, N, dtype=torch.bool)
    for b, (target, drafts) in enumerate(needed):
        unneeded[0][b, list(target)] = False
        unneeded[1][b, list(drafts)] = False
    poisoned = c._replace(logits=c.logits.masked_fill(unneeded[0][..., None], float("nan")),
                          q=None if c.q is None else c.q.masked_fill(unneeded[1][..., None], float("nan")))
    with recorded_loads(monkeypatch) as loaded:
        out = _kernel(poisoned, method, sampling, rng)
    assert all(torch.equal(a, b) for a, b in zip(out, first))
    _same(out, _reference(poisoned, method, sampling, rng), f"{method}/{sampling}")
    assert unneeded[0].sum() > B and (c.q is None or unneeded[1].sum() > B)  # the test poisons something
    rows = (("target_logits", poisoned.logits, unneeded[0]), ("vocab_mask", poisoned.mask.view(B, N, V), unneeded[0]),
            ("draft_probs", poisoned.q, unneeded[1]))
    for name, t, off in rows:
        if t is None:
            continue
        reads = row_reads(loaded, t)
        assert not reads[off].any(), f"{method}/{sampling}: loaded {int(reads[off].gt(0).sum())} {name} rows not needed"
        if method == "greedy" and name == "target_logits":
            assert torch.equal(reads, torch.where(off, 0, V)), reads


@pytest.mark.parametrize("method, sampling", WALKS[2:])
def test_residuals_without_mass_keep_the_distribution(method, sampling):
    """The root has two children with tokens past V (never accepted; without replacement they remove
    token V - 1, of q 0) and q = p = [.5, .5, 0, 0] (two logits 0, the others masked): each residual
    max(p - q, 0) has no mass, so the correction is drawn from p itself; for rows held in registers
    (top-k 2) and read through the descriptor (no cut, min-p). Dyadic values keep every step exact."""
    B, N, V = 8, 3, 4
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * B)).to(DEVICE)
    logits = torch.zeros(B, N, V, device=DEVICE)
    mask = (torch.arange(V, device=DEVICE) < 2).expand(B * N, V).contiguous()
    q = torch.tensor([0.5, 0.5, 0.0, 0.0], device=DEVICE).expand(B, N, V).contiguous()
    x = torch.tensor([[0, V, V + 5]], device=DEVICE).expand(B, N).contiguous()
    params = SP(temperature=torch.tensor([1.0, 1.0, 0.5, 1.0] * 2), top_k=torch.tensor([2, 0, 0, 0] * 2),
                min_p=torch.tensor([0.0, 0.0, 0.5, 0.0] * 2))
    c = Case(logits, params, mask, x, q, tree)
    rng = ss.Philox(torch.arange(B, device=DEVICE) + 3)
    path, n, y, *_ = out = _kernel(c, method, sampling, rng)
    _same(out, _reference(c, method, sampling, rng), f"{method}/{sampling}")
    assert (n == 0).all() and set(y.tolist()) == {0, 1}


@pytest.mark.parametrize("method, sampling", WALKS)
def test_root_only_trees_strided_half_precision_logits_and_empty_batches(method, sampling):
    """Root-only trees draw from the root row; a [B, N, V] view with padded rows (bf16) and a strided
    [B, N, V] mask view give the reference's results; B = 0 returns empty outputs."""
    g = torch.Generator().manual_seed(60 + WALKS.index((method, sampling)))
    B, N, V = 3, 1, 45
    c = _case(g, method, sampling, B, N, V, "normal", masked=False)
    rng = ss.Philox(torch.arange(B, device=DEVICE) * 7919)
    ref = _reference(to_device(c), method, sampling, rng)
    assert (ref.num_accepted == 0).all()
    wide = torch.zeros(B, N + 2, V + 3, dtype=torch.bfloat16)
    wide[:, 1 : N + 1, :V] = c.logits.bfloat16()
    mask = torch.rand(B, N + 1, V + 5, generator=g) < 0.7
    mask[..., 0] = True
    c = to_device(c._replace(logits=wide[:, 1 : N + 1, :V], mask=mask[:, :N, :V]))
    ref = ss.verify_tree_from_logits(c.logits, c.x, c.tree, c.params, draft_probs=c.q, method=method,
                                     draft_sampling=sampling, rng=rng, vocab_mask=c.mask)
    _same(_kernel(c, method, sampling, rng), ref, f"{method}/{sampling} strided")
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    rp = (t[:0] for t in _row_params(c.params, B, N))
    q = None if c.q is None else c.q[:0]
    path, n, y, *_ = ktree.verify_tree_from_logits(c.logits[:0], c.x[:0], c.x[:0], c.x[:0], q, method, sampling, 2, *rp,
                                               seed=none, offset=none)
    assert path.shape == (0, 3) and n.shape == (0,) and y.shape == (0,)


def test_launcher_rejects_missing_randomness_draft_probs_and_unknown_methods():
    logits, links = torch.zeros(1, 1, 3), torch.full((1, 1), -1)
    rp = _row_params(SP(), 1, 1)
    with pytest.raises(ValueError, match="method must be one of"):
        ktree.verify_tree_from_logits(logits, links, links, links, None, "beam", "iid", 0, *rp, seed=1)
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        ktree.verify_tree_from_logits(logits, links, links, links, None, "greedy", "sorted", 0, *rp, seed=1)
    with pytest.raises(ValueError, match="needs draft_probs"):
        ktree.verify_tree_from_logits(logits, links, links, links, None, "rrs", "iid", 0, *rp, seed=1)
    with pytest.raises(ValueError, match="needs seed, or u_sample"):
        ktree.verify_tree_from_logits(logits, links, links, links, logits, "traversal", "iid", 0, *rp,
                                      u_sample=torch.rand(1, 1))


@pytest.mark.parametrize("sampling", ["iid", "without_replacement"])
def test_traversal_slots_keep_their_own_scratch_rows(sampling):
    """As the test of the same name for the kernel from probabilities (:func:`kernelcheck.traversal_slots_case`),
    with logits ``log p``: a deleted leaf's slot must keep the row it holds."""
    B = 16
    tree, p, q, x = traversal_slots_case(sampling, B)
    c = Case(p.log(), SP(), None, x, q, tree)
    rng = ss.Philox(torch.arange(B, device=DEVICE) + 1000)
    out = _kernel(c, "traversal", sampling, rng)
    _same(out, _reference(c, "traversal", sampling, rng), sampling)
    assert_traversal_slots_outcome(*out[:3])


@pytest.mark.parametrize("method", SAMPLED)
def test_siblings_drawn_without_replacement_see_q_lose_rejected_tokens(method):
    """The root's children carry tokens 0, 1, 2 drawn without replacement from q = [.6, .2, .15, .05];
    p is uniform (logits 0), held in registers (top-p .99) or read through the descriptor. Child 1
    is accepted with probability p(0) / q(0) = 5/12; else r = [0, 1, 2, 4] / 7 and q loses token 0:
    [0, .5, .375, .125], so child 2 is accepted iff u < (1/7) / .5 = 2/7 (with q not renormalised
    it would be 5/7); else r = [0, 0, 0, 1] (with the raw q it would keep token 2), q = [0, 0, .75,
    .25]: child 3 is never accepted, and the correction is token 3 (traversal: the same numbers, as
    a(root) stays 1)."""
    B, N, V = 16, 4, 4
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 0]] * B)).to(DEVICE)
    q = torch.tensor([0.6, 0.2, 0.15, 0.05], device=DEVICE).expand(B, N, V).contiguous()
    x = torch.tensor([[0, 0, 1, 2]], device=DEVICE).expand(B, N).contiguous()
    params = SP(top_p=torch.tensor([0.99, 1.0] * (B // 2)))
    c = Case(torch.zeros(B, N, V, device=DEVICE), params, None, x, q, tree)
    rng = ss.Philox(torch.arange(B, device=DEVICE) + 21)
    path, n, y, *_ = out = _kernel(c, method, "without_replacement", rng)
    _same(out, _reference(c, method, "without_replacement", rng), method)
    u = uniform(rng, "test", B, N, STREAM_ACCEPT, DEVICE)
    expected = torch.where(u[:, 1] < 5 / 12, 1, torch.where(u[:, 2] < 2 / 7, 2, -1))
    assert torch.equal(path[:, 1], expected) and torch.equal(n, (expected > 0).long()), (path, u)
    assert (y[n == 0] == 3).all() and set(expected.tolist()) == {1, 2, -1}


@pytest.mark.gpu
@pytest.mark.parametrize("method, sampling", WALKS)
def test_real_kernels_on_large_vocabularies(method, sampling):
    """Compiled kernels with the default descriptor configuration on GPU-sized rows (V = 32000 fp32 and
    128256 bf16, 16-node trees): the reference's results, on Philox and torch.Generator streams. Sums
    over such rows are taken in other orders by the two sides, so a draw within float rounding of a
    cumulative boundary may differ: at most 1 request in 50 may, and most of them must agree."""
    g = torch.Generator().manual_seed(80 + WALKS.index((method, sampling)))
    same = total = 0
    for V, dtype in ((32000, torch.float32), (128256, torch.bfloat16)):
        B, N = 16, 16
        c = _case(g, method, sampling, B, N, V, "peaked")
        c = to_device(c._replace(logits=c.logits.to(dtype)))
        philox = ss.Philox(torch.arange(B, device=DEVICE) + V)
        generators = torch.Generator(DEVICE).manual_seed(V), torch.Generator(DEVICE).manual_seed(V)
        for ref_rng, kernel_rng in ((philox, philox), generators):
            ref = _reference(c, method, sampling, ref_rng)
            path, n, y, *_ = _kernel(c, method, sampling, kernel_rng, cfg=(64, 256), block_v=1024)
            ref_y = ref.tokens.gather(1, ref.num_accepted[:, None])[:, 0]
            same += int(((path == ref.path).all(1) & (n == ref.num_accepted) & (y == ref_y)).sum())
            total += B
    assert total - same <= total // 50, f"{total - same} of {total} requests differ"
