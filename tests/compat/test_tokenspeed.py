"""specsampler.compat.tokenspeed: tokenspeed's chain verification ops (flat in-place writes at the
slots its kernels write, the caller's coins used as given, the draft_probs write-back, its checks),
the newest binding's use_draft_prob / reject_draft_prob_threshold, the lossless settings against the oracle,
and the kernels' dispatch (the Triton interpreter without a GPU)."""

import inspect

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
    V, K, T, target, draft, g, p, candidates, _ = _chain_trials(23, sampled=False)
    predicts, accept_index, accept_token_num = _outputs(T, K + 1)
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates,
                                           torch.rand(T, K + 1, generator=g), torch.rand(T, generator=g), p)
    _assert_follows(predicts, accept_token_num, oracle.chain(target, ex.argmax_drafter(draft), K, "target_only", V),
                    K, V)


def _chain_trials(seed: int, sampled: bool):
    """A Monte Carlo run's inputs over a random 4-token target and draft model, K = 3: ``V, K, T``, the models, the
    generator, the target rows ``p``, the candidates (root 0, then the drafts) and the draft rows (``sampled``)."""
    V, K, T = 4, 3, mc_trials(200_000, 20_000)
    target, draft = ex.random_model(V, seed, zeros=True), ex.random_model(V, seed + 1000)
    g = torch.Generator().manual_seed(seed)
    p, x, q = ex.chain_inputs(ex.Table(target, V, K + 1), ex.Table(draft, V, K), K, T, sampled, g)
    return V, K, T, target, draft, g, p, torch.cat([torch.zeros(T, 1, dtype=torch.int64), x], 1).int(), q


def _assert_follows(predicts, accept_token_num, exact, K: int, V: int) -> None:
    """The emitted chains (``predicts`` up to ``accept_token_num`` per request) follow ``exact``'s sequences: no
    impossible one, and a chi-square p-value above 1e-4."""
    T = accept_token_num.shape[0]
    tokens = torch.where(torch.arange(K + 1) <= accept_token_num.long()[:, None], predicts.long().view(T, K + 1), -1)
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
    recorded = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    recorded[1] = 3.0  # request 1: no recorded proposal
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, d(candidates),
                                           d(torch.rand(B, N, generator=g)), d(torch.rand(B, generator=g)),
                                           d(target), d(recorded), use_draft_prob=True, reject_draft_prob_threshold=2.0)
    out += [predicts, accept_index, accept_token_num]
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


# --- the newest binding's keywords: use_draft_prob, reject_draft_prob_threshold ---------------------------------

T_REJECT = 2.0  # tokenspeed's serving default; its sentinel rows hold T_REJECT + 1


def _draft_prob_call(candidates, coins, final, target, draft, threshold=T_REJECT, **keywords):
    B, N = candidates.shape
    predicts, accept_index, accept_token_num = _outputs(B, N)
    chain_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, coins, final, target,
                                           draft, use_draft_prob=True, reject_draft_prob_threshold=threshold,
                                           **keywords)
    return predicts, accept_index, accept_token_num


