"""specsampler.compat.sglang: sgl_kernel's tree verification (in-place writes at the slots it writes, the
caller's coins used as given, the draft_probs write-back, SGLang's threshold comparisons) and its
sampling functions, the lossless default against the oracle, and the kernels' dispatch (the Triton
interpreter without a GPU)."""

import numpy as np
import pytest
import torch
from kernelcheck import DEVICE
from stats import assert_counts_match

import specsampler.compat.sglang as sgl_kernel
from conftest import mc_trials
from specsampler import Philox, TokenTree, oracle
from specsampler.compat.sglang import KernelCheckError, sampling
from specsampler.verify import exactness as ex

SENTINEL = -7


def _links(parents, batch: int = 1):
    tree = TokenTree.from_parents(torch.tensor([parents] * batch))
    return tree.first_child, tree.next_sibling


def _outputs(batch: int, slots: int, accept_slots: int):
    return (torch.full((slots,), SENTINEL, dtype=torch.int32),
            torch.full((batch, accept_slots), SENTINEL, dtype=torch.int32),
            torch.full((batch,), SENTINEL, dtype=torch.int32))


def _one_hot(rows: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), V).float()


def _walk_case():
    """Root (token 0) with children 1 (token 5) and 2 (token 6); 1 -> 3 (token 7), 2 -> 4 (token 8).
    The target says 6, then 8, then 9, with certainty; node i's predicts slot is 10 + i."""
    first_child, next_sibling = _links([-1, 0, 0, 1, 2])
    candidates = torch.tensor([[0, 5, 6, 7, 8]])
    target = _one_hot([6, 0, 8, 0, 9], 10)[None]
    index = torch.arange(10, 15)[None]
    return candidates, index, first_child, next_sibling, target


def _tokens(predicts, accept_index, accept_token_num) -> torch.Tensor:
    """The emitted sequence of each request (accepted drafts, then the correction), -1 after."""
    n = accept_token_num.long()
    pos = torch.arange(accept_index.shape[1])
    return torch.where(pos <= n[:, None], predicts.long()[accept_index.long().clamp(min=0)], -1)


# ----------------------------------------------------------------------------- the API's shape


def test_package_and_sampling_module_expose_sgl_kernels_names():
    for name in sampling.__all__:
        assert getattr(sgl_kernel, name) is getattr(sampling, name)
    assert sgl_kernel.top_k_renorm_prob is sgl_kernel.top_k_renorm_probs
    assert sgl_kernel.top_p_renorm_prob is sgl_kernel.top_p_renorm_probs
    assert sgl_kernel.tree_speculative_sampling_target_only_rejmask is sgl_kernel.tree_speculative_sampling_target_only


def test_verify_tree_greedy_cpu_is_sgl_kernels_cpu_name_for_the_greedy_walk():
    """sgl_kernel 0.4.10 exports ``verify_tree_greedy_cpu`` (same signature) for CPU engines."""
    assert sgl_kernel.verify_tree_greedy_cpu is sgl_kernel.verify_tree_greedy
    first_child, next_sibling = _links([-1, 0, 1], 2)
    predicts, accept_index, accept_token_num = _outputs(2, 6, 3)
    sgl_kernel.verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, torch.tensor([[0, 1, 2], [0, 7, 8]]),
                                      torch.tensor([[0, 1, 2], [3, 4, 5]]), first_child, next_sibling,
                                      torch.tensor([[1, 2, 4], [9, 8, 7]]))
    assert accept_token_num.tolist() == [2, 0] and predicts.tolist()[:4] == [1, 2, 4, 9]


# ----------------------------------------------------------------------------- tree_speculative_sampling_target_only


@pytest.mark.parametrize("spelling", ["retrive", "retrieve"])
def test_accepted_path_is_written_at_its_retrive_slots_and_nowhere_else(spelling):
    candidates, index, first_child, next_sibling, target = _walk_case()
    predicts, accept_index, accept_token_num = _outputs(1, 20, 3)
    links = {f"{spelling}_index": index, f"{spelling}_next_token": first_child,
             f"{spelling}_next_sibling": next_sibling}
    sgl_kernel.tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num, candidates=candidates,
        uniform_samples=torch.full((1, 5), 0.5), uniform_samples_for_final_sampling=torch.tensor([0.5]),
        target_probs=target, draft_probs=torch.zeros_like(target), **links)
    assert accept_token_num.tolist() == [2]
    assert accept_index.tolist() == [[10, 12, 14]]
    expected = [SENTINEL] * 20
    expected[10], expected[12], expected[14] = 6, 8, 9  # the drafts accepted after nodes 0 and 2, the bonus after 4
    assert predicts.tolist() == expected


