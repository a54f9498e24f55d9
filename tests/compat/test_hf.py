"""specsampler.compat.hf: transformers' speculative sampling, and its assisted generation patched."""

import inspect
import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from specsampler.modelpair import load_pair  # noqa: E402
from stats import assert_counts_match  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation import utils as hf_utils  # noqa: E402

from conftest import mc_trials  # noqa: E402
from specsampler import oracle  # noqa: E402
from specsampler.compat.hf import patched, speculative_sampling  # noqa: E402

ORIGINAL = hf_utils._speculative_sampling


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP barriers cost milliseconds on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def inputs(p, q, drafts, prompt=(7, 7)):
    """transformers' arguments for target rows ``p [K+1, V]``, draft rows ``q [K, V]`` and the drafts."""
    ids = torch.tensor([list(prompt) + list(drafts)])
    return ids, q.log()[None], len(drafts), p.log()[None]


# ------------------------------------------------------------------------------------- the function


def test_accepts_drafts_the_target_is_sure_of_and_corrects_an_impossible_one():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.0, 0.5]])
    tokens, n = speculative_sampling(*inputs(p, q, [1, 0]))
    assert tokens.tolist() == [[1, 2]] and tokens.dtype == torch.int64
    assert n.dim() == 0 and n.dtype == torch.int64 and int(n) == 1


def test_all_accepted_draws_the_bonus_unless_the_last_candidate_ends_generation():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    tokens, n = speculative_sampling(*inputs(p, q, [1, 2]))
    assert tokens.tolist() == [[1, 2, 0]] and int(n) == 2
    tokens, n = speculative_sampling(*inputs(p, q, [1, 2]), is_done_candidate=True)  # transformers <= 5.17
    assert tokens.tolist() == [[1, 2]] and int(n) == 1


def test_older_releases_is_done_candidate_is_read_by_keyword_or_as_a_bool_in_fifth_place():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    args = inputs(p, q, [1, 2])
    # 4.56-5.13 pass it fifth by position (a bool tensor from the stopping criteria), 5.14-5.17 tests by keyword
    for call in (lambda: speculative_sampling(*args, True), lambda: speculative_sampling(*args, torch.tensor([True])),
                 lambda: speculative_sampling(*args, is_done_candidate=True, assistant_ensemble_weight=None)):
        tokens, n = call()
        assert tokens.tolist() == [[1, 2]] and int(n) == 1
    assert speculative_sampling(*args, False)[0].tolist() == [[1, 2, 0]]


@pytest.mark.skipif("is_done_candidate" in inspect.signature(ORIGINAL).parameters,
                    reason="this transformers passes is_done_candidate fifth (before 5.18)")
