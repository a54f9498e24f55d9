"""specsampler.compat.tokenspeed: tokenspeed's chain verification ops (flat in-place writes at the
slots its kernels write, the caller's coins used as given, the draft_probs write-back, its checks),
the lossless default against the oracle, and the kernels' dispatch (the Triton interpreter without a GPU)."""

import numpy as np
import pytest
import torch
from kernelcheck import DEVICE

from conftest import mc_trials
from specsampler import oracle
from specsampler.compat.sglang import KernelCheckError
from specsampler.compat.tokenspeed import (
    chain_speculative_sampling_target_only,
    verify_chain_greedy,
    verify_chain_target_sampled,
)
from specsampler.verify import exactness as ex

S = -7  # what the caller left in the outputs


def _outputs(B: int, N: int):
    i32 = dict(dtype=torch.int32)
    return torch.full((B * N,), S, **i32), torch.full((B, N), S, **i32), torch.full((B,), S, **i32)


def _greedy_case():
    candidates = torch.tensor([[9, 1, 2, 3], [9, 4, 4, 4]], dtype=torch.int32)
    target = torch.tensor([[1, 2, 5, 6], [7, 4, 4, 4]])
    return candidates, target


def test_greedy_accepts_the_prefix_the_target_repeats_and_writes_only_there():
    candidates, target = _greedy_case()
    predicts, accept_index, accept_token_num = _outputs(2, 4)
    predicts = predicts.view(2, 4)  # the kernel writes b * N + i of any contiguous predicts
    verify_chain_greedy(predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
                        candidates=candidates, target_predict=target, batch_size=2, num_draft_tokens=4)
    assert accept_token_num.tolist() == [2, 0]
    assert accept_index.tolist() == [[0, 1, 2, S], [4, S, S, S]]
    assert predicts.tolist() == [[1, 2, 5, S], [7, S, S, S]]


def test_target_sampled_walks_as_greedy_with_its_own_checks():
    candidates, target = _greedy_case()
    expected = _outputs(2, 4)
    verify_chain_greedy(*expected, candidates, target, 2, 4)
    for dtype in (torch.int32, torch.int64):
        got = _outputs(2, 4)
        verify_chain_target_sampled(*got, candidates, target.to(dtype).reshape(-1))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    predicts, accept_index, accept_token_num = _outputs(2, 4)
    with pytest.raises(ValueError, match="^candidates must be int32, got torch.int64$"):
        verify_chain_target_sampled(predicts, accept_index, accept_token_num, candidates.long(), target)
    with pytest.raises(ValueError, match="^predicts is too small: 3 < 8$"):
        verify_chain_target_sampled(predicts[:3], accept_index, accept_token_num, candidates, target)
    with pytest.raises(ValueError, match="^target_sampled must be int32 or int64, got torch.float32$"):
        verify_chain_target_sampled(predicts, accept_index, accept_token_num, candidates, target.float())


def test_greedy_checks_its_bindings_shapes_and_dtypes():
    candidates, target = _greedy_case()
    with pytest.raises(KernelCheckError, match="candidates: expected dtype int32"):
        verify_chain_greedy(*_outputs(2, 4), candidates.long(), target, 2, 4)
    with pytest.raises(RuntimeError, match=r"accept_index: expected shape \[2, 3\]"):
        verify_chain_greedy(*_outputs(2, 4), candidates, target, 2, 3)


