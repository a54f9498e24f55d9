"""specsampler.mlc.batch_spec_verify against a plain per-request loop of MLC-LLM's pseudo-code."""

from collections import Counter

import numpy as np
import pytest
import torch

from specsampler import mlc
from specsampler.validation import ValidationError

F32 = np.float32


def reference(draft_probs, draft_tokens, model_probs, first_child, next_sibling, uniform, parent_ptr, counts=None):
    """MLC-LLM's batch_spec_verify, one request at a time, on numpy float32 arrays. Returns (model_probs, parent_ptr).

    One rule beyond the seed (where it is undefined): a draft token outside [0, V) is never
    accepted; it takes the rejection branch with its draft row (a degenerate residual then
    leaves the row as it is and moves on to the next sibling).
    """
    counts = Counter() if counts is None else counts
    mp, pp = model_probs.copy(), parent_ptr.copy()
    V = mp.shape[1]
    for b in range(len(pp)):
        parent = pp[b]
        child = first_child[parent]
        while child != -1:
            tok = draft_tokens[child]
            valid = 0 <= tok < V
            if valid and mp[parent, tok] >= F32(uniform[child]) * draft_probs[child, tok]:
                counts["accept"] += 1
                parent, child = child, first_child[child]
                continue
            residual = np.maximum(mp[parent] - draft_probs[child], F32(0))
            s = residual.sum(dtype=F32)
            if s < 1e-7 and valid:
                counts["degenerate accept"] += 1
                parent, child = child, first_child[child]
            else:
                if s >= 1e-7 or np.isnan(s):
                    counts["reject"] += 1
                    mp[parent] = residual / s
                child = next_sibling[child]
                if child == -1:
                    counts["all siblings rejected"] += 1
        if first_child[parent] == -1:
            counts["stop at a leaf"] += 1
        pp[b] = parent
    return mp, pp


# ---------------------------------------------------------------- random batches


def chain(n, rng):
    return [-1] + list(range(n - 1))


def binary(n, rng):
    parents, kids = [-1], [0]
    for _ in range(1, n):
        p = int(rng.choice([v for v in range(len(parents)) if kids[v] < 2]))
        parents.append(p)
        kids[p] += 1
        kids.append(0)
    return parents


def random_tree(n, rng):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


SHAPES = {"chain": chain, "binary": binary, "random": random_tree}


def normalise(x):
    return (x / x.sum(axis=-1, keepdims=True)).astype(F32)


def random_batch(rng, V, shape, sizes, pad=3, degenerate=0.3):
    """Numpy buffers of MLC-LLM's batch_spec_verify for trees of the given sizes, scattered over a global node array.

    Nodes of all requests (and ``pad`` unused nodes) are placed at a random permutation of
    global indices, siblings linked in a random order. Draft rows are mixtures of the parent's
    target row and noise, some target entries are 0, and a fraction ``degenerate`` of first
    children get a draft row twice the parent's row (a zero residual with ``p < u*q``).
    """
    N = sum(sizes) + pad
    slot = rng.permutation(N)
    model = rng.gamma(rng.choice([0.1, 1.0]), size=(N, V)) * (rng.random((N, V)) > 0.2)
    model[:, 0] += 1e-3  # no all-zero row
    model = normalise(model)
    draft = normalise(rng.gamma(1.0, size=(N, V)))
    tokens = rng.integers(0, V, N)
    first_child, next_sibling = np.full(N, -1), np.full(N, -1)
    roots, degenerate_children, offset = [], [], 0
    for n in sizes:
        g = slot[offset : offset + n]
        offset += n
        roots.append(g[0])
        parents = SHAPES[shape](n, rng)
        for v in range(n):
            kids = [int(g[i]) for i in rng.permutation(n) if parents[i] == v]
            if kids:
                first_child[g[v]] = kids[0]
                next_sibling[kids[:-1]] = kids[1:]
            for c in kids:
                mix = rng.random()
                draft[c] = normalise(mix * model[g[v]] + (1 - mix) * draft[c])
                cdf = np.cumsum(draft[c], dtype=np.float64)
                tokens[c] = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), V - 1)
            if kids and rng.random() < degenerate:
                c = kids[0]
                draft[c] = 2 * model[g[v]]
                tokens[c] = int(np.argmax(model[g[v]]))
                degenerate_children.append(c)
    uniform = rng.random(N).astype(F32)
    uniform[degenerate_children] = F32(0.75)
    return draft.astype(F32), tokens, model, first_child, next_sibling, uniform, np.array(roots)


def make_case(V, shape, seed, sizes=None):
    rng = np.random.default_rng(seed)
    sizes = sizes or [int(s) for s in rng.integers(1, 12, 5)]
    return random_batch(rng, V, shape, sizes)


