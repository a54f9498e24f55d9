"""specsampler.compat.flashinfer: FlashInfer's sampling API (signatures, dtypes, in-place counters,
seeds, validation messages) on specsampler's ops, its filters' exact semantics, the lossless chain
verification against the oracle, and the kernels' dispatch (Triton interpreter without a GPU)."""

import numpy as np
import pytest
import torch
from kernelcheck import DEVICE
from stats import assert_counts_match, assert_mean_within

import specsampler.compat.flashinfer as flashinfer
from conftest import mc_trials
from specsampler import oracle
from specsampler.compat.flashinfer import sampling as fs

# A 5-token row whose filters are far from float boundaries: order 1, 3, 4 (a tie, lower id first), 2, 0.
ROW = [0.05, 0.35, 0.10, 0.25, 0.25]


def _probs(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def _counts(tokens: torch.Tensor, V: int) -> np.ndarray:
    return torch.bincount(tokens.long(), minlength=V).numpy()


def _expected(row, keep) -> np.ndarray:
    p = np.array(row, dtype=np.float64) * np.isin(np.arange(len(row)), keep)
    return p / p.sum()


# ----------------------------------------------------------------------------- the API's shape


def test_module_and_submodule_expose_the_same_functions_with_aliases():
    assert flashinfer.sampling is fs
    for name in fs.__all__:
        assert getattr(flashinfer, name) is getattr(fs, name)
    assert fs.top_p_renorm_prob is fs.top_p_renorm_probs
    assert fs.top_k_renorm_prob is fs.top_k_renorm_probs


def test_tokens_are_int32_or_the_dtype_of_indices():
    probs = _probs(ROW, ROW)
    assert flashinfer.sampling_from_probs(probs).dtype == torch.int32
    assert flashinfer.sampling_from_logits(probs.log()).dtype == torch.int32
    for dtype in (torch.int32, torch.int64):
        idx = torch.tensor([1, 0, 1], dtype=dtype)
        for out in (flashinfer.top_k_sampling_from_probs(probs, 2, indices=idx),
                    flashinfer.top_k_top_p_sampling_from_logits(probs.log(), 2, 0.9, indices=idx)):
            assert out.dtype == dtype and out.shape == (3,)


def test_return_valid_gives_token_zero_and_false_on_rows_without_mass():
    nan = float("nan")
    probs = _probs([nan] * 5, ROW, [0.0] * 5, [nan, 0.0, 0.0, 1.0, nan])
    for fn, args in ((flashinfer.sampling_from_probs, ()), (flashinfer.top_k_sampling_from_probs, (2,)),
                     (flashinfer.top_p_sampling_from_probs, (0.9,)), (flashinfer.min_p_sampling_from_probs, (0.1,)),
                     (flashinfer.top_k_top_p_sampling_from_probs, (2, 0.9))):
        tokens, valid = fn(probs, *args, return_valid=True)
        assert valid.tolist() == [False, True, False, True]
        assert tokens[0] == 0 and tokens[2] == 0 and tokens[3] == 3  # NaN entries are never drawn


def test_check_nan_raises_flashinfers_messages():
    probs = _probs([float("nan")] * 5, ROW)
    with pytest.raises(ValueError, match="Input probs contains NaN"):
        flashinfer.top_p_sampling_from_probs(probs, 0.5, check_nan=True)
    with pytest.raises(ValueError, match="Input logits contains NaN"):
        flashinfer.sampling_from_logits(probs, check_nan=True)
    all_masked = torch.tensor([[float("-inf")] * 5, ROW])  # its softmax is NaN, which FlashInfer checks
    with pytest.raises(ValueError, match="Input probs contains NaN"):
        flashinfer.top_k_top_p_sampling_from_logits(all_masked, 2, 0.9, check_nan=True)


@pytest.mark.parametrize("call", [
    lambda p, x: flashinfer.top_k_renorm_probs(p, x),
    lambda p, x: flashinfer.top_p_renorm_probs(p, x),
    lambda p, x: flashinfer.top_k_mask_logits(p, x),
    lambda p, x: flashinfer.min_p_sampling_from_probs(p, x),
    lambda p, x: flashinfer.top_k_top_p_sampling_from_probs(p, 2, x, filter_apply_order="joint"),
], ids=["top_k_renorm", "top_p_renorm", "top_k_mask", "min_p", "joint_top_p"])
def test_tensor_parameters_get_flashinfers_three_messages(call):
    p = _probs(ROW, ROW, ROW)
    with pytest.raises(ValueError, match=r"Expected a 1D tensor or scalar.*got a 2D tensor"):
        call(p, torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"Expected a 1D tensor of shape \(batch_size,\) or scalar.*0-dimensional"):
        call(p, torch.tensor(1))
    with pytest.raises(ValueError, match=r"Sampling parameter tensor batch size mismatch: expected length 3"):
        call(p, torch.ones(1))


def test_seed_and_offset_get_flashinfers_messages():
    p = _probs(ROW, ROW)
    cases = [((1, torch.tensor([0])), "seed and offset must both be tensors or both be scalars"),
             ((torch.tensor([1], dtype=torch.int32), torch.tensor([0])), "seed tensor must be int64/uint64"),
             ((torch.tensor([[1]]), torch.tensor([0])), "seed tensor must be 1D"),
             ((torch.tensor([1]), torch.tensor([0, 0, 0])), "offset tensor length must be 1 or 2")]
    for (seed, offset), message in cases:
        with pytest.raises(ValueError, match=message):
            flashinfer.sampling_from_probs(p, seed=seed, offset=offset)
    with pytest.raises(ValueError, match="Invalid filter_apply_order: both"):
        flashinfer.top_k_top_p_sampling_from_probs(p, 2, 0.5, filter_apply_order="both")


# ----------------------------------------------------------------------------- filters


def test_top_k_renorm_keeps_exactly_k_with_ties_to_the_lower_id_in_the_input_dtype():
    probs = _probs([0.3, 0.2, 0.2, 0.3], [0.1, 0.2, 0.3, 0.4]).half()
    out = flashinfer.top_k_renorm_probs(probs, torch.tensor([3, 9]))
    assert out.dtype == torch.float16
    assert (out[0] > 0).tolist() == [True, True, False, True]
    torch.testing.assert_close(out[1].float(), probs[1].float(), rtol=1e-3, atol=1e-3)  # k >= V keeps all


def test_top_k_renorm_probs_takes_flashinfers_is_deterministic():
    """FlashInfer 0.7.2's third parameter (bitwise-reproducible sums there); the result here is the same either way."""
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), -1)
    expected = flashinfer.top_k_renorm_probs(probs, 5)
    for fn in (flashinfer.top_k_renorm_probs, fs.top_k_renorm_prob):
        assert torch.equal(fn(probs, 5, True), expected)
        assert torch.equal(fn(probs, torch.full((4,), 5), is_deterministic=True), expected)
        assert torch.equal(fn(probs, 5, is_deterministic=False), expected)


