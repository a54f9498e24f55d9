"""End-to-end speculative generation with tiny random transformers models (no downloads)."""

import importlib
import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from stats import assert_counts_match  # noqa: E402
from tiny_models import noisy_copy, sharp_pair, tiny_llama  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import specsampler as ss  # noqa: E402
from conftest import mc_trials  # noqa: E402
from specsampler.generate import generate, speculative_generate  # noqa: E402

GREEDY = ss.SamplingParams(temperature=0.0)
SETUPS = [  # (drafter, draft_sampling, method, tree_shape)
    ("chain", "iid", "token", None),
    ("chain", "iid", "block", None),
    ("chain", "deterministic", "target_only", None),
    ("chain", "iid", "greedy", None),
    ("tree", "iid", "rrs", [2, 2, 1]),
    ("tree", "without_replacement", "rrs", [3, 2]),
    ("tree", "iid", "traversal", [2, 1, 1]),
    ("tree", "without_replacement", "traversal", [2, 2]),
    ("tree", "deterministic", "target_only", [3, 2, 1]),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP barriers cost milliseconds on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    return sharp_pair()  # sharp next-token distributions, so that a noisy copy agrees often


def hf_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[0]:].tolist()


@pytest.mark.parametrize("drafter,how,method,shape", SETUPS)
def test_greedy_output_equals_the_targets_own_greedy_generate(pair, drafter, how, method, shape):
    target, draft = pair
    prompt = torch.tensor([5, 17, 3, 30, 11, 2, 41])
    expected = hf_greedy(target, prompt, 40)
    out = speculative_generate(target, draft, prompt, 40, GREEDY, drafter=drafter, draft_sampling=how,
                               method=method, tree_shape=shape, num_draft_tokens=3, rng=ss.Philox(3))
    assert out.tokens.tolist() == expected
    accepted = [a for step in out.stats.accepted_per_step for a in step]
    depth = out.stats.draft_depth
    assert any(0 < a < depth for a in accepted) or (0 in accepted and depth in accepted), accepted
    assert out.stats.target_calls == len(out.stats.accepted_per_step) + 1  # steps + the prefill
    assert out.stats.tokens_per_target_call == pytest.approx(40 / out.stats.target_calls)


@pytest.mark.parametrize("method", ["target_only", "greedy"])
def test_ngram_greedy_output_equals_the_targets_own_greedy_generate(pair, method):
    target, _ = pair
    prompt = torch.tensor([5, 17, 3, 30, 11, 2, 41])
    expected = hf_greedy(target, prompt, 60)
    out = speculative_generate(target, None, prompt, 60, GREEDY, drafter="ngram", method=method, num_draft_tokens=3)
    assert out.tokens.tolist() == expected
    assert sum(map(sum, out.stats.accepted_per_step)) > 0  # looked-up continuations were accepted
    assert out.stats.target_calls == len(out.stats.accepted_per_step) + 1 < 60 and out.stats.draft_calls == 0


def test_plain_generate_at_temperature_0_is_hf_greedy(pair):
    target, _ = pair
    prompt = torch.tensor([1, 2, 3])
    out = generate(target, prompt, 25, GREEDY)
    assert out.tokens.tolist() == hf_greedy(target, prompt, 25)
    assert out.stats.target_calls == 25 and out.stats.tokens_per_target_call == 1.0


def test_self_drafting_accepts_every_draft(pair):
    target, _ = pair
    out = speculative_generate(target, target, torch.tensor([4, 4, 9]), 21, GREEDY, drafter="tree",
                               draft_sampling="deterministic", tree_shape=[2, 1, 1, 1])
    assert out.stats.accepted_per_step == [[4]] * 4
    assert out.stats.acceptance_rate == 1.0 and out.stats.target_calls == 5
    assert out.tokens.tolist() == hf_greedy(target, torch.tensor([4, 4, 9]), 21)


def test_accepted_drafts_count_only_the_tokens_a_request_took(pair):
    # drafts accepted past max_new_tokens (or after an EOS), scored at a clamped position and never emitted, were
    # counted: [[4]] and an acceptance rate of 1 for a step that emitted one token
    target, _ = pair
    prompt = torch.tensor([4, 4, 9])
    for new, counted in ((2, [[1]]), (4, [[3]]), (6, [[4]])):
        out = speculative_generate(target, target, prompt, new, GREEDY, num_draft_tokens=4)
        assert out.stats.accepted_per_step == counted and out.lengths.tolist() == [new]
    eos = hf_greedy(target, prompt, 3)[1]  # the second token: the step's first draft, accepted
    out = speculative_generate(target, target, prompt, 20, GREEDY, num_draft_tokens=4, eos_token_id=eos)
    assert out.lengths.tolist() == [2] and out.stats.accepted_per_step == [[1]]


