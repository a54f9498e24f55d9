"""The built-in draft/target pair: byte tokenizer, committed weights, and deterministic training."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

from specsampler.generate.cache import cache_argument  # noqa: E402
from specsampler.generate.modelpair import PAIR_DIR, ByteTokenizer, load_pair, train_pair  # noqa: E402

# Python source the models never saw (written for this test), each shorter than the models' context.
SNIPPETS = [
    '''def clamp(value, low, high):
    """Return value limited to the range [low, high]."""
    if low > high:
        raise ValueError("low must not exceed high")
    if value < low:
        return low
    if value > high:
        return high
    return value
''',
    '''class Counter:
    def __init__(self, start=0):
        self.count = start

    def increment(self, step=1):
        self.count += step
        return self.count

    def reset(self):
        self.count = 0
''',
]

# Thresholds, with margin, from the committed pair: on SNIPPETS the target's cross-entropy is 1.07 nats/byte,
# the draft's 1.30, and their greedy next-byte predictions agree on 81% of positions.
TARGET_MAX_CE = 1.5
DRAFT_MAX_CE = 2.0
MIN_CE_GAP = 0.1
MIN_AGREEMENT = 0.65

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
TINIER = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=1, intermediate_size=32)


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def snippet_predictions(pair):
    """Per snippet: (ids [T], target logits [T, 256], draft logits [T, 256])."""
    target, draft, tok = pair
    out = []
    with torch.no_grad():
        for text in SNIPPETS:
            ids = torch.tensor([tok.encode(text)])
            out.append((ids[0], target(input_ids=ids).logits[0], draft(input_ids=ids).logits[0]))
    return out


def cross_entropy(predictions, which):
    """Mean next-byte cross-entropy (nats) over all snippets; which = 1 (target) or 2 (draft)."""
    logits = torch.cat([p[which][:-1] for p in predictions])
    labels = torch.cat([p[0][1:] for p in predictions])
    return torch.nn.functional.cross_entropy(logits, labels).item()


def test_tokenizer_round_trips_ascii_and_non_ascii_text():
    tok = ByteTokenizer()
    for text in ["def f(x):\n    return x\n", "", "naïve café — ∑ 日本語 🐍", "\x00\x7f"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert tok.vocab_size == 256


def test_tokenizer_decodes_invalid_utf8_with_replacement_characters():
    tok = ByteTokenizer()
    assert tok.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    assert tok.decode(tok.encode("日本")[:-1]) == "日\ufffd"


def test_load_pair_returns_byte_level_llama_models_with_a_smaller_draft(pair):
    target, draft, tok = pair
    assert isinstance(tok, ByteTokenizer)
    for model in (target, draft):
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.vocab_size == 256
        assert not model.training
        assert next(model.parameters()).dtype == torch.float32
    num_params = lambda m: sum(p.numel() for p in m.parameters())
    assert num_params(draft) < num_params(target) / 4


def test_load_pair_casts_to_the_requested_dtype():
    target, draft, _ = load_pair(dtype=torch.bfloat16)
    assert next(target.parameters()).dtype == torch.bfloat16
    assert next(draft.parameters()).dtype == torch.bfloat16


def test_target_and_draft_are_trained_and_the_target_is_better(snippet_predictions):
    target_ce, draft_ce = cross_entropy(snippet_predictions, 1), cross_entropy(snippet_predictions, 2)
    assert target_ce < TARGET_MAX_CE < math.log(256)
    assert draft_ce < DRAFT_MAX_CE
    assert target_ce < draft_ce - MIN_CE_GAP


def test_draft_agrees_with_the_target_greedily_on_most_positions(snippet_predictions):
    same = torch.cat([target.argmax(-1) == draft.argmax(-1) for _, target, draft in snippet_predictions])
    agreement = same.float().mean().item()
    assert agreement > MIN_AGREEMENT


def test_models_verify_two_branches_at_once_with_a_dynamic_cache_and_a_4d_mask(pair):
    """Two 16-byte continuations of a cached 64-byte prefix, in one call: each sees the prefix and itself."""
    tok = pair[2]
    text = tok.encode(SNIPPETS[0])
    prefix, branches = text[:64], [text[64:80], tok.encode(SNIPPETS[1])[:16]]
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    allowed = torch.zeros(32, 96, dtype=torch.bool)
    allowed[:, :64] = True
    allowed[:16, 64:80] = causal
    allowed[16:, 80:] = causal
    mask = torch.zeros(1, 1, 32, 96).masked_fill(~allowed, float("-inf"))
    positions = torch.arange(64, 80).repeat(2)[None]
    for model in pair[:2]:
        with torch.no_grad():
            cache = {cache_argument(model): DynamicCache()}  # `cache` in transformers 5, before `past_key_values`
            model(input_ids=torch.tensor([prefix]), use_cache=True, **cache)
            both = model(input_ids=torch.tensor([branches[0] + branches[1]]), position_ids=positions,
                         attention_mask=mask, **cache).logits[0]
            for i, branch in enumerate(branches):
                alone = model(input_ids=torch.tensor([prefix + branch])).logits[0, 64:]
                torch.testing.assert_close(both[16 * i: 16 * i + 16], alone, atol=1e-4, rtol=1e-4)


def test_committed_training_report_records_the_run():
    report = json.loads((PAIR_DIR / "training.json").read_text())
    for name in ("target", "draft"):
        assert report[name]["steps"] > 0
        assert 0 < report[name]["validation_loss"] < math.log(256)
    assert report["target"]["validation_loss"] < report["draft"]["validation_loss"]
    assert report["corpus"]["files"] > 100
    assert report["wall_seconds"] < 600


def test_load_pair_names_the_missing_file_and_the_training_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json.*python -m specsampler\.generate\.modelpair"):
        load_pair(pair_dir=tmp_path)


def test_train_pair_is_deterministic_and_writes_loadable_models(tmp_path):
    kwargs = dict(seed=3, target_steps=3, draft_steps=3, batch_size=2, context=64, target_shape=TINY,
                  draft_shape=TINIER, val_windows=4, log_every=1)
    reports = [train_pair(tmp_path / run, **kwargs) for run in ("a", "b")]
    for name in ("target", "draft"):
        a = (tmp_path / "a" / name / "model.safetensors").read_bytes()
        assert a == (tmp_path / "b" / name / "model.safetensors").read_bytes()
        assert reports[0][name]["validation_loss"] == reports[1][name]["validation_loss"]
    target, draft, _ = load_pair(pair_dir=tmp_path / "a")
    assert target.config.hidden_size == 32 and draft.config.hidden_size == 16
    assert json.loads((tmp_path / "a" / "training.json").read_text())["target"]["steps"] == 3
    with torch.no_grad():
        assert target(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 256)