def test_top_k_mask_logits_keeps_k_logits_and_their_values():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0, float("-inf")], [0.5, float("-inf"), float("-inf"), 2.0, 1.0]])
    out = flashinfer.top_k_mask_logits(logits.bfloat16(), torch.tensor([2, 4]))
    assert out.dtype == torch.bfloat16
    inf = float("-inf")
    assert out.float().tolist() == [[inf, 3.0, 3.0, inf, inf], [0.5, inf, inf, 2.0, 1.0]]
    assert torch.equal(flashinfer.top_k_mask_logits(logits, 5), logits)
    assert torch.isinf(flashinfer.top_k_mask_logits(torch.tensor([[1e-30, 2e-30, 0.0]]), 1)[0, [0, 2]]).all()


def test_top_p_renorm_keeps_the_smallest_prefix_reaching_p():
    probs = _probs(ROW, ROW)
    out = flashinfer.top_p_renorm_prob(probs, torch.tensor([0.55, 0.65]))
    np.testing.assert_allclose(out[0].numpy(), _expected(ROW, [1, 3]), rtol=1e-6)
    np.testing.assert_allclose(out[1].numpy(), _expected(ROW, [1, 3, 4]), rtol=1e-6)
    assert out.dtype == torch.float32
    # top_p 0 (an int tensor, as FlashInfer's own test passes) keeps the most likely token
    assert flashinfer.top_p_renorm_probs(probs, torch.zeros(2, dtype=torch.int32))[:, 1].tolist() == [1.0, 1.0]


