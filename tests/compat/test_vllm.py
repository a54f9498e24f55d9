"""specsampler.compat.vllm: vLLM v1's rejection sampler API on specsampler's verification."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from stats import assert_counts_match

import specsampler.compat.vllm as vllm
from conftest import mc_trials
from specsampler import exactness, oracle

V = 5


def flat(num_draft_tokens):
    """vLLM's layout of per-request counts: the list and its inclusive cumulative sums (int32)."""
    return list(num_draft_tokens), torch.tensor(np.cumsum(num_draft_tokens), dtype=torch.int32)


def metadata(temperature=None, generators=None, **kw):
    greedy = temperature is None
    return vllm.SamplingMetadata(temperature=temperature, all_greedy=greedy, all_random=not greedy and bool(
        (temperature != 0).all()), generators=generators or {}, **kw)


def one_hot_logits(rows, vocab=V):
    """Logits whose argmax at row i is ``rows[i]`` (float32 ``[len(rows), vocab]``)."""
    logits = torch.full((len(rows), vocab), -5.0)
    logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 5.0
    return logits


def run(drafts, logits, bonus, sm, draft_probs=None, **kw):
    n, cu = flat([len(d) for d in drafts])
    x = torch.tensor(sum(drafts, []), dtype=torch.int32)
    return vllm.rejection_sample(x, n, max(n), cu, draft_probs, logits, torch.tensor(bonus)[:, None], sm, **kw)


# ------------------------------------------------------------------------------------- greedy


def test_greedy_requests_accept_the_argmax_prefix_then_emit_the_argmax_or_the_bonus():
    drafts = [[1, 2, 3], [4], [], [0, 0]]
    argmax = [[1, 2, 3], [2], [], [0, 4]]
    out = run(drafts, one_hot_logits(sum(argmax, [])), [9, 8, 7, 6], metadata())
    assert out.dtype == torch.int32 and out.shape == (4, 4)
    assert out.tolist() == [[1, 2, 3, 9], [2, -1, -1, -1], [7, -1, -1, -1], [0, 4, -1, -1]]


def test_greedy_and_sampled_requests_mix_in_one_batch():
    drafts = [[1, 2], [3, 4]]
    logits = one_hot_logits([1, 0, 3, 4])
    sm = metadata(temperature=torch.tensor([0.0, 1.0]))
    assert not sm.all_random and not sm.all_greedy
    draft_probs = torch.full((4, V), 1.0 / V)
    for _ in range(5):
        out = run(drafts, logits, [9, 8], sm, draft_probs=draft_probs).tolist()
        assert out[0] == [1, 0, -1]  # greedy: the argmax at the first mismatch
        assert all(0 <= t < V or t in (8, -1) for t in out[1])


def test_placeholder_drafts_are_never_accepted():
    logits = torch.zeros(3, V)
    for _ in range(10):
        out = run([[2, -1, 3]], logits, [4], metadata(temperature=torch.ones(1)), draft_probs=None)[0].tolist()
        assert out[2:] == [-1, -1] and 0 <= out[0] < V
        assert 0 <= out[1] < V if out[0] == 2 else out[1] == -1


# ------------------------------------------------------------------------------------- exactness


def chain_trials(method, K, trials, seed):
    """``trials`` requests of K drafts each from random models, in vLLM's flat layout, and the
    oracle's distribution of the emitted sequence (the bonus drawn from the target, as vLLM's sampler)."""
    target, drafter = exactness.random_model(V, seed), exactness.random_model(V, seed + 1)
    P, Q = exactness.Table(target, V, K + 1), exactness.Table(drafter, V, K)
    gen = torch.Generator().manual_seed(seed)
    sampled = method != "target_only"
    p, x, q = exactness.chain_inputs(P, Q, K, trials, sampled, gen)
    bonus = torch.multinomial(p[:, K].double(), 1, generator=gen)
    logits = p[:, :K].log().reshape(-1, V)
    n, cu = flat([K] * trials)
    draft = drafter if sampled else exactness.argmax_drafter(drafter)
    exact = oracle.chain(target, draft, K, method, V).sequences
    return x.reshape(-1).int(), n, cu, q.reshape(-1, V) if sampled else None, logits, bonus, exact


@pytest.mark.montecarlo
@pytest.mark.parametrize("method,verify_method,K", [("token", "standard", 2), ("block", "block", 3),
                                                    ("target_only", "standard", 2)])
def test_emitted_sequences_follow_the_oracle(method, verify_method, K):
    trials = mc_trials(200_000, 20_000)
    x, n, cu, q, logits, bonus, exact = chain_trials(method, K, trials, seed=3)
    sm = metadata(temperature=torch.ones(trials))
    out = vllm.rejection_sample(x, n, K, cu, q, logits, bonus, sm, verify_method=verify_method).long()
    p, impossible = exactness.chi_square(exactness.encode(out, V), exactness.encode_dist(exact, K + 1, V))
    assert impossible == 0 and p > 1e-4, (method, p, impossible)


@pytest.mark.montecarlo
def test_recovered_tokens_follow_the_normalised_residual():
    trials = mc_trials(100_000, 20_000)
    p = torch.tensor([0.1, 0.4, 0.2, 0.0, 0.3])
    q = torch.tensor([0.3, 0.1, 0.2, 0.4, 0.0])
    x = torch.zeros(trials, dtype=torch.int32)
    n, cu = flat([1] * trials)
    out = vllm.sample_recovered_tokens(1, n, cu, x, q.expand(trials, V), p.expand(trials, V), metadata(), "cpu")
    residual = (p - q).clamp(min=0)
    assert_counts_match(np.bincount(out.numpy(), minlength=V), (residual / residual.sum()).numpy(), label="residual")
    without_draft = vllm.sample_recovered_tokens(1, n, cu, x + 1, None, p.expand(trials, V), metadata(), "cpu")
    rest = p.clone()
    rest[1] = 0
    assert_counts_match(np.bincount(without_draft.numpy(), minlength=V), (rest / rest.sum()).numpy(), label="no q")