def test_the_walk_stops_after_as_many_acceptances_as_accept_slots_allow():
    candidates, index, first_child, next_sibling, target = _walk_case()
    predicts, accept_index, accept_token_num = _outputs(1, 20, 2)
    sgl_kernel.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, index, first_child, next_sibling,
        torch.full((1, 5), 0.5), torch.tensor([0.5]), target, torch.zeros_like(target))
    assert accept_token_num.tolist() == [1] and accept_index.tolist() == [[10, 12]]
    assert predicts[10].item() == 6 and predicts[12].item() == 8  # the bonus at node 2: its target row
    assert (predicts[[11, 13, 14]] == SENTINEL).all()


def _star_case():
    """Four requests, root children 1 (token 0) and 2 (token 1); the root's target row is
    [0.3, 0.5, 0.1, 0.1] and the children's rows say 3."""
    first_child, next_sibling = _links([-1, 0, 0], 4)
    candidates = torch.tensor([[0, 0, 1]] * 4)
    target = torch.stack([torch.tensor([0.3, 0.5, 0.1, 0.1]), *_one_hot([3, 3], 4)])[None].repeat(4, 1, 1)
    index = torch.arange(4)[:, None] * 3 + torch.arange(3)
    return candidates, index, first_child, next_sibling, target


def test_the_callers_coins_decide_as_sglangs_cumulative_rule():
    candidates, index, first_child, next_sibling, target = _star_case()
    predicts, accept_index, accept_token_num = _outputs(4, 12, 2)
    coins = torch.tensor([0.2, 0.6, 0.9, 0.9])[:, None].expand(4, 3).contiguous()
    final = torch.tensor([0.5, 0.5, 0.25, 0.75])
    draft_probs = torch.zeros_like(target)
    sgl_kernel.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, index, first_child, next_sibling, coins, final, target,
        draft_probs)
    # 0.2 < 0.3: the first child; 0.6 < 0.3 + 0.5: the second; 0.9: neither, and the correction
    # from [0, 0, 0.1, 0.1] at 0.25 and 0.75 of its mass: tokens 2 and 3.
    assert accept_token_num.tolist() == [1, 1, 0, 0]
    assert accept_index.tolist() == [[0, 1], [3, 5], [6, SENTINEL], [9, SENTINEL]]
    assert predicts.tolist() == [0, 3, SENTINEL, 1, SENTINEL, 3, 2, SENTINEL, SENTINEL, 3, SENTINEL, SENTINEL]
    # sgl_kernel's write-back: the target's probability of every rejected child's token, nothing else
    written = torch.zeros_like(target)
    written[1, 0, 0] = written[2, 0, 0] = written[3, 0, 0] = 0.3
    written[2, 0, 1] = written[3, 0, 1] = 0.5
    assert torch.equal(draft_probs, written)


def test_draft_probs_are_subtracted_from_the_correction_row():
    candidates, index, first_child, next_sibling, target = _star_case()
    predicts, accept_index, accept_token_num = _outputs(4, 12, 2)
    draft_probs = torch.zeros_like(target)
    draft_probs[:, 0, 2] = 0.1  # left in the caller's tensor: token 2 leaves the residual
    sgl_kernel.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, index, first_child, next_sibling,
        torch.full((4, 3), 0.9), torch.tensor([0.0, 0.3, 0.6, 0.99]), target, draft_probs)
    assert predicts[[0, 3, 6, 9]].tolist() == [3, 3, 3, 3]


def test_without_draft_probs_the_rejected_tokens_leave_the_correction_row():
    # sgl_kernel's newer signature (no draft_probs), called positionally: the thresholds follow the target rows
    first_child, next_sibling = _links([-1, 0, 1])
    candidates = torch.tensor([[0, 2, 4]])
    target = torch.zeros(1, 3, 8)
    target[0, 0, 2], target[0, 0, 0] = 0.95, 0.05
    target[0, 1, 4], target[0, 1, 7] = 0.9, 0.1
    target[0, 2, 0] = 1.0
    predicts, accept_index, accept_token_num = _outputs(1, 3, 3)
    sgl_kernel.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, torch.arange(3)[None], first_child, next_sibling,
        torch.tensor([[0.0, 0.99, 0.0]]), torch.tensor([0.5]), target, 0.91, 1.0, True)
    # 0.95 >= 0.91 accepts token 2; 0.9 < 0.91 and 0.99 > 0.9 reject token 4; without it the row leaves 7
    assert accept_token_num.tolist() == [1] and predicts.tolist() == [2, 7, SENTINEL]