def test_joint_filters_the_original_probs_and_top_k_first_the_renormalised_top_k():
    probs = _probs([0.4, 0.2, 0.2, 0.2])
    idx = torch.zeros(mc_trials(60_000, 6_000), dtype=torch.int64)
    g = torch.Generator().manual_seed(1)
    first = flashinfer.top_k_top_p_sampling_from_probs(probs, 2, 0.5, indices=idx, generator=g)
    assert (first == 0).all()  # top-2 renormalised is [2/3, 1/3]: 2/3 already reaches 0.5
    joint = flashinfer.top_k_top_p_sampling_from_probs(probs, 2, 0.5, indices=idx, filter_apply_order="joint",
                                                       generator=g)
    assert_counts_match(_counts(joint, 4), _expected([0.4, 0.2, 0.2, 0.2], [0, 1]), label="joint")


@pytest.mark.parametrize("from_logits", [False, True])
def test_top_k_max_bounds_each_rows_k_where_flashinfer_0_7_4_reads_it(from_logits):
    """FlashInfer 0.7.4's ``top_k_max``: with a ``top_k`` tensor on "top_k_first" over V >= 65536 rows, each
    row keeps ``min(k, top_k_max)`` tokens ("no top-k" -1 and k >= V: ``top_k_max``; 0: 1); elsewhere ignored."""
    V, n = 65536, mc_trials(400, 100)
    logits = torch.linspace(2.0, 0.0, V).repeat(4, 1)  # token i has rank i in every row
    x = logits if from_logits else logits.softmax(-1)
    fn = flashinfer.top_k_top_p_sampling_from_logits if from_logits else flashinfer.top_k_top_p_sampling_from_probs
    rows = torch.arange(4).repeat(n)
    top_k = torch.tensor([-1, V, 5, 0])
    tokens = fn(x, top_k, 1.0, indices=rows, seed=7, offset=0, top_k_max=8)
    assert [int(tokens[rows == r].max()) for r in range(4)] == [7, 7, 4, 0]
    # a bound past 256, a scalar top_k or "joint": FlashInfer ignores it, so k -1 keeps every token
    for kw in ({"top_k_max": 257}, {"top_k_max": 8, "filter_apply_order": "joint"}):
        assert int(fn(x, top_k, 1.0, indices=rows, seed=7, offset=0, **kw)[rows == 0].max()) > 8
    assert int(fn(x, -1, 1.0, indices=rows, seed=7, offset=0, top_k_max=8).max()) > 8
    small = x[:, :1000]  # V < 65536: not read
    assert int(fn(small, top_k, 1.0, indices=rows, seed=7, offset=0, top_k_max=8)[rows == 0].max()) > 8


@pytest.mark.parametrize("name, call, keep", [
    ("sampling_from_probs", lambda p, **kw: flashinfer.sampling_from_probs(p, **kw), [0, 1, 2, 3, 4]),
    ("top_k", lambda p, **kw: flashinfer.top_k_sampling_from_probs(p, 3, **kw), [1, 3, 4]),
    ("top_p", lambda p, **kw: flashinfer.top_p_sampling_from_probs(p, 0.55, **kw), [1, 3]),
    ("min_p", lambda p, **kw: flashinfer.min_p_sampling_from_probs(p, torch.tensor([0.5, 0.8]), **kw), None),
    ("top_k_first", lambda p, **kw: flashinfer.top_k_top_p_sampling_from_probs(p, 3, 0.6, **kw), [1, 3]),
    ("joint", lambda p, **kw: flashinfer.top_k_top_p_sampling_from_probs(p, 4, 0.55, filter_apply_order="joint",
                                                                           **kw), [1, 3]),
    ("from_logits", lambda p, **kw: flashinfer.sampling_from_logits(p.log(), **kw), [0, 1, 2, 3, 4]),
    ("from_logits_top_k_first", lambda p, **kw: flashinfer.top_k_top_p_sampling_from_logits(p.log(), 3, 0.6, **kw),
     [1, 3]),
])
def test_draws_from_shared_rows_follow_the_filtered_distribution(name, call, keep):
    """Many outputs per row through ``indices`` (chi-square on each row's counts)."""
    T = mc_trials(200_000, 20_000)
    probs = _probs(ROW, ROW)
    rows = torch.arange(2).repeat_interleave(T)
    tokens = call(probs, indices=rows, seed=torch.arange(2 * T), offset=torch.tensor([3]))
    for r in range(2):
        kept = keep if keep is not None else [[1, 3, 4], [1]][r]
        expected = _expected(ROW, kept)
        assert_counts_match(_counts(tokens[rows == r], 5), expected, label=f"{name} row {r}")


