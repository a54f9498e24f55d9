import numpy as np
import pytest
import torch
from stats import assert_counts_match

import specsampler as ss
from conftest import mc_trials
from specsampler import TokenTree, longspec, oracle
from specsampler.verify.exactness import Table, encode, encode_dist, random_model, shape_parents, tree_inputs


def _reference_greedy(input_ids, output_ids, mask, non_leaf_len):
    """LongSpec's rule, one request at a time."""
    B, N = input_ids.shape
    acc_ids, acc_num, double = [], [], []
    for b in range(B):
        parent = [max([j for j in range(N) if mask[b, i, j] and j != i], default=0) for i in range(N)]
        ok = [i == 0 or int(output_ids[b, parent[i]]) == int(input_ids[b, i]) for i in range(N)]
        verified = [bool(mask[b, i, i]) and all(ok[j] for j in range(N) if mask[b, i, j]) for i in range(N)]
        last = max(i for i in range(N) if verified[i])
        path = [j for j in range(N) if mask[b, last, j]]
        acc_ids.append([int(output_ids[b, j]) for j in path])
        acc_num.append(len(path))
        double.append(int(last >= non_leaf_len))
    return acc_ids, acc_num, double


def test_tree_verification_follows_longspec_semantics():
    torch.manual_seed(0)
    B, V = 200, 3
    parents = torch.tensor([shape_parents([2, 2, 1])] * B)
    tree = TokenTree.from_parents(parents)
    N = tree.size
    mask = tree.mask().int()  # LongSpec's masks are numeric
    input_ids = torch.randint(0, V, (B, N))
    output_ids = torch.randint(0, V, (B, N))
    non_leaf_len = 7
    acc_ids, acc_num, double = longspec.tree_verification(input_ids, output_ids, mask, torch.zeros(B, dtype=torch.long),
                                                          non_leaf_len)
    ref_ids, ref_num, ref_double = _reference_greedy(input_ids, output_ids, mask.bool(), non_leaf_len)
    assert acc_num.tolist() == ref_num and double.tolist() == ref_double and double.dtype == torch.int32
    for b in range(B):
        assert acc_ids[b].tolist() == ref_ids[b] + [-1] * (acc_ids.shape[1] - len(ref_ids[b]))
    assert acc_ids.shape == (B, tree.max_depth + 1) and (acc_num > 2).any()


def test_tree_verification_moves_the_kv_cache_of_the_accepted_path():
    # chain 0 -> 1 -> 2 plus a branch 0 -> 3; target agrees with node 3's branch
    input_ids = torch.tensor([[9, 1, 2, 4]])
    output_ids = torch.tensor([[4, 7, 7, 5]])  # after root: 4 (node 3 verified); after node 3: 5 (bonus)
    mask = TokenTree.from_parents(torch.tensor([[-1, 0, 1, 0]])).mask()
    cache = torch.arange(10.0).view(1, 10, 1, 1)  # [B, S, H, D]: LongSpec's layout
    acc_ids, acc_num, double = longspec.tree_verification(input_ids, output_ids, mask, torch.tensor([2]), 2,
                                                          kv_cache=[cache])
    assert acc_ids.tolist() == [[4, 5, -1]] and acc_num.tolist() == [2] and double.tolist() == [1]
    assert cache[0, :6, 0, 0].tolist() == [0, 1, 2, 5, 4, 5]  # node 3 (position 5) moved to position 3