# ------------------------------------------------------------------------------------- randomness


def seeded_run(batch_logits, seed):
    """Request 0 of a batch, seeded with its own generator."""
    B = batch_logits.shape[0] // 2
    drafts = [[1, 2]] * B
    sm = metadata(temperature=torch.ones(B), generators={0: torch.Generator().manual_seed(seed)})
    return run(drafts, batch_logits, list(range(B)), sm, draft_probs=torch.full((2 * B, V), 1.0 / V))[0]


def test_a_seeded_request_is_reproducible_whatever_its_neighbours():
    g = torch.Generator().manual_seed(0)
    mine = torch.randn(2, V, generator=g)
    alone = seeded_run(mine, 11)
    for neighbours in (1, 5):
        batch = torch.cat([mine, torch.randn(2 * neighbours, V, generator=g)])
        assert torch.equal(seeded_run(batch, 11), alone)
    outcomes = {tuple(seeded_run(mine, s).tolist()) for s in range(40)}
    assert len(outcomes) > 1


def test_generate_uniform_probs_draws_seeded_slices_from_their_generators():
    gens = {1: torch.Generator().manual_seed(3), 2: torch.Generator().manual_seed(4)}
    u = vllm.generate_uniform_probs(5, [2, 0, 3], gens, "cpu")
    assert u.dtype == torch.float64 and u.shape == (5,)
    # request 1 has no drafts: its generator is untouched; request 2's slice is rows 2..4
    assert torch.equal(gens[1].get_state(), torch.Generator().manual_seed(3).get_state())
    again = torch.empty(3, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(4))
    assert torch.equal(u[2:], again)


def test_the_triton_path_gives_the_torch_paths_tokens(monkeypatch):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 8, generator=g)
    draft_probs = torch.softmax(torch.randn(4, 8, generator=g), -1)
    x = torch.tensor([1, 5, 2, 2], dtype=torch.int32)
    n, cu = flat([3, 1])

    def call():
        sm = metadata(temperature=torch.tensor([0.0, 1.0]),
                      generators={0: torch.Generator().manual_seed(7), 1: torch.Generator().manual_seed(8)})
        return vllm.rejection_sample(x, n, 3, cu, draft_probs, logits, torch.tensor([[6], [7]]), sm)

    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    reference = call()
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    assert torch.equal(call(), reference)


# ------------------------------------------------------------------------------------- the module


class ArgmaxSampler:
    """A stand-in for vLLM's Sampler: the bonus token is the argmax of the bonus logits."""

    logprobs_mode = "raw_logprobs"

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        assert predict_bonus_token and sampling_metadata.max_num_logprobs == -1
        return vllm.SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True).int())


def spec_metadata(drafts):
    """vLLM's logits layout: each request's draft rows, then its bonus row."""
    md = vllm.SpecDecodeMetadata.make_dummy(drafts, device="cpu")
    ends = np.cumsum([len(d) + 1 for d in drafts])
    md.bonus_logits_indices = torch.tensor(ends - 1)
    md.target_logits_indices = torch.tensor([i for d, e in zip(drafts, ends) for i in range(e - 1 - len(d), e - 1)],
                                            dtype=torch.int64)
    return md


def test_forward_samples_the_bonus_with_the_callers_sampler_and_parse_output_drops_placeholders():
    drafts = [[1, 2], [3]]
    logits = one_hot_logits([1, 2, 4, 0, 2])  # request 0: drafts 1 2, bonus 4; request 1: draft 0, bonus 2
    sampler = vllm.RejectionSampler(ArgmaxSampler())
    out = sampler(spec_metadata(drafts), None, logits, metadata()).sampled_token_ids
    assert out.tolist() == [[1, 2, 4], [0, -1, -1]]
    tokens, logprobs = vllm.RejectionSampler.parse_output(out, V, discard_req_indices=[1])
    assert tokens == [[1, 2, 4], []] and logprobs is None


class LogprobSampler(ArgmaxSampler):
    """Also vLLM's logprob interface: the bonus rows' logits come back as ``logprobs_tensors.logprobs``."""

    def __init__(self, logprobs_mode="raw_logprobs"):
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        processed = self.logprobs_mode.startswith("processed")
        assert logprobs_mode_override == ("processed_logits" if processed else "raw_logits")
        out = super().__call__(logits, sampling_metadata, predict_bonus_token)
        return vllm.SamplerOutput(out.sampled_token_ids, logprobs_tensors=SimpleNamespace(logprobs=logits))

    def compute_logprobs(self, logits):
        return logits.log_softmax(-1)

    def gather_logprobs(self, logprobs, num_logprobs, token_ids):
        return logprobs.gather(1, token_ids[:, None])[:, 0]


def test_forward_returns_the_logprob_of_each_output_slot():
    drafts = [[1, 2], [3]]
    logits = torch.randn(5, V)
    logits[0, 1] = logits[1, 2] = 9.0  # request 0 accepts both drafts; request 1 rejects its draft
    logits[3, 3] = -9.0
    out = vllm.RejectionSampler(LogprobSampler())(spec_metadata(drafts), None, logits, metadata(max_num_logprobs=0))
    tokens = out.sampled_token_ids
    assert tokens[0, :2].tolist() == [1, 2] and tokens[1, 1:].tolist() == [-1, -1]
    # each emitted token's logprob under the row it was emitted at (rows in vLLM's layout: 0 1 2 | 3 4)
    expected = logits.log_softmax(-1)[[0, 1, 2, 3], tokens.flatten()[[0, 1, 2, 3]].long()]
    got = out.logprobs_tensors.reshape(2, 3)
    assert torch.allclose(got[0], expected[:3]) and torch.allclose(got[1, 0], expected[3])