def test_no_draft_call_when_the_first_token_ends_the_generation(pair):
    # the draft was prefilled with no step to draft for (draft_calls 1 at max_new_tokens 1)
    target, draft = pair
    calls = []
    hook = draft.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        prompt = torch.tensor([4, 4, 9])
        out = speculative_generate(target, draft, prompt, 1, GREEDY)
        first = hf_greedy(target, prompt, 1)[0]
        ended = speculative_generate(target, draft, prompt, 8, GREEDY, eos_token_id=first)
    finally:
        hook.remove()
    assert calls == [] and out.stats.draft_calls == ended.stats.draft_calls == 0
    assert out.stats.target_calls == ended.stats.target_calls == 1 and ended.lengths.tolist() == [1]


def test_a_draft_of_another_vocabulary_is_named_before_a_model_runs(pair):
    # only the first step's logits were compared: a token of one model's vocabulary could reach the other's
    # embedding first, an IndexError named as a position past the model's table, depending on the seed
    target, _ = pair
    for V in (40, 60):
        other = tiny_llama(V, 1, 16, seed=3)
        hooks = [m.register_forward_pre_hook(lambda *_: pytest.fail("a model ran")) for m in (target, other)]
        try:
            for seed in range(4):
                with pytest.raises(ValueError, match=f"speculative_generate: draft: expected a vocabulary of the "
                                                     f"target's size 48, got {V}"):
                    speculative_generate(target, other, torch.tensor([4, 4, 9]), 6,
                                         ss.SamplingParams(temperature=1.0), rng=ss.Philox(seed))
        finally:
            for h in hooks:
                h.remove()


def test_each_step_hands_on_step_its_own_snapshot(pair):
    # every partial output shared the loop's live stats: read after the call, an early one showed the final counts
    target, draft = pair
    seen = []
    out = speculative_generate(target, draft, torch.tensor([4, 4, 9]), 12, GREEDY, on_step=seen.append)
    assert len(seen) == len(out.stats.accepted_per_step) >= 2
    for k, part in enumerate(seen, 1):
        assert part.stats is not out.stats and part.stats.new_tokens == part.lengths.tolist()
        assert part.stats.accepted_per_step == out.stats.accepted_per_step[:k]
        assert part.stats.target_calls == k + 1 and part.stats.draft_calls <= out.stats.draft_calls
    plain = []
    generate(target, torch.tensor([4, 4, 9]), 5, GREEDY, on_step=plain.append)
    assert [p.stats.new_tokens for p in plain] == [[1], [2], [3], [4], [5]]


@pytest.mark.parametrize("drafter,how,shape", [("chain", "iid", None), ("tree", "without_replacement", [2, 2, 1])])
def test_batched_left_padded_prompts_equal_their_runs_alone(pair, drafter, how, shape):
    target, draft = pair
    prompts = [[3, 8, 1, 22, 5, 9], [14], [7, 7, 30, 2]]
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    seeds = torch.tensor([10, 11, 12])
    params = ss.SamplingParams(temperature=torch.tensor([0.0, 1.0, 0.7]), top_k=torch.tensor([0, 10, 0]))
    out = speculative_generate(target, draft, ids, 30, params, drafter=drafter, draft_sampling=how,
                               tree_shape=shape, rng=ss.Philox(seeds), attention_mask=mask)
    assert out.tokens.shape == (3, 30) and out.lengths.tolist() == [30, 30, 30]
    assert out.tokens[0].tolist() == hf_greedy(target, torch.tensor(prompts[0]), 30)
    for b, p in enumerate(prompts):
        alone = speculative_generate(target, draft, torch.tensor(p), 30, ss.SamplingParams(
            temperature=float(params.temperature[b]), top_k=int(params.top_k[b])), drafter=drafter,
            draft_sampling=how, tree_shape=shape, rng=ss.Philox(int(seeds[b])))
        assert out.tokens[b].tolist() == alone.tokens.tolist(), b