def _chain_case():
    """Three requests, drafts 1 then 2 (V = 4); the target's rows: [0.2, 0.6, 0, 0.2] at the first
    position, [0.1, 0, 0.3, 0.6] at the second, token 3 at the bonus position."""
    candidates = torch.tensor([[0, 1, 2]] * 3, dtype=torch.int32)
    rows = torch.tensor([[0.2, 0.6, 0.0, 0.2], [0.1, 0.0, 0.3, 0.6], [0.0, 0.0, 0.0, 1.0]])
    coins = torch.tensor([[0.5, 0.2, 0.0], [0.5, 0.9, 0.0], [0.7, 0.0, 0.0]])
    final = torch.tensor([0.5, 0.1, 0.75])
    return candidates, rows[None].repeat(3, 1, 1), coins, final


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_chain_sampler_decides_with_the_callers_coins(with_draft_probs):
    candidates, target, coins, final = _chain_case()
    predicts, accept_index, accept_token_num = _outputs(3, 3)
    draft_probs = torch.zeros_like(target) if with_draft_probs else None
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, coins, final, target,
                                           draft_probs)
    # 0.5 <= 0.6 and 0.2 <= 0.3: both drafts and the bonus 3; 0.9 > 0.3: the correction from
    # [0.1, 0, 0, 0.6] at 0.1 of its mass (0); 0.7 > 0.6: from [0.2, 0, 0, 0.2] at 0.75 (3).
    assert accept_token_num.tolist() == [2, 1, 0]
    assert accept_index.tolist() == [[0, 1, 2], [3, 4, S], [6, S, S]]
    assert predicts.tolist() == [1, 2, 3, 1, 0, S, 3, S, S]
    if with_draft_probs:  # tokenspeed's write-back at the rejected draft only
        written = torch.zeros_like(target)
        written[1, 1, 2], written[2, 0, 1] = 0.3, 0.6
        assert torch.equal(draft_probs, written)


def test_chain_sampler_thresholds_and_an_empty_residual():
    candidates, target, coins, final = _chain_case()
    predicts, accept_index, accept_token_num = _outputs(3, 3)
    # threshold_acc 0.5: 0.7 <= 0.6 / 0.5, 0.9 > 0.3 / 0.5; threshold_single 0.3: 0.3 and 0.6 >= 0.3
    for t_single, t_acc, accepted in ((1.0, 0.5, [2, 1, 2]), (0.3, 1.0, [2, 2, 2])):
        chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, coins, final,
                                               target, None, t_single, t_acc)
        assert accept_token_num.tolist() == accepted
    draft_probs = torch.zeros_like(target)
    draft_probs[:, 0] = torch.tensor([0.5, 0.0, 0.0, 0.5])  # covers the first row's residual: nothing left
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, coins, final, target,
                                           draft_probs)
    assert predicts[6].item() == 3  # tokenspeed's fallback: V - 1
    with pytest.raises(KernelCheckError, match=r"threshold_single: expected a value in \[0, 1\], got -0.5"):
        chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, coins, final,
                                               target, None, -0.5)


@pytest.mark.parametrize("seed", range(4))
def test_chain_sampler_equals_a_loop_over_tokenspeeds_kernel(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, V = 6, int(torch.randint(1, 6, (1,), generator=g)), 5
    t_single, t_acc = [(1.0, 1.0), (0.9, 0.7), (0.0, 0.0), (0.4, 0.8)][seed]
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    target[torch.rand(B, N, V, generator=g) < 0.2] = 0.0
    draft = torch.where(torch.rand(B, N, V, generator=g) < 0.3, torch.rand(B, N, V, generator=g) * 0.1, 0.0)
    candidates = torch.randint(0, V, (B, N), generator=g).int()
    coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    f32 = np.float32
    want_draft, want_predicts, want_nums = draft.clone(), torch.full((B * N,), S, dtype=torch.int32), []
    for b in range(B):  # the kernel as its CUDA source reads, float32 scalars
        row, n, rejected = 0, 0, -1
        for i in range(1, N):
            x = int(candidates[b, i])
            p = f32(target[b, row, x])
            if p >= f32(t_single) or f32(coins[b, i - 1]) <= f32(p / max(f32(t_acc), f32(1e-9))):
                want_predicts[b * N + i - 1], row, n = x, i, n + 1
            else:
                rejected = x
                break
        w = target[b, row].double() - (draft[b, row].double() if n != N - 1 else 0.0)
        w = w.clamp(min=0.0)
        if rejected >= 0:
            w[rejected] = 0.0
            want_draft[b, row, rejected] = target[b, row, rejected]
        cdf = w.cumsum(0)
        hit = ((cdf > float(final[b]) * float(w.sum())) & (w > 0)).nonzero()
        want_predicts[b * N + n] = int(hit[0, 0]) if len(hit) else V - 1
        want_nums.append(n)
    predicts, accept_index, accept_token_num = _outputs(B, N)
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, coins, final, target,
                                           draft, t_single, t_acc)
    assert accept_token_num.tolist() == want_nums
    assert accept_index.tolist() == [[b * N + i if i <= n else S for i in range(N)] for b, n in enumerate(want_nums)]
    assert torch.equal(predicts, want_predicts) and torch.equal(draft, want_draft)