def stale_tails(monkeypatch, stale):
    """Make ``forward``'s verification leave ``stale`` (a draft id of an earlier step, not a placeholder) in
    every slot past each request's tokens, as an engine's reused output buffer can."""
    verify = vllm.rejection_sample

    def with_stale_tails(draft_token_ids, num_draft_tokens, *args, **kwargs):
        out = verify(draft_token_ids, num_draft_tokens, *args, **kwargs)
        past = torch.arange(out.shape[1]) > torch.tensor(num_draft_tokens)[:, None]
        return out.masked_fill(past, stale)

    monkeypatch.setattr(vllm, "rejection_sample", with_stale_tails)


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("drafts", [[[1, 2, 3], [], [4], [0, 1]], [[], [2, 2]], [[3], []], [[]]],
                         ids=["ragged", "first-without-drafts", "last-without-drafts", "one-without-drafts"])
def test_logprobs_of_each_request_come_from_its_own_rows_whatever_its_tail_holds(monkeypatch, logprobs_mode, drafts):
    """Every slot of request b, its stale tail included, is a function of b's logits alone: changing every
    other request's rows leaves b's logprobs bit for bit unchanged (clamping the tail's rows to the flat
    layout reads the next request's rows and fails this)."""
    stale_tails(monkeypatch, stale=4)
    md = spec_metadata(drafts)
    if len(drafts) == 1:
        md.max_spec_len = 3  # a one-request batch with tail slots past its bonus row
    width = md.max_spec_len + 1
    sampler = vllm.RejectionSampler(LogprobSampler(logprobs_mode))
    ends = np.cumsum([len(d) + 1 for d in drafts]).tolist()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(ends[-1], V, generator=g)
    B = len(drafts)

    def sm():  # sampled at temperature 0.5 (processed rows differ from raw ones), each request on its own seed
        return metadata(temperature=torch.full((B,), 0.5), max_num_logprobs=0,
                        generators={b: torch.Generator().manual_seed(b) for b in range(B)})

    base = sampler(md, None, logits.clone(), sm())
    assert (base.sampled_token_ids[:, 1:] == 4).any() or width == 1
    for b, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        others = logits.clone()
        others[:start] = torch.randn(start, V, generator=g)
        others[end:] = torch.randn(len(others) - end, V, generator=g)
        got = sampler(md, None, others, sm()).logprobs_tensors.view(B, width)
        assert torch.equal(got[b], base.logprobs_tensors.view(B, width)[b]), (b, drafts)


def test_logprobs_past_a_requests_tokens_are_those_of_a_row_of_zeros(monkeypatch):
    stale_tails(monkeypatch, stale=2)
    drafts = [[1], [3, 3]]
    out = vllm.RejectionSampler(LogprobSampler())(spec_metadata(drafts), None, torch.randn(5, V),
                                                   metadata(max_num_logprobs=0))
    assert out.sampled_token_ids[0, 2] == 2  # request 0 has 2 slots (a draft, the bonus); its third is stale
    assert out.logprobs_tensors.view(2, 3)[0, 2] == -torch.tensor(float(V)).log()  # token 0 under uniform zeros


def test_forward_applies_top_k_per_request():
    drafts = [[0], [0]]
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, 0.0]] * 4)
    sm = metadata(temperature=torch.ones(2), top_k=torch.tensor([1, 0]))
    sampler = vllm.RejectionSampler(ArgmaxSampler())
    for _ in range(20):
        out = sampler(spec_metadata(drafts), None, logits.clone(), sm).sampled_token_ids
        assert out[0].tolist() == [1, -1]  # top-1: token 0 is rejected, token 1 emitted


def test_forward_applies_penalties_and_bad_words_per_draft_row():
    drafts = [[3, 3], [2]]
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.5]] * 2 + [[0.0] * V] + [[0.0, 0.0, 2.0, 0.0, 0.0]] + [[0.0] * V])
    sm = metadata(no_penalties=False, prompt_token_ids=torch.tensor([[V, V], [V, V]]),
                  frequency_penalties=torch.tensor([1.0, 0.0]), presence_penalties=torch.zeros(2),
                  repetition_penalties=torch.ones(2), output_token_ids=[[], []], spec_token_ids=drafts,
                  bad_words_token_ids={1: [[2]]})
    out = vllm.RejectionSampler(ArgmaxSampler())(spec_metadata(drafts), None, logits, sm).sampled_token_ids
    # request 0: row 1 has seen a 3 (frequency 1: 2.0 -> 1.0 < 1.5); request 1: token 2 is banned
    assert out.tolist() == [[3, 4, -1], [0, -1, -1]]


# vLLM 0.33.0's SamplingMetadata (vllm/v1/sample/metadata.py), field by field in its order
VLLM_0_33_SAMPLING_METADATA_FIELDS = [
    "temperature", "all_greedy", "all_random", "top_p", "top_k", "generators", "max_num_logprobs", "no_penalties",
    "prompt_token_ids", "frequency_penalties", "presence_penalties", "repetition_penalties", "output_token_ids",
    "allowed_token_ids_mask", "bad_words_token_ids", "logitsprocs", "logprob_token_ids", "spec_token_ids",
    "thinking_budget_state_holder"]