@pytest.mark.montecarlo
@pytest.mark.parametrize("drafting", ["deterministic", "iid", "without_replacement"])
def test_verify_stochastic_is_lossless(drafting):
    V, shape, T = 4, [2, 2], mc_trials(200_000, 40_000)
    target, draft = random_model(V, 31), random_model(V, 32)
    P, Q = Table(target, V, 2), Table(draft, V, 1)
    sampling = "top_k" if drafting == "deterministic" else drafting
    p, x, q, tree = tree_inputs(P, Q, shape, T, sampling, torch.Generator().manual_seed(0))
    temperature = 0.7
    # LongSpec's inputs: logits after each node; p_ssm row v = the draft distribution of v's children
    p_llm = p.log() * temperature
    parents = tree.parents
    q_after = torch.zeros_like(q)
    for c in range(1, tree.size):
        q_after[:, parents[0, c]] = q[:, c]
    q_after[q_after.sum(-1) == 0] = 1.0 / V
    p_ssm = q_after.log() * temperature
    from specsampler import Philox

    acc_ids, acc_num = longspec.verify_stochastic(x, tree.mask(), p_llm, p_ssm, temperature,
                                                  draft_sampling=drafting, rng=Philox(torch.arange(T)))
    assert (acc_ids[:, 0] == x[:, 0]).all() and ((acc_num >= 2) & (acc_num <= 4)).all()
    method = "target_only" if drafting == "deterministic" else "rrs"
    exact = oracle.tree(target, draft, shape, method, V, draft_sampling=sampling)
    expected = encode_dist(exact.sequences, 3, V)
    codes = encode(acc_ids[:, 1:], V)
    keys = sorted(set(expected) | set(codes.unique().tolist()))
    counts = torch.bincount(torch.searchsorted(torch.tensor(keys), codes), minlength=len(keys))
    assert_counts_match(counts.numpy(), [expected.get(k, 0.0) for k in keys], label=drafting)


def test_verify_stochastic_survives_an_empty_residual_and_is_seedable():
    B, V = 64, 3
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]] * B))
    logits = torch.log(torch.tensor([0.5, 0.5, 1e-30])).expand(B, 4, V).contiguous()
    x = torch.tensor([[0, 2, 2, 1]]).expand(B, 4)
    from specsampler import Philox

    def run(seed):
        return longspec.verify_stochastic(x, tree.mask(), logits, logits, 1.0, draft_sampling="iid", rng=Philox(seed))

    a, b, c = run(torch.arange(B)), run(torch.arange(B)), run(torch.arange(B) + 1000)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert ((a[0] >= -1) & (a[0] < V)).all()


def test_longspec_bad_inputs_are_named():
    mask = TokenTree.from_parents(torch.tensor([[-1, 0, 0]])).mask()
    x = torch.zeros(1, 3, dtype=torch.long)
    for t in (0.0, float("inf")):  # inf reached SamplingParams and was reported under its name
        with pytest.raises(ValueError, match=r"verify_stochastic: temperature: expected a finite number > 0"):
            longspec.verify_stochastic(x, mask, torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), t)
    with pytest.raises(ValueError, match=r"draft_sampling: expected one of"):
        longspec.verify_stochastic(x, mask, torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), 1.0, draft_sampling="topk")
    with pytest.raises(ValueError, match=r"output_ids: expected shape \[B, N\] \(as tree_mask\) = \[1, 3\]"):
        longspec.tree_verification(x, torch.zeros(1, 2, dtype=torch.long), mask, torch.zeros(1, dtype=torch.long), 1)
    bad = mask.clone()
    bad[0, 0, 0] = False
    with pytest.raises(ValueError, match=r"longspec.tree_verification: tree_mask\[0, 0\]"):
        longspec.tree_verification(x, x, bad, torch.zeros(1, dtype=torch.long), 1)


@pytest.mark.parametrize(("non_leaf_len", "message"), [
    (torch.tensor(0.5), "expected an integer tensor"), (torch.tensor(True), "expected an integer tensor"),
    (torch.tensor([1, 2]), r"expected shape \[B\] = \[3\]")])
def test_tree_verification_names_a_non_leaf_len_that_is_not_an_integer_per_request(non_leaf_len, message):
    # float and bool tensors were accepted, and a [2] tensor for B = 3 failed broadcasting
    mask = TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * 3)).mask()
    x = torch.zeros(3, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"tree_verification: non_leaf_len: {message}"):
        longspec.tree_verification(x, x, mask, torch.zeros(3, dtype=torch.long), non_leaf_len)