def test_thresholds_below_one_use_sglangs_comparisons():
    candidates, index, first_child, next_sibling, target = _star_case()
    cases = [  # (threshold_single, threshold_acc, coin at the root, accepted child)
        (1.0, 0.5, 0.59, 1),  # 0.59 < 0.3 / 0.5: acc / threshold_acc
        (1.0, 0.5, 0.6, 2),  # 0.6 < 0.3 / 0.5 fails (strictly less, as sgl_kernel since 3d7eaa89); 0.6 < 0.8 / 0.5
        (1.0, 1.0, 0.3, 2),  # a coin at a bucket's upper edge falls in the next bucket
        (0.5, 1.0, 0.95, 2),  # 0.95 > 0.3 and 0.8, but 0.5 >= threshold_single
        (1.0, 0.0, 0.99, 1),  # threshold_acc floored at 1e-9: any mass accepts
    ]
    for t_single, t_acc, coin, child in cases:
        predicts, accept_index, accept_token_num = _outputs(4, 12, 2)
        sgl_kernel.tree_speculative_sampling_target_only(
            predicts, accept_index, accept_token_num, candidates, index, first_child, next_sibling,
            torch.full((4, 3), coin), torch.full((4,), 0.5), target, torch.zeros_like(target), t_single, t_acc)
        assert accept_index[:, 1].tolist() == [3 * b + child for b in range(4)], (t_single, t_acc, coin)


def test_a_draft_of_probability_zero_is_never_accepted_whatever_the_thresholds_and_coin():
    first_child, next_sibling = _links([-1, 0])
    target = _one_hot([1, 2], 3)[None]
    # each of these was accepted by sgl_kernel before 3d7eaa89 (a threshold_single of 0, a coin of 0, both)
    for t_single, t_acc, coin in ((0.0, 1.0, 0.5), (1.0, 1.0, 0.0), (0.0, 0.0, 0.0)):
        predicts, accept_index, accept_token_num = _outputs(1, 2, 2)
        sgl_kernel.tree_speculative_sampling_target_only(
            predicts, accept_index, accept_token_num, torch.tensor([[0, 0]]), torch.arange(2)[None], first_child,
            next_sibling, torch.full((1, 2), coin), torch.tensor([0.5]), target, None, t_single, t_acc)
        assert accept_token_num.tolist() == [0] and predicts[0].item() == 1, (t_single, t_acc, coin)


def test_a_correction_row_left_without_mass_gives_the_last_rejected_child_with_mass():
    # the root's children (tokens 1, 2) carry all its mass, but their float32 sum rounds below the coin: both are
    # rejected and the residual has none left; sgl_kernel then emits the last rejected child's token (not V - 1)
    first_child, next_sibling = _links([-1, 0, 0])
    target = torch.zeros(1, 3, 5)
    target[0, 0, 1], target[0, 0, 2] = 0.25, 0.75 - 2.0**-23
    target[0, 1:, 0] = 1.0
    predicts, accept_index, accept_token_num = _outputs(1, 3, 2)
    sgl_kernel.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, torch.tensor([[0, 1, 2]]), torch.arange(3)[None], first_child,
        next_sibling, torch.full((1, 3), 1.0 - 2.0**-24), torch.tensor([0.5]), target, torch.zeros_like(target))
    assert accept_token_num.tolist() == [0] and predicts[0].item() == 2


@pytest.mark.montecarlo
@pytest.mark.parametrize("shape", [[2, 2], [3, 1]])
def test_at_threshold_one_the_emitted_tokens_follow_the_oracle(shape):
    V, T, seed = 4, mc_trials(200_000, 20_000), 11 + sum(shape)
    target, draft = ex.random_model(V, seed, zeros=True), ex.random_model(V, seed + 1000)
    D = len(shape)
    g = torch.Generator().manual_seed(seed)
    p, x, _, tree = ex.tree_inputs(ex.Table(target, V, D), ex.Table(draft, V, D - 1), shape, T, "top_k", g)
    N = x.shape[1]
    predicts, accept_index, accept_token_num = _outputs(T, T * N, D + 1)
    sgl_kernel.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, x, torch.arange(T * N).view(T, N), tree.first_child,
        tree.next_sibling, torch.rand(T, N, generator=g), torch.rand(T, generator=g), p, torch.zeros_like(p))
    exact = oracle.tree(target, draft, shape, "target_only", V, draft_sampling="top_k")
    assert oracle.max_error(oracle.extend(exact.sequences, target, D + 1), oracle.target_joint(target, D + 1)) < 1e-12
    codes = ex.encode(_tokens(predicts, accept_index, accept_token_num), V)
    p_value, impossible = ex.chi_square(codes, ex.encode_dist(exact.sequences, D + 1, V))
    assert impossible == 0 and p_value > 1e-4, (p_value, impossible)