def test_sampling_metadata_takes_the_fields_of_vllm_0_33_in_their_order():
    import dataclasses

    assert [f.name for f in dataclasses.fields(vllm.SamplingMetadata)] == VLLM_0_33_SAMPLING_METADATA_FIELDS
    sm = vllm.SamplingMetadata(logprob_token_ids={0: [1, 2]}, thinking_budget_state_holder=None)
    assert sm.spec_token_ids is None and sm.thinking_budget_state_holder is None  # vLLM's defaults
    assert sm.logprob_token_ids == {0: [1, 2]}


class ForcingHolder:
    """vLLM 0.33.0's ThinkingBudgetStateHolder interface (``has_tracked_requests``, ``apply_to_logits``), with its
    layout: request b's rows follow those of the requests before it, as many as ``spec_token_ids[b]`` holds, and
    a forced token at index i of request b raises row ``start_b + i`` to 1e9 where that row exists (index
    ``len(spec_token_ids[b])`` is the bonus position, which vLLM's bonus sampler applies)."""

    def __init__(self, forces):
        self.forces, self.calls = forces, 0  # request -> (index, token)

    def has_tracked_requests(self):
        return bool(self.forces)

    def apply_to_logits(self, logits, predict_bonus_token, spec_token_ids):
        assert predict_bonus_token is False
        self.calls += 1
        starts = np.concatenate([[0], np.cumsum([len(s) for s in spec_token_ids])]).tolist()
        for b, (index, token) in self.forces.items():
            if b < len(spec_token_ids) and starts[b] + index < logits.shape[0]:
                logits[starts[b] + index, token] = 1e9
        return logits


def test_the_thinking_budget_forces_its_tokens_on_each_requests_own_draft_rows():
    """As vLLM 0.33.0, the holder's forced end-of-thinking tokens are applied to the draft rows (after the other
    processors). Request 0's force at its draft 1 rejects that draft and emits the forced token; request 1's
    force at its bonus position belongs to the bonus sampler: in vLLM's flat layout it lands on request 2's first
    draft row, here it reaches no other request's rows, so request 2 verifies against its own logits."""
    drafts = [[1, 2, 3], [2], [3, 3]]
    logits = one_hot_logits([1, 2, 3, 0, 2, 4, 3, 3, 1])  # rows: 0 1 2 | bonus 3 | 4 | bonus 5 | 6 7 | bonus 8
    sm = metadata(spec_token_ids=drafts)
    plain = vllm.RejectionSampler(ArgmaxSampler())(spec_metadata(drafts), None, logits.clone(), sm)
    assert plain.sampled_token_ids.tolist() == [[1, 2, 3, 0], [2, 4, -1, -1], [3, 3, 1, -1]]
    holder = ForcingHolder({0: (1, 4), 1: (1, 0)})
    sm.thinking_budget_state_holder = holder
    out = vllm.RejectionSampler(ArgmaxSampler())(spec_metadata(drafts), None, logits.clone(), sm)
    assert holder.calls == 1
    assert out.sampled_token_ids.tolist() == [[1, 4, -1, -1], [2, 4, -1, -1], [3, 3, 1, -1]]
    idle = ForcingHolder({})  # a holder tracking no request is not applied
    sm.thinking_budget_state_holder = idle
    vllm.RejectionSampler(ArgmaxSampler())(spec_metadata(drafts), None, logits.clone(), sm)
    assert idle.calls == 0


# ------------------------------------------------------------------------------------- lossy modes


class Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_synthetic_mode_accepts_at_the_configured_rates():
    trials = 4000
    sampler = vllm.RejectionSampler(ArgmaxSampler(), Config(rejection_sample_method="synthetic",
                                                            synthetic_acceptance_rates=[0.5, 0.25]))
    assert sampler.synthetic_conditional_rates.tolist() == [0.5, 0.5]
    drafts = [[1, 2]] * trials
    logits = one_hot_logits([0, 0, 3] * trials)
    out = sampler(spec_metadata(drafts), None, logits, metadata()).sampled_token_ids
    accepted = (out[:, :2] == torch.tensor([1, 2])).long().cumprod(1).sum(1).float()
    assert abs(accepted.mean().item() - 0.75) < 0.05  # 0.5 + 0.25


def test_fly_defers_an_uncertain_rejection_followed_by_accepted_drafts():
    drafts = [[1, 2, 3]]
    logits = one_hot_logits([0, 2, 3, 4])
    logits[0] = torch.tensor([1.0, 0.9, -5.0, -5.0, -5.0])  # uncertain between 0 and 1
    fly = vllm.RejectionSampler(ArgmaxSampler(), Config(rejection_sample_method="fly", fly_window_size=2,
                                                        fly_entropy_threshold=0.3))
    assert fly(spec_metadata(drafts), None, logits, metadata()).sampled_token_ids.tolist() == [[1, 2, 3, 4]]
    standard = vllm.RejectionSampler(ArgmaxSampler())
    assert standard(spec_metadata(drafts), None, logits, metadata()).sampled_token_ids.tolist() == [[0, -1, -1, -1]]


def fly_entropy_case():
    """One greedy request, drafts 1..5 against argmaxes 9 2 3 8 5; row 0 holds 0.9 on token 9 and 0.025 on four
    others: the entropy of its 3 largest probabilities is 0.279, of its 5 largest 0.464."""
    logits = torch.full((6, 10), -100.0)
    logits[0, 9] = float(np.log(0.9))
    logits[0, [0, 1, 4, 5]] = float(np.log(0.025))
    for row, token in enumerate([2, 3, 8, 5, 6], start=1):
        logits[row, token] = 100.0
    return [[1, 2, 3, 4, 5]], logits