def test_indices_draw_a_million_outputs_from_one_wide_row_without_gathering_it():
    V = 32768  # gathered, the rows would take 128 GB
    probs = torch.zeros(1, V)
    probs[0, ::2] = torch.rand(V // 2, generator=torch.Generator().manual_seed(0))
    tokens = flashinfer.sampling_from_probs(probs, indices=torch.zeros(1_000_000, dtype=torch.int32))
    assert tokens.dtype == torch.int32 and (tokens % 2 == 0).all()
    freq = torch.bincount(tokens.long(), minlength=V).float()
    assert torch.cosine_similarity(freq, probs[0], dim=0) > 0.99


def test_inversion_in_chunks_of_rows_draws_the_tokens_of_one_pass(monkeypatch):
    probs = torch.rand(7, 11, generator=torch.Generator().manual_seed(2))
    probs[3] = 0.0
    idx = torch.randint(0, 7, (500,), generator=torch.Generator().manual_seed(3))
    seed = torch.arange(500)
    whole = flashinfer.sampling_from_probs(probs, indices=idx, seed=seed, offset=torch.tensor([0]))
    monkeypatch.setattr(fs, "_ROWS_PER_INVERSION", 22)  # two rows at a time
    chunked, valid = flashinfer.sampling_from_probs(probs, indices=idx, seed=seed, offset=torch.tensor([0]),
                                                    return_valid=True)
    assert torch.equal(whole, chunked)
    assert torch.equal(valid, idx != 3) and (chunked[idx == 3] == 0).all()


@pytest.mark.parametrize("chunk", [None, 8])  # every row in one inversion, or one row at a time
def test_a_row_holding_inf_changes_no_output_drawn_from_other_rows(monkeypatch, chunk):
    # the +inf row's cumulative sums became NaN in the one sorted sequence every output is searched in, and the
    # outputs drawn from row 0 all became token V - 1
    if chunk:
        monkeypatch.setattr(fs, "_ROWS_PER_INVERSION", chunk)
    probs = torch.softmax(torch.randn(3, 8, generator=torch.Generator().manual_seed(1)), -1)
    idx, seed = torch.tensor([0, 0, 0, 0, 2, 1, 1]), torch.arange(7) + 10
    clean = flashinfer.sampling_from_probs(probs, indices=idx, seed=seed, offset=torch.tensor([0]))
    dirty = probs.clone()
    dirty[1, 3] = float("inf")
    got = flashinfer.sampling_from_probs(dirty, indices=idx, seed=seed, offset=torch.tensor([0]))
    assert torch.equal(got[:5], clean[:5])
    assert (got[5:] != 3).all()  # +inf read as 0, as specsampler.sample reads it


# ----------------------------------------------------------------------------- randomness


def test_every_rows_seed_is_honoured():
    """A row's token depends on its own seed and offset only: not on the batch around it."""
    probs = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(4)), -1)
    seed, offset = torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([0, 5, 0, 5, 0, 5])
    for fn in (lambda p, **kw: flashinfer.sampling_from_probs(p, **kw),
               lambda p, **kw: flashinfer.top_k_top_p_sampling_from_logits(p.log(), 10, 0.8, **kw),
               lambda p, **kw: flashinfer.top_p_sampling_from_probs(p, 0.7, **kw)):
        batch = fn(probs, seed=seed, offset=offset)
        for b in (1, 4):
            alone = fn(probs[b : b + 1], seed=seed[b : b + 1], offset=offset[b : b + 1])
            assert alone[0] == batch[b]


def test_one_seed_gives_each_row_its_own_stream():
    T = mc_trials(100_000, 10_000)
    probs = torch.full((T, 4), 0.25)
    tokens = flashinfer.sampling_from_probs(probs, seed=7, offset=0)
    assert_counts_match(_counts(tokens, 4), np.full(4, 0.25), label="one seed")
    assert torch.equal(tokens, flashinfer.sampling_from_probs(probs, seed=torch.tensor([7]), offset=torch.tensor([0])))
    assert torch.equal(tokens, flashinfer.sampling_from_probs(probs, seed=7, offset=0))
    assert not torch.equal(tokens, flashinfer.sampling_from_probs(probs, seed=7, offset=1))
    big = flashinfer.sampling_from_probs(probs, seed=2**64 - 1, offset=0)  # FlashInfer's seeds are uint64
    assert torch.equal(big, flashinfer.sampling_from_probs(probs, seed=torch.tensor([-1]), offset=torch.tensor([0])))