def test_bad_inputs_raise_sgl_kernels_checks():
    candidates, index, first_child, next_sibling, target = _walk_case()

    def call(**changes):
        args = dict(zip(["predicts", "accept_index", "accept_token_num"], _outputs(1, 20, 3)),
                    candidates=candidates, retrive_index=index, retrive_next_token=first_child,
                    retrive_next_sibling=next_sibling, uniform_samples=torch.rand(1, 5),
                    uniform_samples_for_final_sampling=torch.rand(1), target_probs=target)
        sgl_kernel.tree_speculative_sampling_target_only(**{**args, **changes})

    with pytest.raises(RuntimeError, match=r"Expected 'predicts' to be of type int \(torch.int32\)\."):
        call(predicts=torch.zeros(20, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"Expected 'candidates' to be of type long \(torch.int64\)\."):
        call(candidates=candidates.int())
    with pytest.raises(KernelCheckError, match="threshold_acc: expected a value in \\[0, 1\\], got 1.5"):
        call(threshold_acc=1.5)
    with pytest.raises(KernelCheckError, match="uniform_samples: expected shape \\[1, 5\\]"):
        call(uniform_samples=torch.rand(1, 4))
    with pytest.raises(KernelCheckError, match="not a tree"):
        call(retrive_next_sibling=torch.tensor([[-1, 1, -1, -1, -1]]))
    with pytest.raises(TypeError, match="got both 'retrive_index' and 'retrieve_index'"):
        call(retrieve_index=index)


def _kernel_loop(candidates, index, next_token, next_sibling, coins, final, target, draft, t_single, t_acc, S):
    """sgl_kernel's tree kernel as its CUDA source reads, one request and one node at a time (float32
    scalars; ``draft`` written as it writes it). Returns predicts (slot -> token), accept_index rows, counts."""
    f32 = np.float32
    t_single, t_acc = f32(t_single), max(f32(t_acc), f32(1e-9))
    predicts, accept, nums = {}, [], []
    for b in range(target.shape[0]):
        row, coin, last, cur, acc = 0, f32(coins[b, 0]), int(index[b, 0]), 0, f32(0)
        accepted = [last]
        for _ in range(1, S):
            cur = int(next_token[b, cur])
            while cur != -1:
                tok = int(candidates[b, cur])
                p = f32(target[b, row, tok])
                acc = f32(acc + p)
                if coin <= f32(acc / t_acc) or p >= t_single:
                    acc, row, coin = f32(0), cur, f32(coins[b, cur])
                    predicts[last] = tok
                    last = int(index[b, cur])
                    accepted.append(last)
                    break
                draft[b, row, tok] = target[b, row, tok]
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
        n = len(accepted) - 1
        w = target[b, row].double() - (draft[b, row].double() if n != S - 1 else 0.0)
        w = w.clamp(min=0.0).numpy()
        u, cdf = float(final[b]) * w.sum(), np.cumsum(w)
        hit = np.nonzero((cdf > u) & (w > 0))[0]
        positive = np.nonzero(w > 0)[0]
        predicts[last] = int(hit[0]) if len(hit) else int(positive[-1]) if len(positive) else len(w) - 1
        accept.append(accepted)
        nums.append(n)
    return predicts, accept, nums


def _random_tree_links(g: torch.Generator, N: int) -> tuple[list[int], list[int]]:
    """A random tree of N nodes (a parent's index below its children's), children in a random link order."""
    kids = [[] for _ in range(N)]
    for c in range(1, N):
        kids[int(torch.randint(0, c, (1,), generator=g))].append(c)
    first, sibling = [-1] * N, [-1] * N
    for v, cs in enumerate(kids):
        cs = [cs[i] for i in torch.randperm(len(cs), generator=g).tolist()]
        if cs:
            first[v] = cs[0]
        for a, b in zip(cs, cs[1:]):
            sibling[a] = b
    return first, sibling


@pytest.mark.parametrize("seed", range(6))
def test_outputs_equal_a_loop_over_sgl_kernels_kernel_on_random_trees(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, V = 5, int(torch.randint(1, 10, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
    S = int(torch.randint(1, N + 2, (1,), generator=g))
    t_single, t_acc = [(1.0, 1.0), (0.9, 0.7), (0.0, 0.0), (0.5, 1.0), (1.0, 0.3), (0.2, 0.6)][seed]
    links = [_random_tree_links(g, N) for _ in range(B)]
    next_token = torch.tensor([f for f, _ in links])
    next_sibling = torch.tensor([s for _, s in links])
    candidates = torch.randint(0, V, (B, N), generator=g)
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    target[torch.rand(B, N, V, generator=g) < 0.2] = 0.0  # some tokens the target never emits
    draft = torch.where(torch.rand(B, N, V, generator=g) < 0.3, torch.rand(B, N, V, generator=g) * 0.1, 0.0)
    index = torch.randperm(B * N, generator=g).view(B, N)
    coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)

    want_draft = draft.clone()
    want_predicts, want_accept, want_nums = _kernel_loop(candidates, index, next_token, next_sibling, coins, final,
                                                         target, want_draft, t_single, t_acc, S)
    predicts, accept_index, accept_token_num = _outputs(B, B * N, S)
    sgl_kernel.tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, index,
                                                     next_token, next_sibling, coins, final, target, draft, t_single,
                                                     t_acc)
    assert accept_token_num.tolist() == want_nums
    assert accept_index.tolist() == [a + [SENTINEL] * (S - len(a)) for a in want_accept]
    assert predicts.tolist() == [want_predicts.get(i, SENTINEL) for i in range(B * N)]
    assert torch.equal(draft, want_draft)


# ----------------------------------------------------------------------------- verify_tree_greedy


def test_greedy_follows_the_targets_token_read_at_each_nodes_retrive_index():
    first_child, next_sibling = _links([-1, 0, 1], 2)
    candidates = torch.tensor([[0, 1, 2], [0, 7, 8]])
    index = torch.tensor([[0, 1, 2], [5, 4, 3]])  # request 1's slots reversed: the target is read there too
    target_predict = torch.tensor([[1, 6, 4], [9, 8, 7]])
    predicts, accept_index, accept_token_num = _outputs(2, 6, 3)
    sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index=index,
                                  retrieve_next_token=first_child, retrieve_next_sibling=next_sibling,
                                  target_predict=target_predict)
    assert accept_token_num.tolist() == [1, 2]
    assert accept_index.tolist() == [[0, 1, SENTINEL], [5, 4, 3]]
    assert predicts.tolist() == [1, 6, SENTINEL, 9, 8, 7]


def test_greedy_tries_siblings_in_link_order_and_stops_at_the_accept_slots():
    first_child, next_sibling = _links([-1, 0, 0, 2])
    candidates = torch.tensor([[0, 5, 6, 7]])
    target_predict = torch.tensor([[6, 0, 7, 3]])
    for slots, expected_n in ((3, 2), (2, 1)):
        predicts, accept_index, accept_token_num = _outputs(1, 4, slots)
        sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, torch.arange(4)[None],
                                      first_child, next_sibling, target_predict)
        assert accept_token_num.tolist() == [expected_n]
        assert accept_index.tolist() == [[0, 2, 3][:slots]]
        assert predicts.tolist() == [6, SENTINEL, 7, 3 if expected_n == 2 else SENTINEL]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_a_loop_over_sgl_kernels_kernel_on_random_trees(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, V = 4, int(torch.randint(1, 10, (1,), generator=g)), 3
    S = int(torch.randint(1, N + 2, (1,), generator=g))
    links = [_random_tree_links(g, N) for _ in range(B)]
    next_token, next_sibling = torch.tensor([f for f, _ in links]), torch.tensor([s for _, s in links])
    candidates, target_predict = torch.randint(0, V, (B, N), generator=g), torch.randint(0, V, (B, N), generator=g)
    # each request's slots in its own row of the flat target (shuffled there): SGLang lays them out as b * N + i
    index = torch.stack([torch.randperm(N, generator=g) + b * N for b in range(B)])
    flat = target_predict.reshape(-1)
    want_predicts, want_accept, want_nums = {}, [], []
    for b in range(B):  # the kernel: the first child (link order) carrying the target's token, at most S - 1 times
        cur, last, accepted = 0, int(index[b, 0]), [int(index[b, 0])]
        for _ in range(1, S):
            cur = int(next_token[b, cur])
            while cur != -1 and int(candidates[b, cur]) != int(flat[last]):
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
            want_predicts[last] = int(flat[last])
            last = int(index[b, cur])
            accepted.append(last)
        want_predicts[last] = int(flat[last])
        want_accept.append(accepted)
        want_nums.append(len(accepted) - 1)
    predicts, accept_index, accept_token_num = _outputs(B, B * N, S)
    sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, index, next_token,
                                  next_sibling, target_predict)
    assert accept_token_num.tolist() == want_nums
    assert accept_index.tolist() == [a + [SENTINEL] * (S - len(a)) for a in want_accept]
    assert predicts.tolist() == [want_predicts.get(i, SENTINEL) for i in range(B * N)]