def test_tree_verification_takes_validate_and_checks_cache_lens_with_it():
    mask = TokenTree.from_parents(torch.tensor([[-1, 0, 0]])).mask()
    x = torch.zeros(1, 3, dtype=torch.long)
    per_request = longspec.tree_verification(x, x, mask, torch.zeros(1, dtype=torch.long), torch.tensor([1]),
                                             validate="full")
    assert [t.tolist() for t in per_request] == [t.tolist() for t in longspec.tree_verification(
        x, x, mask, torch.zeros(1, dtype=torch.long), 1)]
    with pytest.raises(ValueError, match=r"tree_verification: cache_lens: expected lengths >= 0"):
        longspec.tree_verification(x, x, mask, torch.full((1,), -1), 1, validate="full")
    with pytest.raises(ValueError, match=r"tree_verification: validate: expected one of"):
        longspec.tree_verification(x, x, mask, torch.zeros(1, dtype=torch.long), 1, validate="some")


def test_full_validation_names_the_caller_s_tensors_and_indices():
    # the values were checked inside verify_tree_from_logits: its name, draft_probs derived from p_ssm (another index)
    mask = TokenTree.from_parents(torch.tensor([[-1, 0, 1]])).mask()
    x, p = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 5)
    q = p.clone()
    q[0, 1, 2] = float("nan")  # node 1's draft row: its child node 2 was drawn from it
    with pytest.raises(ValueError, match=r"verify_stochastic: p_ssm: expected logits without NaN or \+inf, got nan "
                                         r"at index \[1, 2\] \(request 0\)"):
        longspec.verify_stochastic(x, mask, p, q, 1.0, draft_sampling="iid", validate="full")
    q[0, 1, 2], q[0, 2, 0] = 0.0, float("nan")  # the leaf's row is never read
    longspec.verify_stochastic(x, mask, p, q, 1.0, draft_sampling="iid", validate="full")
    with pytest.raises(ValueError, match=r"verify_stochastic: input_ids: expected token ids in \[0, 5\), got 9 "
                                         r"at index \[1\]"):
        longspec.verify_stochastic(torch.tensor([[0, 9, 1]]), mask, p, p, 1.0, validate="full")
    llm = p.clone()
    llm[0, 2, 4] = float("inf")
    with pytest.raises(ValueError, match=r"verify_stochastic: p_llm: expected logits without NaN or \+inf, got inf "
                                         r"at index \[2, 4\]"):
        longspec.verify_stochastic(x, mask, llm, p, 1.0, validate="full")


def test_numpy_and_tensor_scalars_are_taken_as_numbers():
    mask = TokenTree.from_parents(torch.tensor([[-1, 0, 0]])).mask()
    g = torch.Generator().manual_seed(3)
    ids, p_llm, p_ssm = torch.tensor([[0, 1, 2]]), torch.randn(1, 3, 5, generator=g), torch.randn(1, 3, 5, generator=g)
    want = longspec.verify_stochastic(ids, mask, p_llm, p_ssm, 0.5, draft_sampling="iid", rng=ss.Philox(4))
    for t in (np.float32(0.5), torch.tensor(0.5)):
        got = longspec.verify_stochastic(ids, mask, p_llm, p_ssm, t, draft_sampling="iid", rng=ss.Philox(4))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    out = torch.tensor([[1, 2, 3]])
    want = longspec.tree_verification(ids, out, mask, torch.zeros(1, dtype=torch.long), 1)
    got = longspec.tree_verification(ids, out, mask, torch.zeros(1, dtype=torch.long), np.int64(1))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match=r"non_leaf_len: expected an int or an integer tensor"):
        longspec.tree_verification(ids, out, mask, torch.zeros(1, dtype=torch.long), 1.5)