def run_port(draft, tokens, model, fc, ns, u, roots, token_dtype=torch.int32, **kw):
    """Call the port on torch copies; returns (model_probs, parent_ptr) after the call."""
    mp = torch.from_numpy(model.copy())
    pp = torch.from_numpy(roots).to(torch.int32)
    mlc.batch_spec_verify(
        torch.from_numpy(draft),
        torch.from_numpy(tokens).to(token_dtype),
        mp,
        torch.from_numpy(fc).to(torch.int32),
        torch.from_numpy(ns).to(torch.int32),
        torch.from_numpy(u),
        pp,
        **kw,
    )
    return mp, pp


def assert_matches_reference(case, **kw):
    mp, pp = run_port(*case, **kw)
    ref_mp, ref_pp = reference(*case)
    assert pp.tolist() == ref_pp.tolist()
    torch.testing.assert_close(mp, torch.from_numpy(ref_mp), rtol=1e-5, atol=1e-6, equal_nan=True)


# ---------------------------------------------------------------- agreement with the seed


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("V", [3, 17, 1000])
def test_matches_the_seed_on_random_trees(V, shape, seed):
    assert_matches_reference(make_case(V, shape, seed))


@pytest.mark.parametrize("shape", ["chain", "binary"])
def test_matches_the_seed_with_a_128k_vocabulary(shape):
    assert_matches_reference(make_case(128_000, shape, 7, sizes=[4, 3]))


@pytest.mark.parametrize("V", [3, 17, 1000])
def test_random_cases_reach_every_branch_of_the_seed(V):
    counts = Counter()
    for shape in SHAPES:
        for seed in range(4):
            reference(*make_case(V, shape, seed), counts=counts)
    branches = ["accept", "reject", "degenerate accept", "all siblings rejected", "stop at a leaf"]
    assert all(counts[b] > 0 for b in branches), counts


def test_batched_walk_equals_one_request_at_a_time():
    draft, tokens, model, fc, ns, u, roots = make_case(17, "random", 3)
    mp, pp = run_port(draft, tokens, model, fc, ns, u, roots)
    mp_one, pp_one = model.copy(), []
    for r in roots:
        m, p = run_port(draft, tokens, mp_one, fc, ns, u, np.array([r]))
        mp_one, pp_one = m.numpy(), pp_one + p.tolist()
    assert pp.tolist() == pp_one
    assert torch.equal(mp, torch.from_numpy(mp_one))


def test_any_integer_dtype_for_tokens_and_indices():
    case = make_case(17, "binary", 5)
    ref = run_port(*case)
    for dtype in (torch.int64, torch.int16):
        mp, pp = run_port(*case, token_dtype=dtype)
        assert torch.equal(pp, ref[1]) and torch.equal(mp, ref[0])


def test_acceptance_is_not_strict_as_in_the_seed():
    draft, tokens, model, fc, ns, u, pp = small_case()
    draft[1], tokens[1], u[1] = torch.tensor([1.0, 0.0, 0.0]), 0, 0.5  # p = 0.5 == u * q
    mlc.batch_spec_verify(draft, tokens, model.clone(), fc, ns, u, pp)
    assert pp.tolist() == [1, 4]
    draft, tokens, model, fc, ns, u, pp = small_case()
    u[1] = 0.0  # p = 0 >= 0 * q: even a token the target excludes is accepted when u = 0
    mlc.batch_spec_verify(draft, tokens, model.clone(), fc, ns, u, pp)
    assert pp.tolist() == [1, 4]


# ---------------------------------------------------------------- in-place semantics


def small_case():
    """Request 0: root 0, children 1 then 2, both rejected. Request 1: root 3, child 4 accepted (a leaf)."""
    draft = torch.tensor(
        [[0.3, 0.3, 0.4], [0.2, 0.0, 0.8], [1.0, 0.0, 0.0], [0.3, 0.3, 0.4], [0.1, 0.8, 0.1]], dtype=torch.float32
    )
    tokens = torch.tensor([0, 2, 0, 1, 1], dtype=torch.int32)
    model = torch.tensor(
        [[0.5, 0.5, 0.0], [0.1, 0.2, 0.7], [0.6, 0.2, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]], dtype=torch.float32
    )
    first_child = torch.tensor([1, -1, -1, 4, -1], dtype=torch.int32)
    next_sibling = torch.tensor([-1, 2, -1, -1, -1], dtype=torch.int32)
    uniform = torch.tensor([0.0, 0.5, 0.5, 0.9, 0.9], dtype=torch.float32)
    roots = torch.tensor([0, 3], dtype=torch.int32)
    return draft, tokens, model, first_child, next_sibling, uniform, roots