# ----------------------------------------------------------------------------- sampling


def _row_probs(batch: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, V, generator=g) * 3, -1)


def test_renorm_keeps_the_filtered_tokens_in_float32():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    assert torch.allclose(sgl_kernel.top_k_renorm_prob(probs, 2), torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))
    assert torch.allclose(sgl_kernel.top_p_renorm_prob(probs, torch.tensor([0.6])),
                          torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))
    assert sgl_kernel.top_k_renorm_probs(probs.double(), torch.tensor([1.0])).dtype == torch.float32


def test_top_k_keeps_every_token_tied_with_the_kth_as_sgl_kernels_pivot():
    probs = torch.tensor([[0.2, 0.3, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4]])
    out = sgl_kernel.top_k_renorm_probs(probs, torch.tensor([1, 2]))
    assert torch.allclose(out, torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 3 / 7, 4 / 7]]))


def test_samples_are_int32_inside_the_filtered_support():
    probs = _row_probs(64, 50, 0)
    g = torch.Generator().manual_seed(0)
    k, p, m = torch.full((64,), 5), torch.full((64,), 0.5), torch.full((64,), 0.3)
    keep_k = sgl_kernel.top_k_renorm_prob(probs, k) > 0
    keep_p = sgl_kernel.top_p_renorm_prob(probs, p) > 0
    draws = {
        "top_p": (sgl_kernel.top_p_sampling_from_probs(probs, p, generator=g), keep_p),
        "min_p": (sgl_kernel.min_p_sampling_from_probs(probs, m, generator=g),
                  probs >= 0.3 * probs.amax(-1, keepdim=True)),
        "joint": (sgl_kernel.top_k_top_p_sampling_from_probs(probs, k, p, filter_apply_order="joint", generator=g),
                  keep_k & keep_p),
        "top_k_first": (sgl_kernel.top_k_top_p_sampling_from_probs(probs, k, 0.5, generator=g),
                        sgl_kernel.top_p_renorm_prob(sgl_kernel.top_k_renorm_prob(probs, 5), 0.5) > 0),
    }
    for name, (tokens, keep) in draws.items():
        assert tokens.dtype == torch.int32 and tokens.shape == (64,), name
        assert keep[torch.arange(64), tokens.long()].all(), name