def test_eos_ends_a_request_and_pads_with_minus_one(pair):
    target, draft = pair
    prompt = torch.tensor([5, 17, 3, 30, 11, 2, 41])
    greedy = hf_greedy(target, prompt, 30)
    eos = greedy[12]
    out = speculative_generate(target, draft, torch.stack([prompt, prompt]), 30, GREEDY, eos_token_id=eos)
    end = greedy.index(eos) + 1
    assert out.lengths.tolist() == [end, end]
    assert out.tokens[0].tolist() == greedy[:end]
    plain = generate(target, prompt, 30, GREEDY, eos_token_id=[eos])
    assert plain.tokens.tolist() == greedy[:end]


def test_max_new_tokens_zero_and_one(pair):
    target, draft = pair
    prompt = torch.tensor([1, 2])
    assert speculative_generate(target, draft, prompt, 0, GREEDY).tokens.tolist() == []
    one = speculative_generate(target, draft, prompt, 1, GREEDY)
    assert one.tokens.tolist() == hf_greedy(target, prompt, 1) and one.stats.target_calls == 1


def test_outputs_are_ordinary_tensors_though_the_loop_runs_in_inference_mode(pair):
    target, draft = pair
    prompt = torch.tensor([[1, 2, 3]])
    for out in (speculative_generate(target, draft, prompt, 4, GREEDY), generate(target, prompt, 4, GREEDY)):
        assert not out.tokens.is_inference() and not out.lengths.is_inference()
        out.tokens[0, 0] = 7  # an in-place write outside inference mode: refused on an inference tensor


