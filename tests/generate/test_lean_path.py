"""The generation loop's lean path (prepared layouts, batched draws, verifiers entered past their
checks) gives exactly the tokens of the same algorithm written with the public ops."""

import random

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import speculative_reference as reference  # noqa: E402
from tiny_models import sharp_pair  # noqa: E402

import specsampler as ss  # noqa: E402
from specsampler.generate import speculative_generate  # noqa: E402
from specsampler.generate.cache import cache_argument  # noqa: E402
from specsampler.generate.drafters import NgramDrafter  # noqa: E402
from specsampler.generate.draws import Streams  # noqa: E402
from specsampler.generate.layout import TreeLayout  # noqa: E402
from specsampler.rng import STREAM_ACCEPT, STREAM_SAMPLE, uniform  # noqa: E402

SETUPS = [  # (drafter, draft_sampling, method, tree_shape)
    ("chain", "iid", "token", None),
    ("chain", "iid", "block", None),
    ("chain", "deterministic", "target_only", None),
    ("chain", "iid", "greedy", None),
    ("tree", "iid", "rrs", [2, 2, 1]),
    ("tree", "without_replacement", "rrs", [3, 2]),
    ("tree", "iid", "traversal", [2, 1, 1]),
    ("tree", "without_replacement", "traversal", [2, 2, 1]),
    ("tree", "deterministic", "target_only", [3, 2, 1]),
    ("tree", "deterministic", "greedy", [2, 2]),
    ("ngram", None, "target_only", None),
    ("ngram", None, "greedy", None),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    return sharp_pair()


def batch(prompts):
    L = max(map(len, prompts))
    return (torch.tensor([[0] * (L - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts]))


def both(target, draft, ids, mask, n, params, setup, rng_of, **extra):
    drafter, how, method, shape = setup
    kwargs = dict(drafter=drafter, method=method, tree_shape=shape, num_draft_tokens=3, **extra)
    lean = speculative_generate(target, None if drafter == "ngram" else draft, ids, n, params, rng=rng_of(),
                                attention_mask=mask, draft_sampling=how, **kwargs)
    public = reference.generate(target, draft, ids, n, params, rng=rng_of(), attention_mask=mask,
                                draft_sampling=how or "deterministic", **kwargs)
    return lean.tokens.tolist(), public, lean.stats


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: "-".join(str(v) for v in s if v is not None))
def test_lean_loop_gives_the_public_ops_tokens(pair, setup):
    """Left-padded prompts, per-request parameters (greedy, top-k, top-p), Philox seeds."""
    target, draft = pair
    ids, mask = batch([[3, 8, 1, 22, 5, 9, 3, 8], [14], [7, 7, 30, 2, 7, 7]])
    params = ss.SamplingParams(temperature=torch.tensor([0.0, 1.0, 0.8]), top_k=torch.tensor([0, 12, 0]),
                               top_p=torch.tensor([1.0, 1.0, 0.9]))
    lean, public, stats = both(target, draft, ids, mask, 24, params, setup, lambda: ss.Philox(torch.tensor([4, 5, 6])))
    assert lean == public
    assert sum(map(sum, stats.accepted_per_step)) > 0  # drafts were accepted: the paths were exercised


@pytest.mark.parametrize("setup", [SETUPS[0], SETUPS[5], SETUPS[7], SETUPS[10]], ids=["chain", "rrs", "traversal",
                                                                                      "ngram"])
def test_lean_loop_draws_from_a_torch_generator_as_the_public_ops_do(pair, setup):
    target, draft = pair
    ids, mask = batch([[3, 8, 1, 22, 5, 9], [7, 7, 30, 2, 7, 7]])
    params = ss.SamplingParams(temperature=0.9)
    lean, public, _ = both(target, draft, ids, mask, 20, params, setup, lambda: torch.Generator().manual_seed(7))
    assert lean == public


@pytest.mark.parametrize("walks", ["looped", "batched"])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("setup", [SETUPS[0], SETUPS[5], SETUPS[7], SETUPS[8]],
                         ids=["chain", "rrs", "traversal", "target_only"])
def test_lean_loop_gives_the_public_ops_tokens_on_the_built_in_pair(setup, B, walks, monkeypatch):
    """Float32 models over 256 tokens, top-p 0.95 (short nucleus rows, drafts without replacement losing
    children); rrs and traversal walk each request by its plain loop up to ``LOOPED_BATCH`` requests, more
    by the batched walks (both taken here)."""
    from specsampler.generate.modelpair import load_pair
    from specsampler.verify import tree

    if walks == "batched":
        monkeypatch.setattr(tree, "LOOPED_BATCH", 0)
    elif setup[0] != "tree" or setup[2] == "target_only":
        pytest.skip("chains and target-only trees take one path")

    target, draft, tok = load_pair()
    ids, mask = batch([tok.encode("def read_config(path):\n    "), tok.encode("import os\n")][:B])
    params = ss.SamplingParams(temperature=0.8, top_p=0.95)
    lean, public, _ = both(target, draft, ids, mask, 32, params, setup, lambda: ss.Philox(torch.arange(B)))
    assert lean == public


def test_short_row_processing_equals_process():
    """The short-row path of the loop's processing gives process()'s numbers and draws (ties, masked
    tokens, temperatures, top-p values, vocabularies of 64 to 1024, prefix masses on the top-p target), and
    declines what it does not cover."""
    from specsampler.sampling.ops import _process_small, _small_constants
    from specsampler.sampling.processing import process

    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    for trial in range(200):
        V, R = [64, 128, 256, 512, 1024][trial % 5], 1 + trial % 7
        x = torch.randn(R, V, generator=g) * float(torch.rand(1, generator=g) * 8)
        if trial % 3 == 0:
            x = x.round()  # ties
        if trial % 4 == 0:
            x[:, :5] = float("-inf")
        rp = ss.SamplingParams(temperature=[0.3, 0.8, 1.0, 1.7][trial % 4], top_p=[0.5, 0.9, 0.95, 0.999][trial % 3]
                               ).rows("t", R, 1, cpu, False)
        fast, want = _process_small(x, _small_constants(rp, V)), process(x, rp, logits=True)
        u = torch.rand(R, generator=g)
        assert torch.equal(fast.dense(), want.dense()) and torch.equal(fast.sample(u), want.sample(u)), trial
    for k in (2, 4, 8):  # k tokens of equal weight: a prefix's mass lands on the target exactly (kept: below it)
        for top_p in (0.25, 0.5, 0.75):
            x = torch.full((1, 64), float("-inf"))
            x[0, 3:3 + 5 * k:5] = 1.0
            rp = ss.SamplingParams(top_p=top_p).rows("t", 1, 1, cpu, False)
            fast, want = _process_small(x, _small_constants(rp, 64)), process(x, rp, logits=True)
            assert torch.equal(fast.dense(), want.dense()), (k, top_p)
    x = torch.randn(2, 256)
    x[1, 3] = float("inf")
    rp = ss.SamplingParams(top_p=0.9).rows("t", 2, 1, cpu, False)
    assert _process_small(x, _small_constants(rp, 256)) is None  # a row without a finite top: process() instead
    for params, V in ((ss.SamplingParams(top_p=0.9, top_k=5), 256), (ss.SamplingParams(temperature=0.0), 256),
                      (ss.SamplingParams(top_p=1.0), 256), (ss.SamplingParams(top_p=0.9, min_p=0.1), 256),
                      (ss.SamplingParams(top_p=0.9), 100), (ss.SamplingParams(top_p=0.9), 2048),
                      (ss.SamplingParams(top_p=torch.tensor([0.9, 0.8])), 256)):
        assert _small_constants(params.rows("t", 2, 1, cpu, False), V) is None


@pytest.mark.parametrize("seed,offset", [(3, 0), (torch.tensor([1, -2, 2**62]), torch.tensor([5, 2**40, -7])),
                                         (2**40 + 3, 2**33)])
def test_batched_philox_draws_equal_the_public_uniforms(seed, offset):
    B, cpu = 3, torch.device("cpu")
    rng = ss.Philox(seed, offset)
    streams = Streams(rng, B, cpu, "t", horizon=40)
    first = streams.call(((STREAM_SAMPLE, 1),))
    assert torch.equal(first.uniform(STREAM_SAMPLE, 1), uniform(rng, "t", B, 1, STREAM_SAMPLE, cpu))
    plan = (((STREAM_SAMPLE, 2),), ((STREAM_SAMPLE, 4),), ((STREAM_ACCEPT, 5), (STREAM_SAMPLE, 5)))
    k = 1
    for _ in range(20):  # more than a block of steps
        for call, draws in zip(streams.step(plan), plan):
            for stream, count in draws:
                want = uniform(rng.advance(k), "t", B, count, stream, cpu)
                assert torch.equal(call.uniform(stream, count), want)
                assert torch.equal(call.uniform(stream, count - 1), want[:, :-1])
            for got, want in zip(call.rng.keys("t", B, cpu), rng.advance(k).keys("t", B, cpu)):
                assert torch.equal(got, want)  # the rng a kernel would take
            k += 1


@pytest.mark.parametrize("branching", [(2, 2, 1), (3, 1, 2), (1, 1, 1, 1), (4,)])
def test_tree_layouts_equal_the_token_trees_of_their_parents(branching):
    layout = TreeLayout(branching)
    parents = layout.tensor("parents", torch.device("cpu"))
    B, N = 4, layout.size
    tree = ss.TokenTree.from_parents(parents.expand(B, N))
    links = layout.links(B, torch.device("cpu"))
    for name in ("parents", "first_child", "next_sibling", "depth", "sibling_rank"):
        assert torch.equal(getattr(links, name), getattr(tree, name)), name
    assert links.max_depth == tree.max_depth and torch.equal(links.usable, tree.depth > 0)
    assert torch.equal(layout.visible(torch.device("cpu")), tree.mask()[0])
    bias = layout.bias(torch.device("cpu"), torch.float32)
    assert torch.equal(bias == 0, tree.mask()[0])
    rnd = random.Random(sum(branching))
    for _ in range(20):  # without replacement: each parent keeps a prefix of its children, absent subtrees
        present = torch.ones(B, N, dtype=torch.bool)
        for b in range(B):
            for d, c in enumerate(branching, 1):
                for node in layout.levels[d]:
                    i = node - layout.levels[d].start
                    p = int(parents[node])
                    keep = rnd.random() < 0.7 if i % c else rnd.random() < 0.9
                    present[b, node] = bool(present[b, p]) and keep and (i % c == 0 or bool(present[b, node - 1]))
        tree = ss.TokenTree.from_parents(torch.where(present, parents, -1))
        links = layout.links(B, torch.device("cpu"), present)
        for name in ("parents", "first_child", "next_sibling", "depth", "sibling_rank"):
            assert torch.equal(getattr(links, name), getattr(tree, name)), name
        assert torch.equal(links.usable, tree.depth > 0)


def test_ngram_drafter_proposes_what_followed_the_latest_earlier_match_longest_first():
    d = NgramDrafter([[1, 2, 3, 9, 1, 2, 4, 7, 2]], k=2, min_n=1, max_n=2)
    assert d.propose(0) == [4, 7]  # [7, 2] occurred nowhere earlier; [2] last occurred at 5, before 4, 7
    d.extend(0, [4])
    assert d.propose(0) == [7, 2]  # [2, 4] occurred at 5
    assert NgramDrafter([[5, 6, 7]], 3, 1, 3).propose(0) == []
    assert NgramDrafter([[1, 1, 1, 1]], 3, 1, 2).propose(0) == [1]  # the latest match: one token follows it
    rnd = np.random.default_rng(0)
    for _ in range(30):  # incremental indexing agrees with a plain backwards scan
        ctx = rnd.integers(0, 4, 6).tolist()
        d = NgramDrafter([list(ctx)], 3, 1, 3)
        for _ in range(15):
            assert d.propose(0) == reference.latest_match(ctx, 3, 1, 3)
            new = rnd.integers(0, 4, rnd.integers(1, 4)).tolist()
            ctx += new
            d.extend(0, new)


def test_the_cache_argument_follows_the_models_forward():
    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_argument(New()) == "cache" and cache_argument(Old()) == "past_key_values"


@pytest.mark.parametrize("setup", [SETUPS[0], SETUPS[7]], ids=["chain", "traversal"])
def test_lean_loop_on_the_kernels_gives_the_public_ops_tokens(pair, setup, monkeypatch):
    """Where the Triton kernels run (here the interpreter: slow, so short), the loop samples and verifies by them."""
    pytest.importorskip("triton")
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    target, draft = pair
    ids, mask = batch([[3, 8, 1, 22, 5, 9], [7, 7, 30, 2, 7, 7]])
    setup = setup[:3] + ([2, 1] if setup[0] == "tree" else None,)
    lean, public, _ = both(target, draft, ids, mask, 4, ss.SamplingParams(temperature=0.9, top_p=0.9), setup,
                           lambda: ss.Philox(torch.tensor([1, 2])))
    assert lean == public