def test_from_logits_draws_what_from_probs_draws_on_the_same_generator():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(1)) * 4
    for order in ("top_k_first", "joint"):
        g1 = torch.Generator().manual_seed(5)
        g2 = torch.Generator().manual_seed(5)
        a = sgl_kernel.top_k_top_p_sampling_from_logits(logits, 20, 0.7, filter_apply_order=order, generator=g1)
        b = sgl_kernel.top_k_top_p_sampling_from_probs(torch.softmax(logits, -1), 20, 0.7, filter_apply_order=order,
                                                       generator=g2)
        assert torch.equal(a, b), order


def test_indices_draw_every_output_from_its_shared_row():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.25, 0.75]])
    M = 40_000
    indices = (torch.arange(M) % 2).int()
    tokens = sgl_kernel.top_p_sampling_from_probs(probs, 1.0, indices, generator=torch.Generator().manual_seed(2))
    assert tokens.shape == (M,) and tokens.dtype == torch.int32
    for row in range(2):
        counts = torch.bincount(tokens[row::2].long(), minlength=4).numpy()
        assert_counts_match(counts, probs[row].double().numpy(), label=f"row {row}")
    # per-output min_p (sgl_kernel reads it per output): the rows are gathered
    min_p = torch.tensor([0.9, 0.0, 0.0, 0.0])
    out = sgl_kernel.min_p_sampling_from_probs(probs, min_p, torch.tensor([0, 0, 1, 1]))
    assert out[0].item() == 0 and out[2:].ge(2).all()


def test_a_philox_generator_gives_each_request_its_own_stream():
    probs = _row_probs(6, 40, 3)
    full = sgl_kernel.top_p_sampling_from_probs(probs, 0.9, generator=Philox(torch.arange(6) + 100))
    part = sgl_kernel.top_p_sampling_from_probs(probs[3:], 0.9, generator=Philox(torch.arange(3, 6) + 100))
    assert torch.equal(full[3:], part)