def test_a_generator_state_gives_the_same_tokens_from_logits_and_from_probs():
    logits = torch.randn(40, 30, generator=torch.Generator().manual_seed(5)) * 3
    g = torch.Generator().manual_seed(6)
    h = g.clone_state()
    from_logits = flashinfer.top_k_top_p_sampling_from_logits(logits, 8, 0.7, filter_apply_order="joint", generator=g)
    from_probs = flashinfer.top_k_top_p_sampling_from_probs(torch.softmax(logits, -1), 8, 0.7,
                                                            filter_apply_order="joint", generator=h)
    assert torch.equal(from_logits, from_probs)


def test_softmax_applies_scalar_and_per_row_temperatures():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(flashinfer.softmax(logits), torch.softmax(logits, -1))
    t = torch.tensor([0.5, 1.0, 2.0])
    torch.testing.assert_close(flashinfer.softmax(logits, temperature=t, enable_pdl=True),
                               torch.softmax(logits / t[:, None], -1))
    torch.testing.assert_close(flashinfer.softmax(logits, 0.7), torch.softmax(logits / 0.7, -1))


def test_softmax_checks_its_temperature_as_flashinfer_0_7_2():
    """FlashInfer 0.7.2's ``_validate_softmax_temperature``: a bool or a non-number is a ``TypeError``; a tensor
    of another rank, length, device or dtype a ``ValueError`` with its message; None, ints, floats and
    float16/bfloat16/float32/float64 tensors of one value per row are taken."""
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(8))
    for bad in (True, False, "0.5", [1.0, 1.0, 1.0]):
        with pytest.raises(TypeError, match="^temperature must be None, a real scalar, or a 1D floating-point tensor "
                                            "with one value per logits row$"):
            flashinfer.softmax(logits, temperature=bad)
    cases = [(torch.tensor(1.0), r"^temperature tensor must be 1D with one value per logits row, got shape \(\)$"),
             (torch.ones(3, 1), r"got shape \(3, 1\)$"),
             (torch.ones(2), r"^temperature tensor length must equal logits.size\(0\) \(3\), got 2$"),
             (torch.ones(3, device="meta"),
              r"^temperature tensor must be on the same device as logits \(cpu\), got meta$"),
             (torch.ones(3, dtype=torch.int64),
              r"^temperature tensor must have dtype float16, bfloat16, float32, or float64, got torch.int64$")]
    for temperature, message in cases:
        with pytest.raises(ValueError, match=message):
            flashinfer.softmax(logits, temperature)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        t = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)
        torch.testing.assert_close(flashinfer.softmax(logits, t), torch.softmax(logits / t.float()[:, None], -1))
    torch.testing.assert_close(flashinfer.softmax(logits, 2), torch.softmax(logits / 2, -1))
    torch.testing.assert_close(flashinfer.softmax(logits, np.float32(0.5)), torch.softmax(logits / 0.5, -1))


# ----------------------------------------------------------------------------- chain speculative sampling


def _docstring_chain():
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]])
    return draft, torch.tensor([[2, 1]], dtype=torch.int32), target


def test_chain_returns_a_tuple_and_adds_into_the_callers_counters():
    draft, ids, target = _docstring_chain()
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(draft, ids, target)
    assert tokens.dtype == torch.int32 and tokens.tolist() == [[2, 0, -1]]  # 2 accepted, 1 (p = 0) rejected
    assert accepted.dtype == emitted.dtype == torch.int32 and accepted.tolist() == emitted.tolist() == [1]
    acc, emi = torch.tensor([5], dtype=torch.int32), torch.tensor([7])
    out = flashinfer.chain_speculative_sampling(draft, ids, target, acc, emi, seed=3, offset=0)
    assert out[1] is acc and out[2] is emi and acc.tolist() == [6] and emi.tolist() == [8]