def test_rejections_write_the_normalised_residual_into_the_parent_row_only():
    draft, tokens, model, fc, ns, u, pp = small_case()
    before = [t.clone() for t in (draft, tokens, fc, ns, u)]
    mp = model.clone()
    mlc.batch_spec_verify(draft, tokens, mp, fc, ns, u, pp)
    # child 1 (token 2, p = 0): residual [0.3, 0.5, 0] / 0.8; child 2 (token 0, p = 0.375 < 0.5):
    # residual [0, 0.625, 0] / 0.625.
    torch.testing.assert_close(mp[0], torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(mp[1:], model[1:])
    assert pp.tolist() == [0, 4]
    for a, b in zip(before, (draft, tokens, fc, ns, u)):
        assert torch.equal(a, b)


def test_inputs_other_than_model_probs_and_parent_ptr_are_unchanged():
    case = [torch.from_numpy(a) for a in make_case(1000, "binary", 11)]
    before = [t.clone() for t in case]
    mlc.batch_spec_verify(*case)
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(case[i], before[i])
    changed = (case[2] != before[2]).any(dim=1)
    assert changed.any() and not changed.all()


def test_degenerate_residual_accepts_the_child():
    draft, tokens, model, fc, ns, u, pp = small_case()
    draft[1] = 2 * model[0]  # residual 0 everywhere
    tokens[1] = 0  # p = 0.5 < 0.9 * 1.0
    u[1] = 0.9
    mp = model.clone()
    mlc.batch_spec_verify(draft, tokens, mp, fc, ns, u, pp)
    assert pp.tolist() == [1, 4]
    assert torch.equal(mp, model)


# ---------------------------------------------------------------- robustness


def test_out_of_range_draft_tokens_are_never_accepted():
    draft, tokens, model, fc, ns, u, pp = small_case()
    tokens[4] = 3  # would be accepted with u = 0 if in range
    u[4] = 0.0
    draft[4] = torch.tensor([0.1, 0.0, 0.9])
    mp = model.clone()
    mlc.batch_spec_verify(draft, tokens, mp, fc, ns, u, pp)
    assert pp.tolist() == [0, 3]
    torch.testing.assert_close(mp[3], torch.tensor([0.0, 1.0, 0.0]))  # residual with the draft row of node 4
    case = make_case(17, "random", 2)
    case[1][np.random.default_rng(0).random(len(case[1])) < 0.3] = -5
    assert_matches_reference(case)


def test_out_of_range_token_with_a_zero_residual_moves_on_to_the_next_sibling():
    draft, tokens, model, fc, ns, u, pp = small_case()
    draft[1] = model[0]
    tokens[1] = -1
    u[2] = 0.6
    mp = model.clone()
    mlc.batch_spec_verify(draft, tokens, mp, fc, ns, u, pp)
    torch.testing.assert_close(mp[0], torch.tensor([0.0, 1.0, 0.0]))  # then child 2: residual [0, 0.5, 0] / 0.5
    assert pp.tolist() == [0, 4]


@pytest.mark.parametrize("where", ["model", "draft", "uniform"])
def test_nan_inputs_do_not_crash_and_pointers_stay_valid(where):
    draft, tokens, model, fc, ns, u, roots = make_case(17, "binary", 4)
    rng = np.random.default_rng(1)
    arr = {"model": model, "draft": draft, "uniform": u}[where]
    arr[rng.random(arr.shape) < 0.2] = np.nan
    mp, pp = run_port(draft, tokens, model, fc, ns, u, roots)
    assert ((pp >= 0) & (pp < len(fc))).all()
    assert_matches_reference((draft, tokens, model, fc, ns, u, roots))


def test_unchecked_bad_links_and_roots_stay_in_bounds(monkeypatch):
    """As on a GPU in "structure" mode, where index values are not checked."""
    monkeypatch.setattr(mlc.verify, "values_checkable", lambda t, full: full)
    draft, tokens, model, fc, ns, u, _ = small_case()
    pp = torch.tensor([0, 3, 42, -1], dtype=torch.int32)
    fc[1], ns[2] = 99, -7  # node 1 gets a child out of range
    u[1] = 0.0  # accept node 1
    mlc.batch_spec_verify(draft, tokens, model.clone(), fc, ns, u, pp)
    assert pp.tolist() == [1, 4, 4, 0]  # bad roots are clamped and not walked


def test_a_cycle_in_the_links_ends_the_walk():
    draft, tokens, model, fc, ns, u, pp = small_case()
    fc[4] = 3  # 3 -> 4 -> 3 -> ...
    u[:] = 0.0  # accept everything
    mlc.batch_spec_verify(draft, tokens, model.clone(), fc, ns, u, pp)
    assert pp[1].item() in (3, 4)


# ---------------------------------------------------------------- validation


def error(match):
    return pytest.raises(ValidationError, match=match)


def call(case, **kw):
    mlc.batch_spec_verify(*case, **kw)


def test_model_probs_must_be_float32():
    case = list(small_case())
    case[2] = case[2].double()
    with error(r"mlc\.batch_spec_verify: model_probs: expected dtype torch\.float32 .*got torch\.float64"):
        call(case)


def test_model_probs_must_be_contiguous():
    case = list(small_case())
    case[2] = case[2].t().contiguous().t()
    with error(r"model_probs: expected a contiguous tensor .*got strides \(1, 5\)"):
        call(case)


def test_mismatched_num_nodes_is_named():
    case = list(small_case())
    case[1] = case[1][:4]
    with error(r"draft_tokens: expected shape \[num_nodes\] = \[5\], got \[4\]"):
        call(case)
    case = list(small_case())
    case[2] = case[2][:, :2].contiguous()
    with error(r"model_probs: expected shape \[num_nodes, V\] = \[5, 3\], got \[5, 2\]"):
        call(case)


def test_wrong_kinds_and_ranks_are_named():
    case = list(small_case())
    case[5] = case[5].int()
    with error(r"uniform_samples: expected a floating-point tensor, got torch\.int32"):
        call(case)
    case = list(small_case())
    case[6] = case[6][:, None]
    with error(r"token_tree_parent_ptr: expected 1 dimensions, got shape \[2, 1\]"):
        call(case)
    with error(r"validate: expected one of"):
        call(small_case(), validate="none")


def test_devices_must_match():
    case = list(small_case())
    case[1] = case[1].to("meta")
    with error(r"draft_tokens: expected a tensor on cpu .*got one on meta"):
        call(case)


def test_out_of_range_links_and_roots_are_named_on_cpu():
    case = list(small_case())
    case[3][2] = 7
    with error(r"token_tree_first_child\[2\]: expected node indices in \[-1, 5\), got 7"):
        call(case)
    case = list(small_case())
    case[4][0] = -2
    with error(r"token_tree_next_sibling\[0\]: expected node indices in \[-1, 5\), got -2"):
        call(case)
    case = list(small_case())
    case[6][1] = 5
    with error(r"token_tree_parent_ptr: expected root node indices in \[0, 5\), got 5 \(request 1\)"):
        call(case)


def test_full_mode_checks_tokens_and_probabilities_of_the_nodes_read():
    case = list(small_case())
    case[1][0] = -1  # a root: its token, draft row and uniform are not read
    case[0][0, 0] = case[5][0] = float("nan")
    call([t.clone() for t in case], validate="full")
    case[1][2] = 3
    with error(r"draft_tokens\[2\]: expected token ids in \[0, 3\), got 3"):
        call(case, validate="full")
    case = list(small_case())
    case[0][4, 1] = float("nan")
    with error(r"draft_probs\[4, 1\]: expected finite probabilities >= 0, got nan"):
        call(case, validate="full")
    case = list(small_case())
    case[2][3, 2] = -0.5
    with error(r"model_probs\[3, 2\]: expected finite probabilities >= 0, got -0\.5"):
        call(case, validate="full")
    case = list(small_case())
    case[5][2] = 1.5
    with error(r"uniform_samples\[2\]: expected values in \[0, 1\], got 1\.5"):
        call(case, validate="full")


def test_a_failed_validation_modifies_nothing():
    case = list(small_case())
    case[3][2] = 7
    model, roots = case[2].clone(), case[6].clone()
    with error("token_tree_first_child"):
        call(case)
    assert torch.equal(case[2], model) and torch.equal(case[6], roots)


def test_buffers_made_under_inference_mode_are_written_outside_it():
    # torch refuses in-place writes to inference tensors outside inference mode: the op raised its RuntimeError
    # after writing model_probs, with the pointers not written
    want = list(small_case())
    call(want)
    for which in (2, 6):  # model_probs, token_tree_parent_ptr
        case = list(small_case())
        with torch.inference_mode():
            case[which] = case[which].clone()
        call(case)
        assert case[which].is_inference()
        assert torch.equal(case[2], want[2]) and torch.equal(case[6], want[6])


@pytest.mark.gpu
def test_cuda_matches_cpu():
    case = make_case(1000, "binary", 9)
    mp, pp = run_port(*case)
    cuda = [torch.from_numpy(a).cuda() for a in case]
    cuda[6] = cuda[6].int()
    mlc.batch_spec_verify(*cuda)
    assert cuda[6].cpu().tolist() == pp.tolist()
    torch.testing.assert_close(cuda[2].cpu(), mp, rtol=1e-5, atol=1e-6)