def test_sampling_errors_carry_sgl_kernels_messages():
    probs = torch.tensor([[0.5, float("nan")]])
    with pytest.raises(ValueError, match="Input probs contains NaN."):
        sgl_kernel.min_p_sampling_from_probs(probs, 0.1, check_nan=True)
    with pytest.raises(ValueError, match="Invalid filter_apply_order: both"):
        sgl_kernel.top_k_top_p_sampling_from_probs(probs, 1, 0.5, filter_apply_order="both")
    with pytest.raises(ValueError, match="indices"):
        sgl_kernel.top_p_sampling_from_probs(torch.ones(1, 3), 0.5, torch.tensor([1]))
    # min-p with a per-output tensor gathers rows by ``indices``: out of range is the same ValueError, not an
    # IndexError from the gather
    with pytest.raises(ValueError, match=r"indices.*\[0, 1\)"):
        sgl_kernel.min_p_sampling_from_probs(torch.ones(1, 3), torch.tensor([0.1]), torch.tensor([1]))


# ----------------------------------------------------------------------------- the kernels' dispatch


def _dispatch_outputs():
    """A batch through every function, on DEVICE; returns the outputs on the CPU."""
    B, N, V = 3, 7, 11
    g = torch.Generator().manual_seed(4)
    first_child, next_sibling = _links([-1, 0, 0, 1, 1, 2, 3], B)
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    candidates = torch.randint(0, V, (B, N), generator=g)
    coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    index = torch.arange(B * N).view(B, N)
    d = lambda t: t.to(DEVICE)
    out = []
    predicts, accept_index, accept_token_num = map(d, _outputs(B, B * N, 4))
    draft_probs = d(torch.zeros_like(target))
    sgl_kernel.tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, d(candidates), d(index),
                                                     d(first_child), d(next_sibling), d(coins), d(final), d(target),
                                                     draft_probs)
    out += [predicts, accept_index, accept_token_num, draft_probs]
    predicts, accept_index, accept_token_num = map(d, _outputs(B, B * N, 4))
    sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, d(candidates), d(index), d(first_child),
                                  d(next_sibling), d(target.argmax(-1)))
    out += [predicts, accept_index, accept_token_num]
    gen = Philox(torch.arange(B, device=DEVICE))
    out.append(sgl_kernel.top_k_top_p_sampling_from_probs(d(target[:, 0]), 4, 0.8, generator=gen))
    out.append(sgl_kernel.min_p_sampling_from_probs(d(target[:, 1]), 0.2, generator=gen))
    return [t.cpu() for t in out]


def test_the_triton_path_gives_the_outputs_of_the_pytorch_path(monkeypatch):
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    reference = _dispatch_outputs()
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    for got, want in zip(_dispatch_outputs(), reference):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------- slots of other requests


def _two_chains():
    """Two requests, chains 0 -> 1 -> 2 of tokens (_, 1, 2); request b's slots b * 3 + i."""
    first_child, next_sibling = _links([-1, 0, 1], 2)
    candidates = torch.tensor([[0, 1, 2], [0, 1, 2]])
    return candidates, torch.arange(6).view(2, 3), first_child, next_sibling


def test_greedy_never_reads_another_requests_target_row():
    """A node whose retrive_index lies in another request's row of the flat target would verify against that
    request's tokens (sgl_kernel reads it there): a KernelCheckError names it on the CPU; on a device each
    request reads its own row."""
    candidates, index, first_child, next_sibling = _two_chains()
    target_predict = torch.tensor([[1, 2, 3], [9, 9, 9]])
    index[0, 1] = 4  # request 0's node 1 at a slot of request 1's row
    predicts, accept_index, accept_token_num = _outputs(2, 6, 3)
    with pytest.raises(KernelCheckError, match=r"retrive_index: expected slots in \[0, 3\) \(request 0's\), got 4"):
        sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, index, first_child,
                                      next_sibling, target_predict)
    assert (predicts == SENTINEL).all() and (accept_token_num == SENTINEL).all()  # checked before any write


@pytest.mark.parametrize("fn", ["verify_tree_greedy", "tree_speculative_sampling_target_only"])
def test_links_of_nodes_the_walk_never_reaches_are_ignored_as_sgl_kernel_ignores_them(fn):
    """sgl_kernel reads the links from the root only: stale entries in a node no list reaches (here node 3 of a
    chain 0 -> 1 -> 2, padding), or the root's sibling, change nothing (they raised 'not a tree')."""
    candidates, _, first_child, next_sibling = _two_chains()
    pad = lambda t: torch.cat([t, torch.full((2, 1), -1)], 1)  # noqa: E731
    candidates, first_child, next_sibling = pad(candidates), pad(first_child), pad(next_sibling)
    index = torch.arange(8).view(2, 4)
    target = _one_hot([1, 2, 3, 0, 1, 2, 3, 0], 4).view(2, 4, 4)
    outs = []
    for stale in ({}, {"first_child": 1}, {"next_sibling": 2}, {"root_sibling": 3}):
        fc, ns = first_child.clone(), next_sibling.clone()
        fc[1, 3] = stale.get("first_child", -1)
        ns[1, 3] = stale.get("next_sibling", -1)
        ns[1, 0] = stale.get("root_sibling", -1)
        given = fc.clone(), ns.clone()
        predicts, accept_index, accept_token_num = _outputs(2, 8, 3)
        if fn == "verify_tree_greedy":
            sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, index, fc, ns,
                                          target.argmax(-1))
        else:
            sgl_kernel.tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates,
                                                             index, fc, ns, torch.full((2, 4), 0.5),
                                                             torch.full((2,), 0.5), target)
        outs.append([t.tolist() for t in (predicts, accept_index, accept_token_num)])
        assert torch.equal(fc, given[0]) and torch.equal(ns, given[1])  # the caller's links are not modified
    assert outs[0][2] == [2, 2] and all(o == outs[0] for o in outs[1:])