def test_fly_entropy_counts_the_configured_number_of_largest_probabilities():
    """vLLM 0.33.0's ``fly_entropy_top_k`` (SpeculativeConfig, default 3): at threshold 0.3 the top-3 entropy
    (0.279) keeps the rejection of draft 0; the top-5 entropy (0.464) defers it and the next two drafts follow."""
    drafts, logits = fly_entropy_case()
    outputs = {}
    for top_k in (None, 3, 5):
        config = dict(rejection_sample_method="fly", fly_window_size=2, fly_entropy_threshold=0.3)
        if top_k is not None:
            config["fly_entropy_top_k"] = top_k
        sampler = vllm.RejectionSampler(ArgmaxSampler(), Config(**config))
        assert sampler.fly_entropy_top_k == (3 if top_k is None else top_k)
        outputs[top_k] = sampler(spec_metadata(drafts), None, logits.clone(), metadata()).sampled_token_ids.tolist()
    assert outputs[None] == outputs[3] == [[9, -1, -1, -1, -1, -1]]
    assert outputs[5] == [[1, 2, 3, 8, -1, -1]]
    n, cu = flat([5])
    x = torch.tensor(drafts[0], dtype=torch.int32)
    for top_k, expected in ((3, outputs[3]), (5, outputs[5])):
        got = vllm.rejection_sample(x, n, 5, cu, None, logits[:5], torch.tensor([[6]]), metadata(), False, None,
                                    False, 2, 0.3, top_k)
        assert got.tolist() == expected
    with pytest.raises(ValueError, match="fly_entropy_top_k must be greater than zero"):
        vllm.rejection_sample(x, n, 5, cu, None, logits[:5], torch.tensor([[6]]), metadata(),
                              fly_window_size=2, fly_entropy_threshold=0.3, fly_entropy_top_k=0)


def test_fly_with_synthetic_mode_or_without_a_threshold_raises_a_value_error():
    x, logits, bonus = torch.tensor([1, 2], dtype=torch.int32), one_hot_logits([1, 2]), torch.tensor([[3]])
    n, cu = flat([2])
    with pytest.raises(ValueError, match="^FLy is incompatible with synthetic rejection sampling$"):
        vllm.rejection_sample(x, n, 2, cu, None, logits, bonus, metadata(), True, torch.ones(2),
                              fly_window_size=1, fly_entropy_threshold=0.0)
    with pytest.raises(ValueError, match="rejection_sample: fly_entropy_threshold"):  # vLLM asserts
        vllm.rejection_sample(x, n, 2, cu, None, logits, bonus, metadata(), fly_window_size=1)
    # without FLy, None is the default (vLLM 0.33.0's), and the sampler keeps it
    assert vllm.rejection_sample(x, n, 2, cu, None, logits, bonus, metadata()).tolist() == [[1, 2, 3]]
    assert vllm.RejectionSampler(ArgmaxSampler()).fly_entropy_threshold is None


def test_the_samplers_use_fp64_gumbel_draws_the_recovered_tokens_exponentials_in_float64(monkeypatch):
    """vLLM 0.33.0 reads ``use_fp64_gumbel`` from its Sampler and passes it to ``rejection_sample``, which draws
    the recovered tokens' exponentials in float64 with it. A seeded sampled request rejected by the synthetic mode
    emits the recovered token of the float64 race on its generator's stream (after its uniforms)."""
    V, draws = 64, []
    recover = vllm.sample_recovered_tokens

    def spy(*args, **kwargs):
        e = recover(*args, **kwargs)
        draws.append(args[8] if len(args) > 8 else kwargs.get("use_fp64_gumbel", False))
        return e

    monkeypatch.setattr(vllm, "sample_recovered_tokens", spy)
    for seed in range(4):
        logits = torch.randn(2, V, generator=torch.Generator().manual_seed(100 + seed))
        residual = logits[:1].softmax(-1, dtype=torch.float32)
        residual[0, 1] = 0.0  # the draft (q one-hot at it)
        g = torch.Generator().manual_seed(seed)
        torch.empty(1, dtype=torch.float64).uniform_(generator=g)
        e = torch.empty(V, dtype=torch.float64).exponential_(generator=g)
        sampler = ArgmaxSampler()
        sampler.use_fp64_gumbel = True
        reject_all = vllm.RejectionSampler(sampler, Config(rejection_sample_method="synthetic",
                                                           synthetic_acceptance_rates=[0.0]))
        sm = metadata(temperature=torch.ones(1), generators={0: torch.Generator().manual_seed(seed)})
        out = reject_all(spec_metadata([[1]]), None, logits, sm).sampled_token_ids
        assert out.tolist() == [[int((residual[0] * e.reciprocal()).argmax()), -1]], seed
    assert draws == [True] * 4
    n, cu = flat([1])
    vllm.rejection_sample(torch.tensor([1], dtype=torch.int32), n, 1, cu, None, torch.randn(1, V),
                          torch.tensor([[0]]), metadata(temperature=torch.ones(1)), True, torch.zeros(1), True)
    assert draws[-1] is True
    vllm.RejectionSampler(ArgmaxSampler(), Config(rejection_sample_method="synthetic",
                                                  synthetic_acceptance_rates=[0.0]))(
        spec_metadata([[1]]), None, torch.randn(2, V), metadata(temperature=torch.ones(1)))
    assert draws[-1] is False  # a sampler without the attribute: False, as vLLM's getattr default