@pytest.mark.parametrize("counter", [torch.zeros(4, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                     torch.zeros(1)])
@pytest.mark.parametrize("which", [3, 4])  # the accepted or the emitted counter
def test_chain_counters_not_of_one_int_per_request_are_rejected_before_any_write(counter, which):
    # a [4] counter for B = 1 had every entry incremented (entries of no request written)
    draft, ids, target = _docstring_chain()
    args = [draft, ids, target, None, None]
    args[which] = counter
    with pytest.raises(ValueError, match="chain_speculative_sampling: maybe_output_(accepted_token|emitted_draft_token)"
                                         "_num: expected"):
        flashinfer.chain_speculative_sampling(*args)
    assert not counter.any()


def test_chain_accepted_counts_drafts_after_the_first_rejection_that_pass_on_their_own():
    """FlashInfer's accepted count: x_0 (p = 0) is always rejected, x_1 (p = 1) always passes its own test."""
    draft = torch.full((2, 2, 3), 1 / 3)
    target = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]).expand(2, 3, 3)
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(draft, torch.tensor([[0, 0], [0, 0]]), target)
    assert emitted.tolist() == [0, 0] and accepted.tolist() == [1, 1]
    assert tokens[:, 1:].eq(-1).all() and tokens[:, 0].ne(0).all()


def test_chain_with_one_hot_targets_emits_the_targets_tokens():
    B, K, V = 5, 3, 9
    g = torch.Generator().manual_seed(8)
    draft = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    ids = torch.randint(V, (B, K), generator=g)
    target_ids = torch.cat([ids, torch.randint(V, (B, 1), generator=g)], 1)
    target = torch.zeros(B, K + 1, V).scatter_(2, target_ids[..., None], 1.0)
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(draft, ids, target)
    assert torch.equal(tokens.long(), target_ids) and (emitted == K).all() and (accepted == K).all()


def test_chain_output_distribution_and_accepted_count_match_the_oracle():
    """Fixed drafts, many seeds: emitted sequences against :func:`specsampler.oracle.chain_given_drafts`
    (token rejection sampling, lossless) and the mean accepted count against FlashInfer's definition."""
    T, V = mc_trials(200_000, 30_000), 3
    p = [np.array(r) for r in ([0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5])]
    q = [np.array(r) for r in ([0.2, 0.7, 0.1], [0.3, 0.3, 0.4])]
    drafts = (1, 2)
    exact = {seq: prob for seq, prob, _ in oracle.chain_given_drafts("token", drafts, p, q) if prob > 0}
    target = torch.tensor(np.stack(p), dtype=torch.float32).expand(T, 3, V)
    draft = torch.tensor(np.stack(q), dtype=torch.float32).expand(T, 2, V)
    tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
        draft, torch.tensor([drafts]).expand(T, 2), target, seed=torch.arange(T), offset=torch.tensor([0]))
    seen = {}
    for row, n in zip(tokens.tolist(), emitted.tolist()):
        seen[tuple(row[: n + 1])] = seen.get(tuple(row[: n + 1]), 0) + 1
    outcomes = sorted(set(exact) | set(seen))
    assert_counts_match(np.array([seen.get(o, 0) for o in outcomes]), np.array([exact.get(o, 0.0) for o in outcomes]),
                        label="chain_speculative_sampling")
    a = [min(1.0, p[i][x] / q[i][x]) for i, x in enumerate(drafts)]
    reach = np.cumprod(a)  # P(draft i accepted by verification)
    assert_mean_within(accepted.numpy(), float(sum(reach + (1 - reach) * a)), label="accepted")


# ----------------------------------------------------------------------------- the kernels' dispatch


@pytest.mark.parametrize("name, call", [
    ("top_k_sampling_from_probs", lambda p, **kw: flashinfer.top_k_sampling_from_probs(p, 4, **kw)),
    ("top_k_top_p_sampling_from_logits",
     lambda p, **kw: flashinfer.top_k_top_p_sampling_from_logits(p.log(), torch.tensor([3, 5, 17]), 0.8, **kw)),
    ("chain_speculative_sampling",
     lambda p, **kw: flashinfer.chain_speculative_sampling(p[:, None].expand(3, 2, 17).softmax(-1),
                                                           torch.tensor([[1, 2], [3, 4], [5, 6]], device=p.device),
                                                           p[:, None].expand(3, 3, 17), **kw)[0]),
])
def test_the_kernels_draw_the_tokens_of_the_torch_path(monkeypatch, name, call):
    probs = torch.softmax(torch.randn(3, 17, generator=torch.Generator().manual_seed(9)), -1)
    seed, offset = torch.tensor([21, 22, 23]), torch.tensor([0, 1, 2])
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    ref = call(probs, seed=seed, offset=offset)
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    got = call(probs.to(DEVICE), seed=seed.to(DEVICE), offset=offset.to(DEVICE))
    assert torch.equal(got.cpu(), ref), f"{name}: {got} != {ref}"