@pytest.mark.parametrize("fn", ["verify_tree_greedy", "tree_speculative_sampling_target_only"])
def test_a_slot_outside_predicts_is_a_kernel_check_error_and_a_shared_one_keeps_the_last_write(fn):
    """A slot outside predicts would be written outside it; slots that requests share (SGLang's own tests give every
    request arange(N)) are the caller's layout: each request's outputs from its own rows, the shared slot holding
    the later request's write, as one thread per request in turn would leave it."""
    candidates, index, first_child, next_sibling = _two_chains()
    target = _one_hot([1, 2, 0], 4)[None].repeat(2, 1, 1)

    def call(index):
        predicts, accept_index, accept_token_num = _outputs(2, 6, 3)
        if fn == "verify_tree_greedy":
            sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, index, first_child,
                                          next_sibling, torch.tensor([[1, 2, 0], [1, 2, 0]]))
        else:
            sgl_kernel.tree_speculative_sampling_target_only(
                predicts, accept_index, accept_token_num, candidates, index, first_child, next_sibling,
                torch.full((2, 3), 0.5), torch.full((2,), 0.5), target)
        return predicts

    assert call(index).tolist() == [1, 2, 0, 1, 2, 0]
    if fn == "tree_speculative_sampling_target_only":  # verify_tree_greedy keeps each request in its own row
        target[1, 1] = _one_hot([3], 4)[0]  # request 1 rejects its node 2 (token 2) and emits 3 there
        assert call(index).tolist() == [1, 2, 0, 1, 3, SENTINEL]
        shared = torch.arange(3).expand(2, 3)  # every request's slots 0, 1, 2
        assert call(shared).tolist() == [1, 3, 0, SENTINEL, SENTINEL, SENTINEL]  # slot 2: request 0's alone
    outside = index.clone()
    outside[1, 2] = 6
    with pytest.raises(KernelCheckError, match=r"retrive_index: expected slots in \[.*\(request 1\)"):
        call(outside)


def test_greedy_slots_in_their_own_row_but_past_predicts_are_a_kernel_check_error():
    """A request's row of retrive_index may run past a short predicts: its slots there would not be written."""
    candidates, index, first_child, next_sibling = _two_chains()
    predicts, accept_index, accept_token_num = _outputs(2, 5, 3)  # one slot short of request 1's row
    with pytest.raises(KernelCheckError, match=r"retrive_index: expected slots in \[3, 5\) \(request 1's\), got 5"):
        sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, index, first_child,
                                      next_sibling, torch.tensor([[1, 2, 0], [1, 2, 0]]))


def test_without_the_value_checks_as_on_a_device_no_request_reads_or_writes_outside_its_own(monkeypatch):
    import specsampler.compat.sglang as module

    monkeypatch.setattr(module, "values_checkable", lambda t, full: False)
    candidates, index, first_child, next_sibling = _two_chains()
    index[0, 1], index[1, 2] = 4, 60  # request 0 pointed into request 1's row; request 1's last slot outside predicts
    target_predict = torch.tensor([[1, 2, 3], [1, 9, 9]])
    predicts, accept_index, accept_token_num = _outputs(2, 6, 3)
    sgl_kernel.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, index, first_child,
                                  next_sibling, target_predict)
    # request 0's node 1 reads and writes its own row's last slot (2: target 3), not request 1's slot 4 (target 9);
    # request 1 stops at node 1 (9 is not its draft 2) and never reaches its slot outside predicts
    assert predicts.tolist() == [1, SENTINEL, 3, 1, 9, SENTINEL]
    assert accept_token_num.tolist() == [1, 1] and accept_index.tolist() == [[0, 2, SENTINEL], [3, 4, SENTINEL]]