def test_lossy_modes_on_sampled_requests_of_unequal_draft_counts_take_each_requests_own_rows():
    # the recovered tokens of sampled requests are drawn by sample_recovered_tokens, given the cumulative counts
    # (2, 3 here: with the per-request counts it raised, as vLLM's own synthetic tests found)
    drafts = [[1, 2], [3]]
    logits = one_hot_logits([1, 2, 4, 3, 2]) * 10  # request 0: drafts 1 2, bonus 4; request 1: draft 3, bonus 2
    sampled = metadata(temperature=torch.ones(2))  # p(draft) = 1 in float32: every draft accepted by vLLM's rule
    fly = vllm.RejectionSampler(ArgmaxSampler(), Config(rejection_sample_method="fly", fly_window_size=1,
                                                        fly_entropy_threshold=0.3))
    assert fly(spec_metadata(drafts), None, logits, sampled).sampled_token_ids.tolist() == [[1, 2, 4], [3, 2, -1]]
    accept_all = vllm.RejectionSampler(ArgmaxSampler(), Config(rejection_sample_method="synthetic",
                                                                synthetic_acceptance_rates=[1.0, 1.0]))
    out = accept_all(spec_metadata(drafts), None, logits, sampled).sampled_token_ids
    assert out.tolist() == [[1, 2, 4], [3, 2, -1]]
    reject_all = vllm.RejectionSampler(ArgmaxSampler(), Config(rejection_sample_method="synthetic",
                                                                synthetic_acceptance_rates=[0.0, 0.0]))
    logits[0, 4] = logits[3, 0] = 50.0  # each first draft row: half its mass on the draft, half on another token
    out = reject_all(spec_metadata(drafts), None, logits, sampled).sampled_token_ids
    # one token each, from the request's own first residual max(p - q, 0) (q one-hot at the draft): 4, resp. 0
    assert out.tolist() == [[4, -1, -1], [0, -1, -1]]


def test_fly_defers_a_rejection_followed_by_its_window_of_acceptances_in_each_requests_own_rows():
    """Sampled requests of unequal draft counts. Request 0's first draft is rejected by vLLM's rule (probability
    about 1e-7 on a row spread over three tokens, whose entropy passes the threshold), and its next draft is
    accepted: FLy accepts it anyway, and the request emits every draft and its bonus. Request 1's rejected draft is
    its last: no window follows, so its recovered token comes from its own row. Above the entropy, no deferral."""
    spread = [10.0 if t >= 2 else -10.0 for t in range(V)]  # three tokens; the drafts 0 and 1 at about 1e-7 each
    one_hot = lambda t: (one_hot_logits([t]) * 10)[0].tolist()  # noqa: E731  (p = 1 in float32)
    drafts = [[0, 1, 2], [1, 0]]
    logits = torch.tensor([spread, one_hot(1), one_hot(2), one_hot(4),  # request 0's rows, then its bonus row
                           one_hot(1), spread, one_hot(3)])  # request 1's
    sampled = metadata(temperature=torch.ones(2))
    for threshold, deferred in ((0.5, True), (1.5, False)):  # the spread rows' entropy: log(3) = 1.10
        fly = vllm.RejectionSampler(ArgmaxSampler(), Config(rejection_sample_method="fly", fly_window_size=1,
                                                            fly_entropy_threshold=threshold))
        out = fly(spec_metadata(drafts), None, logits, sampled).sampled_token_ids.tolist()
        if deferred:
            assert out[0] == [0, 1, 2, 4]
        else:
            assert out[0][0] in (2, 3, 4) and out[0][1:] == [-1, -1, -1]
        assert out[1][0] == 1 and out[1][1] in (2, 3, 4) and out[1][2:] == [-1, -1]


# ------------------------------------------------------------------------------------- errors


def test_rejection_sample_takes_vllm_0_33s_arguments_in_their_positions_and_verify_method_by_keyword():
    import inspect

    params = inspect.signature(vllm.rejection_sample).parameters
    assert list(params)[:14] == [
        "draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs", "target_logits",
        "bonus_token_ids", "sampling_metadata", "synthetic_mode", "synthetic_conditional_rates", "use_fp64_gumbel",
        "fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k"]
    assert [params[k].default for k in list(params)[8:14]] == [False, None, False, None, None, 3]
    assert params["verify_method"].kind is inspect.Parameter.KEYWORD_ONLY
    x, logits = torch.tensor([1, 2], dtype=torch.int32), one_hot_logits([1, 2])
    n, cu = flat([2])
    args = (x, n, 2, cu, None, logits, torch.tensor([[3]]), metadata())
    assert vllm.rejection_sample(*args, False, None, True, None, None, 3).tolist() == [[1, 2, 3]]
    # the call of vLLM's commit 974eaf34, verify_method 11th, now lands on use_fp64_gumbel: refused, not misread
    with pytest.raises(ValueError, match="rejection_sample: use_fp64_gumbel: expected a bool"):
        vllm.rejection_sample(*args, False, None, "block")


def test_bad_arguments_raise_value_errors_naming_them():
    x, logits, bonus = torch.tensor([1, 2], dtype=torch.int32), torch.zeros(2, V), torch.tensor([[0]])
    cases = [
        (dict(num_draft_tokens=[3]), "num_draft_tokens"),
        (dict(draft_token_ids=torch.tensor([1.0, 2.0])), "draft_token_ids"),
        (dict(draft_probs=torch.zeros(2, V + 1)), "draft_probs"),
        (dict(bonus_token_ids=torch.tensor([[0], [1]])), "bonus_token_ids"),
        (dict(verify_method="tree"), "verify_method"),
    ]
    for change, name in cases:
        kw = dict(draft_token_ids=x, num_draft_tokens=[2], max_spec_len=2, cu_num_draft_tokens=torch.tensor([2]),
                  draft_probs=None, target_logits=logits, bonus_token_ids=bonus, sampling_metadata=metadata())
        kw.update(change)
        with pytest.raises(ValueError, match=f"rejection_sample: {name}"):
            vllm.rejection_sample(**kw)