def test_bad_arguments_raise_value_errors_naming_them(pair):
    target, draft = pair
    prompt = torch.tensor([1, 2])
    cases = [
        (dict(drafter="beam"), "drafter"),
        (dict(draft_sampling="topk"), "draft_sampling"),
        (dict(method="rrs"), "method"),  # a tree method for the chain drafter
        (dict(draft_sampling="deterministic", method="token"), "method"),
        (dict(method="target_only"), "draft_sampling"),
        (dict(drafter="tree", tree_shape=[2, 0]), "tree_shape"),
        (dict(tree_shape=[2]), "tree_shape"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(drafter="ngram"), "draft"),  # the n-gram drafter takes no draft model
        (dict(drafter="ngram", draft_sampling="iid"), "draft_sampling"),
        (dict(drafter="ngram", method="token"), "method"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=f"speculative_generate: {name}"):
            speculative_generate(target, draft, prompt, 4, **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, draft, prompt, -1)
    with pytest.raises(ValueError, match="attention_mask: expected left padding"):
        speculative_generate(target, draft, torch.tensor([[1, 2, 0]]), 4, attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="input_ids"):
        speculative_generate(target, draft, torch.tensor([1.0, 2.0]), 4)
    with pytest.raises(ValueError, match="speculative_generate: draft: expected a vocabulary of the target's size"):
        speculative_generate(target, tiny_llama(40, 1, 16, seed=2), prompt, 4)
    with pytest.raises(ValueError, match="speculative_generate: draft: expected None for drafter 'ngram'"):
        speculative_generate(target, None, prompt, 4)
    with pytest.raises(ValueError, match="prompt_lookup_max: expected an int >= 3"):
        speculative_generate(target, None, prompt, 4, drafter="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative_generate: params: expected a SamplingParams"):
        speculative_generate(target, draft, prompt, 4, params={"temperature": 1.0})



@pytest.mark.parametrize("call", ["speculative_generate", "generate"])
def test_bad_prompts_and_rngs_are_named_before_the_model_runs(pair, call):
    # an empty prompt failed in a reshape, ids outside the vocabulary in the model's embedding (IndexError), and an
    # int rng was taken for the global generator
    target, draft = pair
    run = (lambda *a, **k: speculative_generate(target, draft, *a, **k)) if call == "speculative_generate" else (
        lambda *a, **k: generate(target, *a, **k))
    V = target.get_input_embeddings().num_embeddings
    for empty in (torch.zeros(0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=f"{call}: input_ids: expected at least one prompt token"):
            run(empty, 4)
    for bad in (V, -1):
        with pytest.raises(ValueError, match=rf"{call}: input_ids: expected token ids in \[0, {V}\) .*, got {bad} .*"
                                             r"\(request 1\)"):
            run(torch.tensor([[1, 2], [3, bad]]), 4)
    with pytest.raises(ValueError, match=f"{call}: rng: expected None, a torch.Generator or a specsampler.Philox"):
        run(torch.tensor([1, 2]), 4, rng=42)


@pytest.mark.parametrize("call", ["speculative_generate", "generate"])
def test_padding_ids_the_mask_hides_do_not_matter(pair, call):
    # -1 (or any id) in masked left padding reached the model's embedding: IndexError
    target, draft = pair
    run = (lambda *a, **k: speculative_generate(target, draft, *a, **k)) if call == "speculative_generate" else (
        lambda *a, **k: generate(target, *a, **k))
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    outs = [run(torch.tensor([[pad, pad, 5, 9], [3, 8, 1, 22]]), 12, attention_mask=mask,
                rng=ss.Philox(torch.tensor([4, 5]))).tokens for pad in (0, -1, 10**6)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

def test_generation_emits_no_deprecation_warnings_from_transformers(pair):
    """transformers 5 deprecates ``past_key_values`` (for ``cache``): the loop uses what the model declares."""
    import warnings

    target, draft = pair
    prompt = torch.tensor([1, 2, 3, 1, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(target, prompt, 6)
        for drafter in ("chain", "tree", "ngram"):
            speculative_generate(target, None if drafter == "ngram" else draft, prompt, 6, drafter=drafter)
    noisy = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not noisy, [str(w.message) for w in noisy]


def test_compact_kv_moves_dynamic_cache_entries():
    B, H, S, D = 2, 2, 9, 3
    cache = DynamicCache()
    layers = [(torch.randn(B, H, S, D), torch.randn(B, H, S, D)) for _ in range(2)]
    for i, (k, v) in enumerate(layers):
        cache.update(k.clone(), v.clone(), i)
    path, n = torch.tensor([[0, 2, 3], [0, 1, -1]]), torch.tensor([2, 1])
    ss.compact_kv(cache, torch.tensor([4, 4]), path, n)
    expected = [[k.clone(), v.clone()] for k, v in layers]
    for kv in expected:
        for t in kv:
            t[0, :, 5], t[0, :, 6] = t[0, :, 6].clone(), t[0, :, 7].clone()
    got = [(layer.keys, layer.values) for layer in cache.layers] if hasattr(cache, "layers") else list(
        zip(cache.key_cache, cache.value_cache))
    for (k, v), (ek, ev) in zip(got, expected):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def _runner(pair, call):
    target, draft = pair
    if call == "speculative_generate":
        return lambda *a, **k: speculative_generate(target, draft, *a, **k)
    return lambda *a, **k: generate(target, *a, **k)


@pytest.mark.parametrize("call", ["speculative_generate", "generate"])
def test_eos_token_id_takes_any_integer_and_names_anything_else(pair, call):
    # a NumPy integer or a 0-d tensor raised TypeError from list(); so did a float
    run = _runner(pair, call)
    prompt = torch.tensor([5, 17, 3, 30, 11, 2, 41])
    greedy = hf_greedy(pair[0], prompt, 12)
    eos = greedy[5]
    expected = run(prompt, 12, GREEDY, eos_token_id=eos).tokens.tolist()
    assert expected == greedy[: greedy.index(eos) + 1]
    for same in (np.int64(eos), np.int32(eos), torch.tensor(eos), [np.int64(eos)], torch.tensor([eos]),
                 np.array([eos])):
        assert run(prompt, 12, GREEDY, eos_token_id=same).tokens.tolist() == expected, repr(same)
    for bad in (1.5, float(eos), torch.tensor(1.5), torch.tensor(True), True, np.float64(3), "3", [1.5], [True],
                torch.tensor([[eos]]), -1, [eos, -2], object()):
        with pytest.raises(ValueError, match=f"{call}: eos_token_id: expected None, an integer >= 0"):
            run(prompt, 4, eos_token_id=bad)


@pytest.mark.parametrize("call", ["speculative_generate", "generate"])
def test_a_non_callable_on_step_is_named_before_the_model_runs(pair, call):
    # it raised TypeError ("'int' object is not callable") after the prefill and the first step
    calls = []
    handle = pair[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        for bad in (5, "x", [print]):
            with pytest.raises(ValueError, match=f"{call}: on_step: expected None or a callable"):
                _runner(pair, call)(torch.tensor([1, 2]), 4, on_step=bad)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("call", ["speculative_generate", "generate"])
def test_on_step_sees_the_returned_outputs_shape(pair, call):
    # a 1-D prompt's output is [T], yet on_step saw [1, T]
    run = _runner(pair, call)
    for prompt in (torch.tensor([1, 2, 3]), torch.tensor([[1, 2, 3], [4, 5, 6]])):
        seen: list[torch.Tensor] = []
        out = run(prompt, 6, rng=ss.Philox(torch.tensor([1, 2])[: prompt.dim()]),
                  on_step=lambda o, seen=seen: seen.append(o.tokens.clone()))
        assert seen and all(t.dim() == prompt.dim() for t in seen)
        assert torch.equal(seen[-1], out.tokens)


def test_deterministic_tree_wider_than_the_vocabulary_leaves_the_missing_children_out():
    # top-k drafting gave V children where the layout had c > V: a RuntimeError inside the target's forward
    V = 8
    target = tiny_llama(V, 1, 16, seed=0)
    draft = noisy_copy(target, 0.3, seed=1)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    params = ss.SamplingParams(temperature=0.8)
    for method in ("target_only", "greedy"):
        # one level: the V present children are the whole layout of [V], node for node
        exact = speculative_generate(target, draft, prompt, 8, params, drafter="tree", tree_shape=[V],
                                     draft_sampling="deterministic", method=method, rng=ss.Philox(torch.tensor([3, 4])))
        for wide in ([V + 1], [V + 3]):
            out = speculative_generate(target, draft, prompt, 8, params, drafter="tree", tree_shape=wide,
                                       draft_sampling="deterministic", method=method,
                                       rng=ss.Philox(torch.tensor([3, 4])))
            assert out.tokens.tolist() == exact.tokens.tolist(), (method, wide)
            assert out.stats.accepted_per_step == exact.stats.accepted_per_step
        for wide in ([V + 3, 2], [2, V + 1, 1]):  # deeper: the greedy output is the target's own
            for b, row in enumerate(prompt):
                out = speculative_generate(target, draft, row, 10, GREEDY, drafter="tree", tree_shape=wide,
                                           draft_sampling="deterministic", method=method)
                assert out.tokens.tolist() == hf_greedy(target, row, 10), (method, wide, b)
            out = speculative_generate(target, draft, prompt, 8, params, drafter="tree", tree_shape=wide,
                                       draft_sampling="deterministic", method=method,
                                       rng=ss.Philox(torch.tensor([3, 4])))
            assert out.lengths.tolist() == [8, 8] and int(out.tokens.min()) >= 0 and int(out.tokens.max()) < V


def _each_named(runs, message: str) -> None:
    """Each ``(name, call)`` of ``runs`` raises a ValueError matching ``message`` with its ``{name}``."""
    for name, run in runs:
        with pytest.raises(ValueError, match=message.replace("{name}", name)):
            run()


def _sliding(config_class, **window):
    torch.manual_seed(0)
    cfg = config_class(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, bos_token_id=None, eos_token_id=None, pad_token_id=None, **window)
    model = importlib.import_module("transformers").AutoModelForCausalLM.from_config(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharp rows: a text that does not repeat one token
    return model


def test_a_sliding_window_target_gives_its_own_greedy_tokens_past_its_window(pair):
    """The loop's custom mask replaced the model's window: past it, other tokens than the model's own (silently).
    Every layer sliding: the mask applies the window by position, as the model's own does."""
    from transformers import MistralConfig

    windowed = _sliding(MistralConfig, sliding_window=6)
    prompt = torch.tensor([5, 17, 3, 30, 11])
    expected = hf_greedy(windowed, prompt, 16)
    assert generate(windowed, prompt, 16, GREEDY).tokens.tolist() == expected
    for drafter, shape in (("chain", None), ("tree", [2, 2, 1]), ("ngram", None)):
        out = speculative_generate(windowed, None if drafter == "ngram" else windowed, prompt, 16, GREEDY,
                                   drafter=drafter, tree_shape=shape, num_draft_tokens=3)
        assert out.tokens.tolist() == expected, drafter
    target, _ = pair  # a windowed draft proposes within its window; the target decides
    assert speculative_generate(target, windowed, prompt, 12, GREEDY).tokens.tolist() == hf_greedy(target, prompt, 12)


def test_a_target_sliding_beside_full_layers_is_named_past_its_window():
    """One mask cannot slide for some layers and not others: within the window the model's own tokens, past it a
    ``ValueError`` naming the target (the model's own tokens, silently, before)."""
    from transformers import Qwen2Config

    mixed = _sliding(Qwen2Config, use_sliding_window=True, sliding_window=12, max_window_layers=1)
    prompt = torch.tensor([5, 17, 3, 30, 11])
    # positions 0 .. 5 + 8 - 2 give logits that count: 12, the window (drafts past them are fed at the last)
    out = speculative_generate(mixed, mixed, prompt, 8, GREEDY, num_draft_tokens=3)
    assert out.tokens.tolist() == hf_greedy(mixed, prompt, 8)
    past = [("target", lambda: speculative_generate(mixed, mixed, prompt, 9, GREEDY)),
            ("target", lambda: speculative_generate(mixed, None, prompt, 9, GREEDY, drafter="ngram")),
            ("model", lambda: generate(mixed, prompt, 9, GREEDY))]
    _each_named(past, ": {name}: expected attention over the 13 positions")


def test_drafts_past_max_new_tokens_stay_inside_the_position_table():
    # a step's drafts past max_new_tokens (and the tokens of requests ended by EOS that a batch still feeds) ran
    # past GPT-2's learned positions: an IndexError where the target's own generate fits
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=48, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=None,
                     eos_token_id=None, pad_token_id=None)
    target = GPT2LMHeadModel(cfg).double().eval()
    prompt = torch.tensor([5, 17, 3, 30, 11])
    expected = hf_greedy(target, prompt, 12)  # feeds positions up to 15
    for drafter in ("chain", "tree", "ngram"):
        out = speculative_generate(target, None if drafter == "ngram" else target, prompt, 12, GREEDY,
                                   drafter=drafter, num_draft_tokens=4)
        assert out.tokens.tolist() == expected, drafter


def _tiny(config: str, **fields):
    """A tiny random model of a transformers architecture (its config class's name), float64, untied and sharp."""
    transformers = importlib.import_module("transformers")
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(vocab_size=48, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                        tie_word_embeddings=False, **fields)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)  # sharp rows: a text that does not repeat one token
    return model


UNSUPPORTED = {  # config: (tiny fields, what the error says of it)
    "MptConfig": (dict(d_model=16, n_heads=2, n_layers=1, max_seq_len=64), "ALiBi"),
    "BloomConfig": (dict(hidden_size=16, n_layer=1, n_head=2), "ALiBi"),
    "FalconConfig": (dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, alibi=True), "ALiBi"),
    "MambaConfig": (dict(hidden_size=16, num_hidden_layers=1, state_size=4), "a recurrent state"),
    "Lfm2Config": (dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, layer_types=["conv", "full_attention"]), "layers of type 'conv'"),
}


@pytest.mark.parametrize("config", sorted(UNSUPPORTED))
def test_models_the_loop_cannot_score_as_they_score_themselves_are_named_before_they_run(config, pair):
    """ALiBi biases come from cache slots, which the loop keeps where no request uses them (MPT: other tokens than
    its own greedy ones, silently; BLOOM and Falcon failed inside the model); a recurrent state or convolution
    cannot be taken back after rejected drafts (shape and index errors, or other tokens, silently)."""
    fields, why = UNSUPPORTED[config]
    model = _tiny(config, **fields)
    model.register_forward_pre_hook(lambda *_: pytest.fail("the model ran"))
    target, _ = pair
    prompt = torch.tensor([5, 17, 3, 30, 11])
    runs = [("target", lambda: speculative_generate(model, model, prompt, 6, GREEDY)),
            ("target", lambda: speculative_generate(model, None, prompt, 6, GREEDY, drafter="ngram")),
            ("draft", lambda: speculative_generate(target, model, prompt, 6, GREEDY, drafter="tree")),
            ("model", lambda: generate(model, prompt, 6, GREEDY))]
    _each_named(runs, ": {name}: expected a causal LM of attention layers .*, with " + why)


def test_a_model_masking_by_cache_slot_gives_its_own_tokens_or_is_named():
    """GPT-Neo masks by cache slot, where the loop keeps slots that no request uses (drafts not kept, tree
    siblings): past its local layers' window other tokens than its own (silently), past its causal table an error
    inside the model, though every position fit. Now its own tokens within them and a ValueError past them."""
    prompt = torch.tensor([5, 17, 3, 30, 11])
    local = _tiny("GPTNeoConfig", hidden_size=16, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
                  window_size=24, max_position_embeddings=64)
    # 5 prompt slots, 5 kept ones and a tree of 11 nodes: 21 slots, within the window
    out = speculative_generate(local, local, prompt, 6, GREEDY, drafter="tree", tree_shape=[2, 2, 1])
    assert out.tokens.tolist() == hf_greedy(local, prompt, 6)
    with pytest.raises(ValueError, match=r": target: expected room for the \d+ cache slots the generation reaches .*"
                                         r"cover 64 of them, some seeing only the last 24"):
        speculative_generate(local, local, prompt, 20, GREEDY, drafter="tree", tree_shape=[2, 2, 1])
    table = _tiny("GPTNeoConfig", hidden_size=16, num_layers=1, num_heads=2, attention_types=[[["global"], 1]],
                  max_position_embeddings=16)
    assert generate(table, prompt, 12, GREEDY).tokens.tolist() == hf_greedy(table, prompt, 12)  # 16 slots: all
    for run in (lambda: generate(table, prompt, 13, GREEDY),  # named before the model runs
                lambda: speculative_generate(table, table, prompt, 12, GREEDY)):  # the last step's drafts past 16
        with pytest.raises(ValueError, match=r"expected room for the 1[78] cache slots .*cover 16 of them$"):
            run()


def test_positions_past_a_learned_table_are_named():
    # an IndexError from inside the model (where its own generate fails too), for the target and for a draft
    prompt = torch.tensor([5, 17, 3, 30, 11, 2, 9, 4])
    opt = _tiny("OPTConfig", hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
                word_embed_proj_dim=16, max_position_embeddings=16)
    assert speculative_generate(opt, None, prompt, 9, GREEDY, drafter="ngram").tokens.tolist() == hf_greedy(
        opt, prompt, 9)  # positions 0 .. 15
    long = _tiny("LlamaConfig", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64)
    _each_named([("model", lambda: generate(opt, prompt, 10, GREEDY)),
                 ("target", lambda: speculative_generate(opt, None, prompt, 10, GREEDY, drafter="ngram")),
                 ("draft", lambda: speculative_generate(long, opt, prompt, 12, GREEDY))],
                ": {name}: expected a model that embeds every position the generation feeds .*, got an IndexError at "
                "positions up to 1[6-9]")


def test_wrong_length_params_are_named_by_their_argument(pair):
    # both said "SamplingParams.top_k: expected shape [B]", not which argument was at fault
    target, draft = pair
    ids = torch.tensor([[1, 2], [3, 4]])
    good, bad = ss.SamplingParams(top_k=torch.tensor([2, 3])), ss.SamplingParams(top_k=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"speculative_generate: draft_params\.top_k: expected shape \[B\] = \[2\]"):
        speculative_generate(target, draft, ids, 2, good, draft_params=bad)
    with pytest.raises(ValueError, match=r"speculative_generate: params\.top_k: expected shape \[B\] = \[2\]"):
        speculative_generate(target, draft, ids, 2, bad, draft_params=good)
    with pytest.raises(ValueError, match=r"generate: params\.top_k: expected shape \[B\] = \[2\]"):
        generate(target, ids, 2, bad)


def test_integer_arguments_take_numpy_integers_and_name_non_integers(pair):
    # NumPy integers were refused ("expected an int >= 0, got np.int64(2)"), as SamplingParams takes them
    target, draft = pair
    prompt = torch.tensor([5, 17, 3, 5, 17])
    rng = lambda: ss.Philox(7)  # noqa: E731
    spec = lambda *a, **k: speculative_generate(target, draft, prompt, *a, rng=rng(), **k).tokens.tolist()  # noqa: E731
    assert spec(np.int64(6), num_draft_tokens=np.int32(2)) == spec(6, num_draft_tokens=2)
    tree = spec(6, drafter="tree", tree_shape=[2, 1])
    for shape in ([np.int64(2), np.int64(1)], (np.int32(2), 1), np.array([2, 1]), torch.tensor([2, 1])):
        assert spec(np.int64(6), drafter="tree", tree_shape=shape) == tree, repr(shape)
    assert spec(6, drafter="tree", num_draft_tokens=np.int64(3)) == spec(6, drafter="tree", num_draft_tokens=3)
    ngram = lambda **k: speculative_generate(target, None, prompt, 6, drafter="ngram", rng=rng(), **k).tokens.tolist()  # noqa: E731
    assert ngram(num_draft_tokens=np.int64(2), prompt_lookup_min=np.int64(1), prompt_lookup_max=np.int8(2)) == ngram(
        num_draft_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
    assert generate(target, prompt, np.int64(4), rng=rng()).tokens.tolist() == generate(
        target, prompt, 4, rng=rng()).tokens.tolist()
    for kwargs, name in ((dict(max_new_tokens=2.0), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
                         (dict(max_new_tokens=np.float64(2)), "max_new_tokens"),
                         (dict(num_draft_tokens=2.5), "num_draft_tokens"),
                         (dict(drafter="tree", tree_shape=[2.0, 1]), "tree_shape"),
                         (dict(drafter="tree", tree_shape=np.array([[2, 1]])), "tree_shape"),
                         (dict(drafter="tree", tree_shape="21"), "tree_shape"),
                         (dict(drafter="tree", tree_shape=[True]), "tree_shape")):
        kwargs = {"max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=f"speculative_generate: {name}: expected"):
            speculative_generate(target, draft, prompt, **kwargs)
    with pytest.raises(ValueError, match="generate: max_new_tokens: expected an int >= 0, got 2.0"):
        generate(target, prompt, 2.0)


# ------------------------------------------------------------------------------ distribution


def exact_joint(model, prompt: torch.Tensor, params: ss.SamplingParams, steps: int) -> np.ndarray:
    """The target's exact distribution of its first ``steps`` tokens, ``[V] * steps``."""
    V = model.config.vocab_size
    prefixes = [()]
    probs = {(): 1.0}
    for _ in range(steps):
        seqs = torch.stack([torch.cat([prompt, torch.tensor(p, dtype=torch.long)]) for p in prefixes])
        with torch.no_grad():
            q = ss.logits_to_probs(model(seqs).logits[:, -1].float(), params).double()
        probs = {p + (x,): probs[p] * float(q[i, x]) for i, p in enumerate(prefixes) for x in range(V)}
        prefixes = list(probs)
    return np.array([probs[p] for p in itertools.product(range(V), repeat=steps)]).reshape([V] * steps)


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_llama(6, 2, 16, seed=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    return target, noisy_copy(target, 1.0, seed=6)


DIST_SETUPS = [
    ("chain", "iid", "token", None),
    ("chain", "iid", "block", None),
    ("chain", "deterministic", "target_only", None),
    ("tree", "iid", "rrs", [2, 1]),
    ("tree", "without_replacement", "rrs", [3, 1]),
    ("tree", "iid", "traversal", [2, 2]),
    ("tree", "without_replacement", "traversal", [3, 1]),
    ("tree", "deterministic", "target_only", [2, 1]),
    ("ngram", None, "target_only", None),
]


@pytest.mark.montecarlo
@pytest.mark.parametrize("drafter,how,method,shape", DIST_SETUPS)
def test_first_tokens_follow_the_target_distribution(small_vocab_pair, drafter, how, method, shape):
    """Speculative and plain sampling draw the first three tokens from the target's exact joint
    (checked on the pairs (x1, x2) and (x2, x3): 36 outcomes each, where a lossy verifier shows)."""
    target, draft = small_vocab_pair
    trials = mc_trials(100_000, 10_000)
    prompt = torch.tensor([1, 4, 2])
    params = ss.SamplingParams(temperature=0.9, top_k=5)
    exact = exact_joint(target, prompt, params, 3)
    ids = prompt.expand(trials, -1)
    seeds = ss.Philox(torch.arange(trials))
    spec = speculative_generate(target, None if drafter == "ngram" else draft, ids, 3, params, drafter=drafter,
                                draft_sampling=how, method=method, tree_shape=shape, num_draft_tokens=2, rng=seeds)
    plain = generate(target, ids, 3, params, rng=seeds)
    V = target.config.vocab_size
    for name, out in (("speculative", spec), ("plain", plain)):
        x = out.tokens.numpy()
        for pair, probs in (((0, 1), exact.sum(2)), ((1, 2), exact.sum(0))):
            counts = np.bincount(x[:, pair[0]] * V + x[:, pair[1]], minlength=V * V)
            assert_counts_match(counts, probs.reshape(-1), label=f"{name} {drafter} {how} {method} tokens {pair}")
    # the drafts were actually used (lookups in three-token contexts find little)
    assert spec.stats.acceptance_rate > (0.02 if drafter == "ngram" else 0.1)