@pytest.mark.montecarlo
def test_chain_sampler_at_threshold_one_follows_the_oracle():
    V, K, T, seed = 4, 3, mc_trials(200_000, 20_000), 23
    target, draft = ex.random_model(V, seed, zeros=True), ex.random_model(V, seed + 1000)
    g = torch.Generator().manual_seed(seed)
    p, x, _ = ex.chain_inputs(ex.Table(target, V, K + 1), ex.Table(draft, V, K), K, T, False, g)
    candidates = torch.cat([torch.zeros(T, 1, dtype=torch.int64), x], 1).int()
    predicts, accept_index, accept_token_num = _outputs(T, K + 1)
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates,
                                           torch.rand(T, K + 1, generator=g), torch.rand(T, generator=g), p)
    pos = torch.arange(K + 1)
    tokens = torch.where(pos <= accept_token_num.long()[:, None], predicts.long().view(T, K + 1), -1)
    exact = oracle.chain(target, ex.argmax_drafter(draft), K, "target_only", V)
    p_value, impossible = ex.chi_square(ex.encode(tokens, V), ex.encode_dist(exact.sequences, K + 1, V))
    assert impossible == 0 and p_value > 1e-4, (p_value, impossible)


def _dispatch_outputs():
    B, N, V = 4, 5, 9
    g = torch.Generator().manual_seed(8)
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    candidates = torch.randint(0, V, (B, N), generator=g).int()
    candidates[:, 1:] = torch.where(torch.rand(B, N - 1, generator=g) < 0.6, target[:, :-1].argmax(-1).int(),
                                    candidates[:, 1:])
    d = lambda t: t.to(DEVICE)
    out = []
    predicts, accept_index, accept_token_num = map(d, _outputs(B, N))
    draft_probs = d(torch.zeros_like(target))
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, d(candidates),
                                           d(torch.rand(B, N, generator=g)), d(torch.rand(B, generator=g)),
                                           d(target), draft_probs)
    out += [predicts, accept_index, accept_token_num, draft_probs]
    predicts, accept_index, accept_token_num = map(d, _outputs(B, N))
    verify_chain_greedy(predicts, accept_index, accept_token_num, d(candidates), d(target.argmax(-1)), B, N)
    out += [predicts, accept_index, accept_token_num]
    return [t.cpu() for t in out]


def test_the_triton_path_gives_the_outputs_of_the_pytorch_path(monkeypatch):
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    reference = _dispatch_outputs()
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    for got, want in zip(_dispatch_outputs(), reference):
        assert torch.equal(got, want)


def test_rows_wider_than_a_request_are_refused_where_b_times_n_would_reach_the_next_request():
    """The kernels index every tensor as ``b * N + i``: with rows wider than N, request 1 would read request 0's
    targets (and write into its outputs). Each such tensor is refused, naming it; flat ones are read as before."""
    candidates, target = _greedy_case()
    wide = torch.cat([target, torch.full((2, 1), 8)], 1)  # [2, 5]: the flat positions 4..7 straddle rows 0 and 1
    predicts, accept_index, accept_token_num = _outputs(2, 4)
    with pytest.raises(KernelCheckError, match=r"verify_chain_greedy: target_predict: expected shape \[2, 4\]"):
        verify_chain_greedy(predicts, accept_index, accept_token_num, candidates, wide, 2, 4)
    with pytest.raises(ValueError, match=r"^target_sampled rows must hold 4 tokens, got shape \(2, 5\)$"):
        verify_chain_target_sampled(predicts, accept_index, accept_token_num, candidates, wide)
    with pytest.raises(KernelCheckError, match=r"predicts: expected rows of N = 4 positions"):
        verify_chain_greedy(torch.full((2, 5), S, dtype=torch.int32), accept_index, accept_token_num, candidates,
                            target, 2, 4)
    p = torch.full((2, 4, 3), 1 / 3)
    with pytest.raises(KernelCheckError, match=r"accept_index: expected rows of N = 4 positions"):
        chain_speculative_sampling_target_only(predicts, torch.full((2, 5), S, dtype=torch.int32), accept_token_num,
                                               candidates % 3, torch.rand(2, 4), torch.rand(2), p)
    verify_chain_target_sampled(predicts, accept_index, accept_token_num, candidates, target.reshape(-1))
    assert accept_token_num.tolist() == [2, 0]