def test_a_flattened_layout_that_hands_a_request_other_requests_rows_is_a_value_error():
    """``cu_num_draft_tokens`` that disagrees with ``num_draft_tokens`` (or does not end at T) would give a request
    rows of its neighbours: every function that reads it says so, naming it and the request."""
    x, logits = torch.tensor([1, 2, 3], dtype=torch.int32), torch.zeros(3, V)
    sm = metadata(temperature=torch.ones(2))
    with pytest.raises(ValueError, match=r"rejection_sample: cu_num_draft_tokens: .* \(request 0\)"):
        vllm.rejection_sample(x, [2, 1], 2, torch.tensor([1, 3]), None, logits, torch.tensor([[0], [0]]), sm)
    probs = torch.full((3, V), 1.0 / V)
    with pytest.raises(ValueError, match=r"sample_recovered_tokens: cu_num_draft_tokens: .* \(request 1\)"):
        vllm.sample_recovered_tokens(2, [2, 1], torch.tensor([2, 2]), x, None, probs, sm, "cpu")
    with pytest.raises(ValueError, match="sample_recovered_tokens: num_draft_tokens"):
        vllm.sample_recovered_tokens(2, [2, 2], torch.tensor([2, 4]), x, None, probs, sm, "cpu")
    with pytest.raises(ValueError, match=r"apply_sampling_constraints: cu_num_draft_tokens: .* \(request 1\)"):
        vllm.apply_sampling_constraints(logits.clone(), torch.tensor([2, 1]), sm)
    with pytest.raises(ValueError, match="apply_sampling_constraints: cu_num_draft_tokens: expected a last value"):
        vllm.apply_sampling_constraints(logits.clone(), torch.tensor([1, 2]), sm)


def test_sampling_constraints_reach_each_draft_row_of_its_own_request_around_requests_without_drafts():
    logits = torch.ones(3, V)
    sm = metadata(temperature=torch.tensor([2.0, 100.0, 0.5, 10.0]))
    out = vllm.apply_sampling_constraints(logits, torch.tensor([0, 2, 2, 3]), sm)  # drafts: 0, 2, 0, 1
    assert torch.allclose(out[:, 0], torch.tensor([0.01, 0.01, 0.1]))


# ------------------------------------------------------------------------------------- block verification helpers


def block_inputs(counts, V=5, seed=0):
    """Random drafts of ``counts`` per request in vLLM's flat layout, their draft and target rows."""
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    q = torch.softmax(2 * torch.randn(T, V, generator=g), -1)
    p = torch.softmax(2 * torch.randn(T, V, generator=g), -1)
    x = torch.multinomial(q, 1, generator=g)[:, 0] if T else torch.zeros(0, dtype=torch.int64)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    return cu, x, q, p, g


def block_verify(cu, x, q, p, bonus, recovered, u, is_greedy, K, out=None):
    out = torch.full((len(cu), K + 1), -1, dtype=torch.int32) if out is None else out
    vllm.rejection_random_sample_block_verify_pytorch(out, cu, x, q, p, bonus, recovered, u, is_greedy, K, p.shape[1])
    return out


def loop_block_verify(counts, x, q, p, bonus, recovered, u, K):
    """Block verification per request, written from its definition (float64): a_{i+1} = min(1, a_i p/q) (0 for
    q(x) = 0), h_i = S_i / (S_i + 1 - a_i) with S_i the mass of max(a_i p_i - q_i, 0) for 0 < i < n, h_n = a_n;
    tau = the largest i with u_{i-1} <= h_i (h_i > 0); the accepted drafts, then the recovered token or the bonus."""
    out = []
    start = 0
    for b, n in enumerate(counts):
        a, h = [1.0], [1.0]
        for i in range(n):
            px, qx = float(p[start + i, x[start + i]]), float(q[start + i, x[start + i]])
            a.append(min(1.0, a[i] * px / qx) if qx > 0 else 0.0)
        for i in range(1, n):
            s = float((a[i] * p[start + i].double() - q[start + i].double()).clamp(min=0).sum())
            h.append(s / (s + 1 - a[i]) if s + 1 - a[i] > 0 else 0.0)
        h.append(a[n]) if n else None
        tau = max(i for i in range(n + 1) if i == 0 or 0 < h[i] >= float(u[start + i - 1]))
        row = [int(t) for t in x[start:start + tau]] + [int(recovered[start + tau]) if tau < n else int(bonus[b])]
        out.append(row + [-1] * (K + 1 - len(row)))
        start += n
    return out


def test_block_verification_keeps_the_drafts_its_definition_keeps_in_ragged_batches():
    counts = [3, 0, 1, 4, 2]
    cu, x, q, p, g = block_inputs(counts)
    T, K = len(x), max(counts)
    bonus, recovered = torch.randint(5, (5, 1), generator=g), torch.randint(5, (T,), generator=g)
    for trial in range(20):
        u = torch.rand(T, generator=g, dtype=torch.float64)
        got = block_verify(cu, x, q, p, bonus, recovered, u, torch.zeros(5, dtype=torch.bool), K)
        assert got.tolist() == loop_block_verify(counts, x, q, p, bonus[:, 0], recovered, u, K), trial


def test_block_verification_accepts_at_a_uniform_equal_to_its_threshold_and_rejects_a_draft_of_probability_0():
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    p = torch.tensor([[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]])
    x, cu = torch.tensor([0, 0]), torch.tensor([1, 2])
    bonus, recovered = torch.tensor([[7], [8]]), torch.tensor([5, 6])
    out = block_verify(cu, x, q, p, bonus, recovered, torch.tensor([0.5, 0.0]), None, 1)
    # request 0: h_1 = a_1 = 0.25 / 0.5 = 0.5 and u = 0.5: vLLM's `u <= h` accepts; request 1: q(x) = 0, so
    # a_1 = h_1 = 0: rejected even at u = 0 (where vLLM accepts it)
    assert out.tolist() == [[0, 7], [6, -1]]