def test_verify_chain_target_sampled_takes_enable_pdl_by_keyword_with_tokenspeeds_default_none():
    param = inspect.signature(verify_chain_target_sampled).parameters["enable_pdl"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None  # tokenspeed 0.1.4's


def test_the_newest_keywords_are_keyword_only_and_default_to_the_older_releases_call():
    params = inspect.signature(chain_speculative_sampling_target_only).parameters
    for name in ("use_draft_prob", "reject_draft_prob_threshold"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["enable_pdl"].default is None and params["use_draft_prob"].default is False
    candidates, target, coins, final = _chain_case()
    with pytest.raises(TypeError):  # a thirteenth positional argument has no place
        chain_speculative_sampling_target_only(*_outputs(3, 3), candidates, coins, final, target, None, 1.0, 1.0,
                                               True, False, False)
    old, new = _outputs(3, 3), _outputs(3, 3)
    chain_speculative_sampling_target_only(*old, candidates, coins, final, target)
    chain_speculative_sampling_target_only(*new, candidates, coins, final, target, use_draft_prob=False,
                                           reject_draft_prob_threshold=2.0)
    assert all(torch.equal(a, b) for a, b in zip(old, new))


@pytest.mark.parametrize("seed", range(3))
def test_without_use_draft_prob_any_threshold_leaves_the_target_only_outputs_unchanged(seed):
    """use_draft_prob=False is the older releases' kernel: the threshold is checked, never read."""
    g = torch.Generator().manual_seed(seed)
    B, N, V = 5, 4, 6
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    draft = torch.rand(B, N, V, generator=g) * 0.1
    candidates = torch.randint(0, V, (B, N), generator=g).int()
    coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    before = _outputs(B, N), draft.clone()
    chain_speculative_sampling_target_only(*before[0], candidates, coins, final, target, before[1], 0.8, 0.9)
    for threshold in (1.0, 2.0, float("inf")):
        after = _outputs(B, N), draft.clone()
        chain_speculative_sampling_target_only(*after[0], candidates, coins, final, target, after[1], 0.8, 0.9,
                                               use_draft_prob=False, reject_draft_prob_threshold=threshold)
        assert all(torch.equal(a, b) for a, b in zip(after[0], before[0])) and torch.equal(after[1], before[1])


def test_draft_prob_rule_accepts_while_coin_times_q_is_below_p_and_draws_the_residual():
    """V = 4, drafts 1 then 2. Position 0: p = [0.1, 0.5, 0.4, 0], q = [0, 0.8, 0, 0.2]; position 1:
    p = [0, 0, 0.25, 0.75], q = [0.5, 0, 0.5, 0]; bonus row: token 0."""
    candidates = torch.tensor([[3, 1, 2]] * 4, dtype=torch.int32)
    target = torch.tensor([[0.1, 0.5, 0.4, 0.0], [0.0, 0.0, 0.25, 0.75], [1.0, 0.0, 0.0, 0.0]]).repeat(4, 1, 1)
    draft = torch.tensor([[0.0, 0.8, 0.0, 0.2], [0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]).repeat(4, 1, 1)
    draft[3] = T_REJECT + 1.0  # request 3 recorded no proposal
    # 0.5 * 0.8 = 0.4 < 0.5 and 0.4 * 0.5 = 0.2 < 0.25: both drafts and the bonus 0;
    # 0.5 * 0.8 < 0.5, 0.6 * 0.5 = 0.3 >= 0.25: from max(p - q, 0) = [0, 0, 0, 0.75], whatever the coin: 3;
    # 0.7 * 0.8 = 0.56 >= 0.5: from [0.1, 0, 0.4, 0] at 0.3 of its mass: 2; request 3: rejected whatever its
    # coin, the correction from p itself at 0.3: 1.
    coins = torch.tensor([[0.5, 0.4, 0.9], [0.5, 0.6, 0.9], [0.7, 0.0, 0.0], [0.0, 0.0, 0.0]])
    final = torch.tensor([0.9, 0.01, 0.3, 0.3])
    recorded = draft.clone()
    predicts, accept_index, accept_token_num = _draft_prob_call(candidates, coins, final, target, draft)
    assert accept_token_num.tolist() == [2, 1, 0, 0]
    assert accept_index.tolist() == [[0, 1, 2], [3, 4, S], [6, S, S], [9, S, S]]
    assert predicts.tolist() == [1, 2, 0, 1, 3, S, 2, S, S, 1, S, S]
    assert torch.equal(draft, recorded)  # read only: the rows belong to the drafter
    # A draft outside [0, V) is never accepted, whatever q and p say.
    predicts, _, accept_token_num = _draft_prob_call(torch.tensor([[3, 4, 2]], dtype=torch.int32), coins[:1],
                                                     final[:1], target[:1], draft[:1])
    assert accept_token_num.tolist() == [0]


def test_the_sentinel_is_a_recorded_probability_strictly_above_the_threshold():
    """q(x) equal to the threshold is a probability (accepted by the coin); above it, the draft is rejected."""
    candidates = torch.tensor([[0, 1]], dtype=torch.int32)
    target = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    coins, final = torch.tensor([[0.5, 0.0]]), torch.tensor([0.5])
    for q_x, accepted in ((1.0, 1), (np.nextafter(np.float32(1.0), np.float32(2.0)), 0)):
        draft = torch.zeros(1, 2, 3)
        draft[0, 0, 1] = float(q_x)
        _, _, accept_token_num = _draft_prob_call(candidates, coins, final, target, draft, threshold=1.0)
        assert accept_token_num.tolist() == [accepted]


@pytest.mark.parametrize("seed", range(4))
def test_draft_prob_rule_equals_a_loop_over_tokenspeeds_kernel(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, V = 6, int(torch.randint(1, 6, (1,), generator=g)), 5
    threshold = [2.0, 1.0, 1e6, 1.5][seed]
    target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    target[torch.rand(B, N, V, generator=g) < 0.2] = 0.0
    draft = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    draft[torch.rand(B, N, generator=g) < 0.2] = threshold + 1.0  # rows with no recorded proposal
    draft[torch.rand(B, N, V, generator=g) < 0.05] = threshold * 4  # and scattered sentinel entries
    candidates = torch.randint(0, V, (B, N), generator=g).int()
    candidates[:, 1:] = torch.where(torch.rand(B, N - 1, generator=g) < 0.5, target[:, :-1].argmax(-1).int(),
                                    candidates[:, 1:])
    coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    f32, t32 = np.float32, np.float32(threshold)
    want_predicts, want_nums = torch.full((B * N,), S, dtype=torch.int32), []
    for b in range(B):  # the kernel's draft-prob branch as its CUDA source reads, float32 scalars
        row, n = 0, 0
        for i in range(1, N):
            x = int(candidates[b, i])
            p, q = f32(target[b, row, x]), f32(draft[b, row, x])
            if q > t32 or not f32(coins[b, i - 1]) * q < p:
                break
            want_predicts[b * N + i - 1], row, n = x, i, n + 1
        w = target[b, row].clone()
        if n != N - 1:
            w = (w - torch.where(draft[b, row] > threshold, 0.0, draft[b, row])).clamp(min=0.0)
        cdf = w.double().cumsum(0)
        hit = ((cdf > float(final[b]) * float(w.double().sum())) & (w > 0)).nonzero()
        want_predicts[b * N + n] = int(hit[0, 0]) if len(hit) else V - 1
        want_nums.append(n)
    recorded = draft.clone()
    predicts, accept_index, accept_token_num = _draft_prob_call(candidates, coins, final, target, draft, threshold)
    assert accept_token_num.tolist() == want_nums
    assert accept_index.tolist() == [[b * N + i if i <= n else S for i in range(N)] for b, n in enumerate(want_nums)]
    assert torch.equal(predicts, want_predicts) and torch.equal(draft, recorded)


def test_draft_prob_outputs_of_a_request_depend_on_its_own_rows_alone():
    g = torch.Generator().manual_seed(5)
    B, N, V = 5, 4, 7

    def case():
        target = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
        draft = torch.softmax(torch.randn(B, N, V, generator=g), -1)
        return (torch.randint(0, V, (B, N), generator=g).int(), torch.rand(B, N, generator=g),
                torch.rand(B, generator=g), target, draft)

    mine, other = case(), case()
    other[4][3] = T_REJECT + 1.0
    full = _draft_prob_call(*mine)
    for b in (0, 2, B - 1):
        mixed = [torch.cat([o[:b], m[b:b + 1], o[b + 1:]]) for m, o in zip(mine, other)]
        got = _draft_prob_call(*mixed)
        assert got[0].view(B, N)[b].tolist() == full[0].view(B, N)[b].tolist()
        assert got[1][b].tolist() == full[1][b].tolist() and got[2][b] == full[2][b]


def test_bad_draft_prob_keywords_raise_naming_the_argument():
    candidates, target, coins, final = _chain_case()
    draft = torch.zeros_like(target)
    with pytest.raises(ValueError, match="use_draft_prob requires the recorded draft_probs: draft_probs: expected"):
        _draft_prob_call(candidates, coins, final, target, None)
    for bad in (0.5, float("nan"), "2", True, None):
        with pytest.raises(KernelCheckError, match=r"reject_draft_prob_threshold: expected a number >= 1.0"):
            _draft_prob_call(candidates, coins, final, target, draft, threshold=bad)
    with pytest.raises(KernelCheckError, match=r"reject_draft_prob_threshold: expected .*, got 0.99"):
        chain_speculative_sampling_target_only(*_outputs(3, 3), candidates, coins, final, target,
                                               use_draft_prob=False, reject_draft_prob_threshold=0.99)
    for bad in ("yes", 2, None):
        with pytest.raises(KernelCheckError, match=f"use_draft_prob: expected a bool, got {bad!r}"):
            chain_speculative_sampling_target_only(*_outputs(3, 3), candidates, coins, final, target, draft,
                                                   use_draft_prob=bad, reject_draft_prob_threshold=2.0)
    with pytest.raises(KernelCheckError, match=r"draft_probs: expected shape \[3, 3, 4\]"):
        _draft_prob_call(candidates, coins, final, target, draft[:, :2])


@pytest.mark.montecarlo
def test_draft_prob_rule_follows_the_oracle():
    V, K, T, target, draft_model, g, p, candidates, q = _chain_trials(29, sampled=True)
    recorded = torch.nn.functional.pad(q, (0, 0, 0, 1))  # row K: the bonus position, never read
    predicts, _, accept_token_num = _draft_prob_call(candidates, torch.rand(T, K + 1, generator=g),
                                                     torch.rand(T, generator=g), p, recorded)
    _assert_follows(predicts, accept_token_num, oracle.chain(target, draft_model, K, "token", V), K, V)