def test_the_newest_releases_positional_weight_is_the_ensemble_weight():
    """transformers 5.18+ takes ``assistant_ensemble_weight`` fifth: a positional weight verifies with the ensemble
    as transformers' own function does (read as ``is_done_candidate`` it would verify losslessly)."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    q = torch.softmax(torch.randn(3, 6, generator=g), -1)
    args = inputs(p, q, [2, 0, 5])
    assert list(inspect.signature(speculative_sampling).parameters)[:5] == list(inspect.signature(ORIGINAL).parameters)
    for seed in range(20):
        torch.manual_seed(seed)
        ours = speculative_sampling(*args, 0.6)
        torch.manual_seed(seed)
        theirs = ORIGINAL(*args, 0.6)
        assert ours[0].tolist() == theirs[0].tolist() and int(ours[1]) == int(theirs[1]), seed


def test_low_precision_logits_draw_the_correction_with_float32_uniforms(monkeypatch):
    """bfloat16 logits: the bonus token is drawn by inversion of a float32 uniform (a bfloat16 one, on a grid of
    2**-8 in [0.5, 1), made the emitted token's law coarse: a chi-square p-value of 1e-26 on 8000 draws). At a
    uniform just above an edge between two tokens that bfloat16 rounds below it, the token above is drawn."""
    V = 16
    bonus = torch.full((V,), 0.1 / 15)
    bonus[0] = 0.9
    sure = torch.zeros(V)
    sure[3] = 10.0
    nl = torch.stack([sure, bonus.log()])[None].bfloat16()
    cl = sure[None, None].bfloat16()
    edges = nl[0, 1].float().softmax(-1).cumsum(0).tolist()
    # the first edge a uniform just above it (on token j + 1) leaves, rounded to bfloat16, for token j
    j, u = next((j, e + 1e-5) for j, e in enumerate(edges[:-2]) if float(torch.tensor(e + 1e-5).bfloat16()) < e)
    monkeypatch.setattr(torch, "rand_like", lambda t: torch.full_like(t, u))
    tokens, n = speculative_sampling(torch.tensor([[1, 2, 3]]), cl, 1, nl)
    assert tokens.tolist() == [[3, j + 1]] and int(n) == 1


def test_full_validation_names_bad_logits_and_candidates_and_the_default_stays_in_range():
    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    ids, cl, k, nl = inputs(p, q, [1, 2])
    nan, inf, empty = nl.clone(), cl.clone(), nl.clone()
    nan[0, 1, 2], inf[0, 0, 1], empty[0, 2] = float("nan"), float("inf"), float("-inf")
    cases = [((ids, cl, k, nan), "new_logits: expected logits without NaN or \\+inf, got nan"),
             ((ids, inf, k, nl), "candidate_logits: expected logits without NaN or \\+inf, got inf"),
             ((ids, cl, k, empty), "new_logits: expected rows holding a finite logit"),
             ((torch.tensor([[7, 7, 1, 4]]), cl, k, nl), r"candidate_input_ids: expected candidates in \[0, 4\)"),
             ((torch.tensor([[7, 7, -1, 2]]), cl, k, nl), r"candidate_input_ids: expected candidates in \[0, 4\)")]
    for args, message in cases:
        with pytest.raises(ValueError, match="speculative_sampling: " + message):
            speculative_sampling(*args, validate="full")
        tokens, n = speculative_sampling(*args)  # "structure": a token in range, whatever the values
        assert tokens.shape == (1, int(n) + 1) and bool(((tokens >= 0) & (tokens < 4)).all())


def test_no_candidate_draws_the_bonus_even_when_the_candidates_would_end_generation():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    for done in (False, True):
        for weight in (None, 0.5):
            tokens, n = speculative_sampling(torch.tensor([[7, 7]]), torch.zeros(1, 0, 3), 0, p.log()[None], weight,
                                             is_done_candidate=done)
            assert tokens.tolist() == [[2]] and int(n) == 0


def test_a_one_value_mock_of_rand_like_pins_every_acceptance_test(monkeypatch):
    """transformers compares ``rand_like``'s result to the K ratios by broadcasting, so its tests may mock it with
    one value: the same value then tests every draft here (it raised on the shape)."""
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    for shape in ((), (1,)):
        monkeypatch.setattr(torch, "rand_like", lambda t, shape=shape: torch.full(shape, 0.6))
        tokens, n = speculative_sampling(*inputs(p, q, [1, 2, 1]))  # 0.6 * 1 < 0.5 fails: the third is rejected
        assert tokens.tolist() == [[1, 2, 0]] and int(n) == 2


def test_an_ensemble_weight_of_one_verifies_as_none_and_weights_outside_zero_one_raise():
    g = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(3, 5, generator=g), -1)
    q = torch.softmax(torch.randn(2, 5, generator=g), -1)
    args = inputs(p, q, [4, 1])
    for seed in range(10):
        torch.manual_seed(seed)
        plain = speculative_sampling(*args)
        torch.manual_seed(seed)
        one = speculative_sampling(*args, 1.0)
        assert plain[0].tolist() == one[0].tolist()
    for bad in (0.0, -0.5, 1.5, float("nan"), "0.5", torch.tensor([0.5, 0.5])):
        with pytest.raises(ValueError, match="speculative_sampling: assistant_ensemble_weight: expected a weight"):
            speculative_sampling(*args, bad)
    with pytest.raises(ValueError, match="expected a weight in \\(0, 1\\] or None, got '0.5'"):  # quoted: a str
        speculative_sampling(*args, "0.5")
    # any real number, as transformers' GenerationConfig takes it (numpy's float32 was refused)
    for weight in (np.float32(0.6), torch.tensor(0.6)):
        torch.manual_seed(3)
        ours = speculative_sampling(*args, weight)
        torch.manual_seed(3)
        assert ours[0].tolist() == speculative_sampling(*args, float(weight))[0].tolist()


def emitted_counts(verify, p, q, drafts, trials):
    counts = {}
    for _ in range(trials):
        seq = tuple(verify(*inputs(p, q, drafts))[0][0].tolist())
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def check_against_oracle(counts, exact, label):
    keys = sorted(set(exact) | set(counts))
    assert_counts_match(np.array([counts.get(k, 0) for k in keys]), np.array([exact.get(k, 0.0) for k in keys]),
                        label=label)


@pytest.mark.montecarlo
@pytest.mark.parametrize("method", ["token", "block"])
def test_emitted_sequences_follow_the_oracle(method):
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(2 * torch.randn(3, 4, generator=g, dtype=torch.float64), -1).float()
    q = torch.softmax(2 * torch.randn(2, 4, generator=g, dtype=torch.float64), -1).float()
    drafts = (1, 3)
    exact = {}
    for seq, prob, _ in oracle.chain_given_drafts(method, drafts, list(p.double().numpy()), list(q.double().numpy())):
        exact[seq] = exact.get(seq, 0.0) + prob
    trials = mc_trials(40_000, 1_500)
    torch.manual_seed(0)
    if method == "token":
        counts = emitted_counts(speculative_sampling, p, q, drafts, trials)
    else:
        with patched("block"):
            counts = emitted_counts(hf_utils._speculative_sampling, p, q, drafts, trials)
    check_against_oracle(counts, exact, method)


@pytest.mark.skipif("assistant_ensemble_weight" not in inspect.signature(ORIGINAL).parameters,
                    reason="this transformers has no ensemble verification")
def test_the_lossy_ensemble_draws_what_transformers_draws():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)
    q = torch.softmax(torch.randn(3, 6, generator=g), -1)
    args = inputs(p, q, [2, 0, 5])
    for seed in range(20):
        torch.manual_seed(seed)
        ours = speculative_sampling(*args, assistant_ensemble_weight=0.6)
        torch.manual_seed(seed)
        theirs = ORIGINAL(*args, assistant_ensemble_weight=0.6)
        assert ours[0].tolist() == theirs[0].tolist() and int(ours[1]) == int(theirs[1])


def test_the_acceptance_tests_use_transformers_source_of_uniforms(monkeypatch):
    """The lossless path draws its uniforms with ``torch.rand_like``, as transformers does, so a test that pins
    them (transformers' own tests mock ``rand_like``) pins our decisions: draft 1 (p/q = 0.5) is rejected at
    u = 0.6 and accepted at u = 0.4, whatever the global generator says."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.8, 0.1, 0.05, 0.05]])
    for u, accepted in ((0.6, 0), (0.4, 1)):
        monkeypatch.setattr(torch, "rand_like", lambda t, u=u: torch.full_like(t, u))
        runs = {int(speculative_sampling(*inputs(p, q, [0]))[1]) for _ in range(8)}
        assert runs == {accepted}


def test_the_triton_path_draws_the_torch_paths_tokens(monkeypatch):
    g = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(3, 8, generator=g), -1)
    q = torch.softmax(torch.randn(2, 8, generator=g), -1)
    args = inputs(p, q, [3, 6])
    results = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SPECSAMPLER_BACKEND", backend)
        torch.manual_seed(1)
        results.append([speculative_sampling(*args)[0].tolist() for _ in range(3)])
    assert results[0] == results[1]


def test_bad_arguments_raise_value_errors_naming_them():
    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    ids, cl, k, nl = inputs(p, q, [1, 2])
    with pytest.raises(ValueError, match="speculative_sampling: candidate_input_ids: expected batch size 1"):
        speculative_sampling(ids.expand(2, -1), cl.expand(2, -1, -1), k, nl.expand(2, -1, -1))
    # every tensor's batch and the vocabularies are checked, with or without an ensemble weight (a second row of
    # logits was read as the first's, silently, with one)
    for weight in (None, 0.5):
        with pytest.raises(ValueError, match="speculative_sampling: candidate_logits: expected batch size 1"):
            speculative_sampling(ids, cl.expand(2, -1, -1), k, nl, weight)
        with pytest.raises(ValueError, match="speculative_sampling: new_logits: expected batch size 1"):
            speculative_sampling(ids, cl, k, nl.expand(2, -1, -1), weight)
        with pytest.raises(ValueError, match=r"speculative_sampling: candidate_logits: expected the vocabulary of "
                           r"new_logits \(4 logits a row\), got 5"):
            speculative_sampling(ids, torch.zeros(1, 2, 5), k, nl, weight)
    with pytest.raises(ValueError, match="speculative_sampling: candidate_length"):
        speculative_sampling(ids, cl, 3, nl)
    # not an integer: transformers fails in a slice; int() read 2.5 as 2 and "3" as 3
    for bad in (2.5, "2", True, torch.tensor([1, 2])):
        with pytest.raises(ValueError, match=r"speculative_sampling: candidate_length: expected an integer, got"):
            speculative_sampling(ids, cl, bad, nl)
    tokens, n = speculative_sampling(ids, cl, np.int64(2), nl)
    assert tokens.shape[1] == int(n) + 1
    with pytest.raises(ValueError, match="speculative_sampling: validate"):
        speculative_sampling(ids, cl, k, nl, validate="values")
    with pytest.raises(ValueError, match="patched: method"), patched("rrs"):
        pass
    with patched("block"), pytest.raises(ValueError, match="assistant_ensemble_weight"):
        hf_utils._speculative_sampling(ids, cl, k, nl, assistant_ensemble_weight=0.5)


# ------------------------------------------------------------------------------------- patched generate


def test_patched_takes_the_installed_releases_argument_order(monkeypatch):
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    args = inputs(p, q, [1, 2])
    with patched("block"):
        assert list(inspect.signature(hf_utils._speculative_sampling).parameters)[:5] == list(
            inspect.signature(ORIGINAL).parameters)[:5]

    def before_5_18(candidate_input_ids, candidate_logits, candidate_length, new_logits, is_done_candidate,
                    assistant_ensemble_weight=None):
        raise AssertionError("replaced")

    monkeypatch.setattr(hf_utils, "_speculative_sampling", before_5_18)
    with patched("block"):  # 5.14-5.17 call it with is_done_candidate fifth and the weight by keyword
        tokens, n = hf_utils._speculative_sampling(*args, torch.tensor([True]), assistant_ensemble_weight=None)
        assert tokens.tolist() == [[1, 2]] and int(n) == 1
    assert hf_utils._speculative_sampling is before_5_18


def test_patched_restores_transformers_on_exit_and_on_exceptions():
    with patched("block"):
        assert hf_utils._speculative_sampling is not ORIGINAL
    assert hf_utils._speculative_sampling is ORIGINAL
    with pytest.raises(RuntimeError, match="inside"), patched("token"):
        raise RuntimeError("inside")
    assert hf_utils._speculative_sampling is ORIGINAL


@pytest.fixture(scope="module")
def pair():
    target, draft, tokenizer = load_pair()
    return target, draft, torch.tensor([tokenizer.encode("    def __init__(self, ")])


def test_greedy_assisted_generation_is_unchanged(pair):
    target, draft, prompt = pair
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain = target.generate(prompt, **kw)
    assisted = target.generate(prompt, assistant_model=draft, **kw)
    with patched("block"):
        inside = target.generate(prompt, assistant_model=draft, **kw)
    assert torch.equal(plain, assisted) and torch.equal(assisted, inside)


def tiny_llama(seed: int, scale: float) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def exact_first_tokens(model, prompt: torch.Tensor, steps: int) -> dict:
    """The model's exact joint distribution of its first ``steps`` sampled tokens (temperature 1)."""
    V = model.config.vocab_size
    out = {}
    for seq in itertools.product(range(V), repeat=steps):
        ids = torch.cat([prompt[0], torch.tensor(seq[:-1], dtype=torch.long)])[None]
        with torch.no_grad():
            probs = torch.softmax(model(ids).logits[0, -steps:].double(), -1)
        out[seq] = float(np.prod([probs[i, t] for i, t in enumerate(seq)]))
    return out


@pytest.mark.montecarlo
@pytest.mark.parametrize("method", ["token", "block"])
def test_sampled_assisted_generation_follows_the_target(method):
    """The first two tokens of patched assisted generation are drawn from the target's own joint."""
    target, draft = tiny_llama(0, 4.0), tiny_llama(1, 4.0)
    prompt = torch.tensor([[1, 4, 2]])
    config = GenerationConfig(do_sample=True, max_new_tokens=3, num_assistant_tokens=2, top_k=0,
                              num_assistant_tokens_schedule="constant", pad_token_id=0)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[2])
        return verify(*args, **kwargs)

    trials = mc_trials(20_000, 200)
    counts = {}
    torch.manual_seed(7)
    with patched(method):
        verify = hf_utils._speculative_sampling
        hf_utils._speculative_sampling = spy
        for _ in range(trials):
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=draft,
                                  generation_config=config)
            seq = tuple(out[0, 3:5].tolist())
            counts[seq] = counts.get(seq, 0) + 1
    assert hf_utils._speculative_sampling is ORIGINAL and len(calls) >= trials
    check_against_oracle(counts, exact_first_tokens(target, prompt, 2), f"assisted generate, {method}")