def test_block_verification_writes_only_sampled_requests_that_own_rows():
    counts = [2, 1]
    cu, x, q, p, g = block_inputs(counts)
    bonus, recovered, u = torch.tensor([[7], [8], [9]]), torch.tensor([1, 2, 3]), torch.zeros(3)
    out = torch.full((3, 3), -5, dtype=torch.int32)
    # request 1 is greedy (the greedy kernel's); request 2's cu (2) lies below request 0's (2 rows then 3): no rows
    block_verify(torch.tensor([2, 3, 2]), x, q, p, bonus, recovered, u, torch.tensor([False, True, False]), 2, out)
    assert out[1].tolist() == [-5, -5, -5] and out[2].tolist() == [-5, -5, -5]
    assert out[0].tolist() == loop_block_verify([2], x[:2], q[:2], p[:2], bonus[:1, 0], recovered[:2], u[:2], 2)[0]


@pytest.mark.parametrize("helper", ["acceptance", "recovered"])
def test_block_helpers_compute_each_request_from_its_own_rows(helper):
    """Changing every other request's rows (drafts, probabilities, uniforms, recovered ids) leaves a request's
    outputs unchanged, around requests without drafts."""
    counts = [2, 0, 3, 1]
    cu, x, q, p, g = block_inputs(counts, seed=4)
    T, K, B = len(x), max(counts), len(counts)
    bonus, recovered = torch.randint(5, (B, 1), generator=g), torch.randint(5, (T,), generator=g)
    u, e = torch.rand(T, generator=g, dtype=torch.float64), torch.empty(B, 5).exponential_(generator=g)

    def run(x, q, p, recovered, u):
        if helper == "acceptance":
            return block_verify(cu, x, q, p, bonus, recovered, u, None, K)
        out = torch.full((T,), -1, dtype=torch.int32)
        vllm.sample_recovered_tokens_blockwise_pytorch(out, cu, x, q, p, e, 5)
        return out

    base = run(x, q, p, recovered, u)
    starts = [0, *np.cumsum(counts)[:-1].tolist()]
    for b, (s, n) in enumerate(zip(starts, counts)):
        other = torch.ones(T, dtype=torch.bool)
        other[s:s + n] = False
        _, x2, q2, p2, g2 = block_inputs(counts, seed=10 + b)
        mixed = [torch.where(other if t.dim() == 1 else other[:, None], t2, t) for t, t2 in
                 ((x, x2), (q, q2), (p, p2), (recovered, torch.randint(5, (T,), generator=g2)),
                  (u, torch.rand(T, generator=g2, dtype=torch.float64)))]
        again = run(*mixed)
        if helper == "acceptance":
            assert torch.equal(again[b], base[b]), b
        else:
            assert torch.equal(again[s:s + n], base[s:s + n]), b


def test_blockwise_recovered_tokens_are_the_argmax_of_the_scaled_residual_over_the_exponentials():
    counts = [3, 2]
    cu, x, q, p, g = block_inputs(counts, seed=2)
    e = torch.empty(2, 5).exponential_(generator=g)
    out = torch.full((5,), -1, dtype=torch.int32)
    vllm.sample_recovered_tokens_blockwise_pytorch(out, cu, x, q, p, e, 5)
    expected, start = [], 0
    for b, n in enumerate(counts):
        a = 1.0
        for i in range(n):
            r = start + i
            expected.append(int(((a * p[r] - q[r]).clamp(min=0) / e[b]).argmax()))
            a = min(1.0, a * float(p[r, x[r]]) / float(q[r, x[r]]))
        start += n
    assert out.tolist() == expected


@pytest.mark.montecarlo
def test_block_helpers_emit_what_block_verification_emits():
    """The two helpers together (vLLM's uniforms and exponentials) emit each sequence with the probability
    the oracle gives block verification of the same drafts."""
    trials, K, V = mc_trials(200_000, 20_000), 3, 4
    g = torch.Generator().manual_seed(9)
    p = torch.softmax(2 * torch.randn(K + 1, V, generator=g, dtype=torch.float64), -1).float()
    q = torch.softmax(2 * torch.randn(K, V, generator=g, dtype=torch.float64), -1).float()
    drafts = (1, 3, 0)
    exact = {}
    for seq, prob, _ in oracle.chain_given_drafts("block", drafts, list(p.double().numpy()), list(q.double().numpy())):
        exact[seq] = exact.get(seq, 0.0) + prob
    x = torch.tensor(drafts).repeat(trials)
    qs, ps = q.repeat(trials, 1), p[:K].repeat(trials, 1)
    cu = torch.arange(1, trials + 1) * K
    recovered = torch.empty(trials * K, dtype=torch.int64)
    vllm.sample_recovered_tokens_blockwise_pytorch(recovered, cu, x, qs, ps, torch.empty(trials, V).exponential_(), V)
    bonus = torch.multinomial(p[K].double(), trials, replacement=True)[:, None]
    out = block_verify(cu, x, qs, ps, bonus, recovered, torch.rand(trials * K, dtype=torch.float64), None, K)
    counts = {}
    for row in out.tolist():
        seq = tuple(t for t in row if t != -1)
        counts[seq] = counts.get(seq, 0) + 1
    keys = sorted(set(exact) | set(counts))
    assert_counts_match(np.array([counts.get(k, 0) for k in keys]), np.array([exact.get(k, 0.0) for k in keys]),
                        label="block helpers")
