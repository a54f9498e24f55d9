import numpy as np
import pytest
import torch
from scipy import stats

import specsampler as ss
from conftest import mc_trials
from specsampler import SamplingParams as SP
from specsampler.rng import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    _uniform_numpy,
    _uniform_python,
    _uniform_torch,
    philox4x32,
    philox4x32_numpy,
    philox_uniform,
    planned,
    uniform,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "counter, key, expected",
    [  # Random123's known-answer vectors for philox4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox_matches_random123_known_answers(counter, key, expected):
    t = lambda v: torch.tensor([v], dtype=torch.int64)
    out = philox4x32(tuple(map(t, counter)), tuple(map(t, key)))
    assert tuple(int(w) for w in out) == expected
    n = lambda v: np.array([v], dtype=np.uint64)
    out = philox4x32_numpy(tuple(map(n, counter)), tuple(map(n, key)))
    assert tuple(int(w[0]) for w in out) == expected


def test_the_numpy_and_torch_paths_draw_the_same_uniforms():
    g = torch.Generator().manual_seed(0)
    seed = torch.randint(-(2**62), 2**62, (50,), generator=g)
    offset = torch.randint(0, 2**40, (50,), generator=g)
    index = torch.randint(0, 2**20, (50, 7), generator=g)
    for stream in (STREAM_SAMPLE, STREAM_ACCEPT):
        assert torch.equal(_uniform_numpy(seed, offset, index, stream), _uniform_torch(seed, offset, index, stream))


def test_a_few_uniforms_in_python_integers_are_the_tensor_paths_numbers():
    # the CPU's path for a few uniforms (an op on a few requests seeded by a Philox): negative seeds, offsets past
    # 32 bits, a stream per column
    g = torch.Generator().manual_seed(1)
    seed = torch.cat([torch.randint(-(2**62), 2**62, (4,), generator=g), torch.tensor([-1, 0, 2**63 - 1])])
    offset = torch.cat([torch.randint(0, 2**40, (5,), generator=g), torch.tensor([2**63 - 1, 0])])
    index = torch.randint(0, 2**31, (7, 3), generator=g)
    for stream in (STREAM_SAMPLE, STREAM_ACCEPT, torch.tensor([0, 1, 1])):
        want = _uniform_torch(seed, offset, index, stream)
        assert torch.equal(_uniform_python(seed, offset, index, stream), want)
        assert torch.equal(_uniform_numpy(seed, offset, index, stream), want)
    few = philox_uniform(seed[:2], offset[:2], index[:2], STREAM_SAMPLE)  # 6 uniforms: the Python path
    assert few.dtype == torch.float32 and few.shape == (2, 3)
    assert torch.equal(few, _uniform_torch(seed[:2], offset[:2], index[:2], STREAM_SAMPLE))
    assert _uniform_python(seed[:0], offset[:0], index[:0], STREAM_SAMPLE).shape == (0, 3)


def test_planned_streams_are_the_uniforms_each_call_would_draw():
    """An op's planned streams (one Philox evaluation for all of them, per-column streams on both paths) are the
    numbers separate uniform() calls give, for any count asked; any other rng is drawn from when asked, in order."""
    rng = ss.Philox(torch.tensor([3, 2**40 + 5, -7]), torch.tensor([0, 2, 2**33 + 9]))
    draw = planned(rng, "t", 3, ((STREAM_SAMPLE, 5), (STREAM_ACCEPT, 4)), CPU)
    for stream, count in ((STREAM_ACCEPT, 4), (STREAM_SAMPLE, 5), (STREAM_SAMPLE, 2), (STREAM_ACCEPT, 9)):
        got = draw(stream, count)
        assert got.is_contiguous() and torch.equal(got, uniform(rng, "t", 3, count, stream, CPU)), (stream, count)
    seed, offset = rng.keys("t", 3, CPU)
    index, streams = torch.arange(6).expand(3, 6), torch.tensor([0, 1, 0, 1, 1, 0])
    assert torch.equal(_uniform_numpy(seed, offset, index, streams), _uniform_torch(seed, offset, index, streams))
    g, h = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    draw = planned(g, "t", 2, ((STREAM_SAMPLE, 3), (STREAM_ACCEPT, 3)), CPU)
    first, second = draw(STREAM_ACCEPT, 3), draw(STREAM_SAMPLE, 3)  # the order the op asks in
    assert torch.equal(first, torch.rand(2, 3, generator=h)) and torch.equal(second, torch.rand(2, 3, generator=h))


def test_uniforms_are_float32_in_the_unit_interval_and_uniform():
    n = mc_trials(1_000_000, 200_000)
    u = uniform(ss.Philox(torch.arange(n)), "t", n, 2, STREAM_ACCEPT, CPU)
    assert u.dtype == torch.float32 and u.shape == (n, 2)
    assert (u >= 0).all() and (u < 1).all()
    assert stats.kstest(u[:, 1].numpy(), "uniform").pvalue > 1e-4
    assert abs(torch.corrcoef(u.T)[0, 1]) < 5 / n**0.5


def test_uniform_is_the_documented_counter_layout():
    seed, offset = torch.tensor([-5, 2**40 + 3]), torch.tensor([7, 2**33 + 1])
    mask = 0xFFFFFFFF
    for b in range(2):
        for index in range(3):
            s, o = int(seed[b]), int(offset[b])
            words = philox4x32(
                tuple(torch.tensor([v]) for v in (index, STREAM_SAMPLE, o & mask, (o >> 32) & mask)),
                (torch.tensor([s & mask]), torch.tensor([(s >> 32) & mask])),
            )
            expected = (int(words[0]) >> 8) * 2.0**-24
            got = philox_uniform(seed[b : b + 1], offset[b : b + 1], torch.tensor([[index]]), STREAM_SAMPLE)
            assert got.item() == expected


def test_streams_indices_seeds_and_offsets_all_give_new_draws():
    base = uniform(ss.Philox(3, 0), "t", 1, 4, STREAM_SAMPLE, CPU)
    others = [
        uniform(ss.Philox(3, 0), "t", 1, 4, STREAM_ACCEPT, CPU),
        uniform(ss.Philox(4, 0), "t", 1, 4, STREAM_SAMPLE, CPU),
        uniform(ss.Philox(3, 1), "t", 1, 4, STREAM_SAMPLE, CPU),
        uniform(ss.Philox(3, 2**32), "t", 1, 4, STREAM_SAMPLE, CPU),
    ]
    assert len(set(base[0].tolist())) == 4
    for o in others:
        assert not set(o[0].tolist()) & set(base[0].tolist())


def test_advance_returns_a_new_offset_and_leaves_tensors_alone():
    offset = torch.tensor([1, 2])
    rng = ss.Philox(torch.tensor([5, 6]), offset)
    nxt = rng.advance(3)
    assert torch.equal(nxt.offset, torch.tensor([4, 5])) and torch.equal(offset, torch.tensor([1, 2]))


def _mixed_batch(B, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, 3, V, generator=g) * 2
    params = SP(
        temperature=torch.rand(B, generator=g) + 0.2,
        top_k=torch.randint(0, V, (B,), generator=g),
        top_p=torch.rand(B, generator=g) * 0.6 + 0.4,
        min_p=torch.rand(B, generator=g) * 0.05,
    )
    return logits, params, torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 100, (B,), generator=g)


def _take(params, idx):
    return SP(*(getattr(params, f)[idx] for f in ("temperature", "top_k", "top_p", "min_p")))


def test_a_request_draws_the_same_tokens_whatever_the_batch():
    B, V = 48, 300
    logits, params, seed, offset = _mixed_batch(B, V)
    full = ss.sample_from_logits(logits, params, ss.Philox(seed, offset)).tokens
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(1))
    permuted = ss.sample_from_logits(logits[perm], _take(params, perm), ss.Philox(seed[perm], offset[perm])).tokens
    assert torch.equal(permuted, full[perm])
    sub = torch.tensor([5, 17, 40])
    alone = ss.sample_from_logits(logits[sub], _take(params, sub), ss.Philox(seed[sub], offset[sub])).tokens
    assert torch.equal(alone, full[sub])
    # neighbours changed completely (values and parameters), the request kept
    other, other_params, other_seed, other_offset = _mixed_batch(B, V, seed=9)
    other[7], other_seed[7], other_offset[7] = logits[7], seed[7], offset[7]
    other_params = SP(*(torch.where(torch.arange(B) == 7, getattr(params, f), getattr(other_params, f))
                        for f in ("temperature", "top_k", "top_p", "min_p")))
    neigh = ss.sample_from_logits(other, other_params, ss.Philox(other_seed, other_offset)).tokens
    assert torch.equal(neigh[7], full[7])


MIXED = [50, 2000, 0, 7, 300, 0] * 4, [0.95, 0.9, 0.8, 1.0, 1.0, 0.9] * 4  # per request: 24 requests


@pytest.mark.parametrize("V, top_k, top_p", [(128256, [0] * 6, [1.0] * 6), (128256, [0] * 6, [0.9] * 6),
                                             (128256, *MIXED), (50257, [0] * 20, [1.0] * 20)])
def test_a_lone_request_gets_the_same_bits_as_in_a_batch_at_full_vocabulary(V, top_k, top_p):
    """Row sums must not see the batch (ATen splits a lone long row's sum across threads, and
    rounds a row padded with zeros to the widest row of the batch another way), nor must
    exponentials (ATen rounds them one way in a vectorised loop's body, another in its tail)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs two
    try:
        g = torch.Generator().manual_seed(4)
        B = len(top_k)
        logits = torch.randn(B, V, generator=g) * 3
        params = SP(temperature=torch.full((B,), 0.8), top_k=torch.tensor(top_k), top_p=torch.tensor(top_p),
                    min_p=torch.zeros(B))
        seed = torch.arange(B) + 11
        probs = ss.logits_to_probs(logits, params)
        batch = ss.sample_from_logits(logits, params, ss.Philox(seed))
        for b in range(B):
            one = _take(params, slice(b, b + 1))
            assert torch.equal(ss.logits_to_probs(logits[b : b + 1], one), probs[b : b + 1])
            alone = ss.sample_from_logits(logits[b : b + 1], one, ss.Philox(seed[b : b + 1]))
            assert torch.equal(alone.logprobs, batch.logprobs[b : b + 1])
            assert torch.equal(alone.tokens, batch.tokens[b : b + 1])
        # the block rule's S_i: one row per request and position
        p = torch.softmax(torch.randn(B, 2, V, generator=g), -1)
        q = torch.softmax(torch.randn(B, 1, V, generator=g), -1)
        x = torch.randint(0, V, (B, 1), generator=g)
        expected = ss.verify_chain(p, x, q, method="block", rng=ss.Philox(seed)).expected_accepted
        for b in range(B):
            alone = ss.verify_chain(p[b : b + 1], x[b : b + 1], q[b : b + 1], method="block",
                                    rng=ss.Philox(seed[b : b + 1])).expected_accepted
            assert torch.equal(alone, expected[b : b + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("V, min_p", [(128256, 0.0), (50257, 0.0), (50257, 0.05)])
def test_a_lone_plain_request_draws_the_same_bits_as_in_a_batch(V, min_p):
    """Plain rows with shared parameters are drawn from bounds, in blocks of rows (sample_plain): a row's token and
    log-probability must not see the block it fell in, nor the batch (the bounds' float32 sums round by the batch's
    shape; the token is the exact-mass token whatever they are)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(6)
        B = 20
        logits = torch.randn(B, V, generator=g) * 3
        params = SP(temperature=0.8, min_p=min_p)
        seed = torch.arange(B) + 3
        batch = ss.sample_from_logits(logits, params, ss.Philox(seed))
        for b in range(B):
            alone = ss.sample_from_logits(logits[b : b + 1], params, ss.Philox(seed[b : b + 1]))
            assert torch.equal(alone.tokens, batch.tokens[b : b + 1]) and torch.equal(alone.logprobs,
                                                                                       batch.logprobs[b : b + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("C", [0, 1, 255, 256, 1000, 40000, 128257])
def test_row_sums_do_not_see_the_batch(C):
    from specsampler.sampling.processing import padded_row_sum, row_sum

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # ATen splits a lone row's sum across two threads or more
    try:
        w = torch.rand(4, C, generator=torch.Generator().manual_seed(C)) ** 4
        rows, padded = row_sum(w), padded_row_sum(w)
        torch.testing.assert_close(rows.double(), w.double().sum(-1), rtol=1e-6, atol=0)
        torch.testing.assert_close(padded.double(), w.double().sum(-1), rtol=1e-6, atol=0)
        for i in range(4):
            assert torch.equal(row_sum(w[i]), rows[i])
            assert torch.equal(row_sum(w[i : i + 1], keepdim=True), rows[i, None, None])
            wider = torch.nn.functional.pad(w[i : i + 1], (0, 300))  # as a batch's wider row pads it
            assert torch.equal(padded_row_sum(wider), padded[i : i + 1])
            assert torch.equal(padded_row_sum(torch.cat([wider, torch.rand(2, C + 300)]))[:1], padded[i : i + 1])
    finally:
        torch.set_num_threads(threads)


def test_values_computed_in_the_vector_body_do_not_depend_on_their_place():
    from specsampler.sampling.processing import in_vector_body

    t = torch.rand(3, 700, generator=torch.Generator().manual_seed(2)) * 60 - 50
    whole = in_vector_body(torch.exp2, t)
    for i in range(3):
        for j in range(0, 700, 7):
            assert torch.equal(in_vector_body(torch.exp2, t[i, j:]), whole[i, j:])
    assert torch.equal(in_vector_body(torch.exp2, t[:, :0]), t[:, :0])


def test_sample_is_invariant_to_the_batch_and_moves_with_the_offset():
    probs = torch.softmax(torch.randn(32, 2, 50), -1)
    seed = torch.arange(32) * 1000
    full = ss.sample(probs, ss.Philox(seed, 3))
    for b in (0, 13, 31):
        assert torch.equal(ss.sample(probs[b : b + 1], ss.Philox(int(seed[b]), 3)), full[b : b + 1])
    draws = torch.stack([ss.sample(probs, ss.Philox(seed, o)) for o in range(20)])
    assert (draws != draws[0]).any(0).float().mean() > 0.5  # new offsets give new draws


def test_triton_philox_draws_the_documented_numbers():
    """The contract the kernels rely on: tl.philox at our counters gives our uniforms."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def draw(seed_ptr, offset_ptr, out_ptr, n: tl.constexpr, stream: tl.constexpr):
        b = tl.program_id(0)
        seed = tl.load(seed_ptr + b)
        offset = tl.load(offset_ptr + b)
        idx = tl.arange(0, n)
        c0 = idx.to(tl.uint32)
        c1 = tl.full((n,), stream, tl.uint32)
        c2 = tl.full((n,), 0, tl.uint32) + (offset & 0xFFFFFFFF).to(tl.uint32)
        c3 = tl.full((n,), 0, tl.uint32) + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
        w0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
        u = (w0 >> 8).to(tl.float32) * (1.0 / 16777216.0)
        tl.store(out_ptr + b * n + idx, u)

    seed = torch.tensor([0, 1, -7, 2**40 + 11])
    offset = torch.tensor([0, 5, 2**33 + 2, 123])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(4, 8, device=device)
    draw[(4,)](seed.to(device), offset.to(device), out, 8, STREAM_ACCEPT)
    expected = philox_uniform(seed, offset, torch.arange(8).expand(4, 8), STREAM_ACCEPT)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_given_uniforms_are_used_as_given(backend, monkeypatch):
    """``Uniforms`` holding a Philox's numbers at its counters gives the Philox's tokens, for chains and trees,
    on both back ends; a stream the op reads but the caller left out is a ValueError naming it."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", backend)
    B, K, V = 5, 3, 11
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    philox = ss.Philox(torch.arange(B) + 40)
    given = ss.Uniforms(sample=uniform(philox, "t", B, K + 1, STREAM_SAMPLE, torch.device("cpu")),
                        accept=uniform(philox, "t", B, K + 1, STREAM_ACCEPT, torch.device("cpu")))
    for method in ("token", "block"):
        want = ss.verify_chain(p, x, q, method=method, rng=philox)
        got = ss.verify_chain(p, x, q, method=method, rng=given)
        assert torch.equal(got.tokens, want.tokens), method
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 1, 2]] * B))
    drafts = torch.nn.functional.pad(x, (1, 0))
    qt = torch.nn.functional.pad(q, (0, 0, 1, 0))
    want = ss.verify_tree(p, drafts, tree, qt, method="traversal", rng=philox)
    assert torch.equal(ss.verify_tree(p, drafts, tree, qt, method="traversal", rng=given).tokens, want.tokens)
    with pytest.raises(ValueError, match=r"Uniforms.accept: expected a float tensor \[B, >= 4\]"):
        ss.verify_chain(p, x, q, method="token", rng=ss.Uniforms(sample=given.sample))
    with pytest.raises(ValueError, match=r"Uniforms.sample: expected shape \[B = 5, >= 4\], got shape \[5, 2\]"):
        ss.verify_chain(p, x, q, method="token", rng=ss.Uniforms(sample=given.sample[:, :2], accept=given.accept))


def test_a_philox_under_torch_compile_draws_the_eager_numbers_on_the_pytorch_path(monkeypatch):
    """On CPU a Philox's words are NumPy uint64s, which dynamo cannot trace (no uint64 shift: a hard error under a
    default torch.compile, not a graph break); while it traces, the torch ops give the same numbers."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    torch._dynamo.reset()
    B, K, V = 3, 4, 40
    g = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    x = torch.randint(0, V, (B, K), generator=g)

    def step(seed, offset):
        return ss.verify_chain(p, x, q, method="token", rng=ss.Philox(seed, offset)).tokens

    args = (torch.arange(B) + 7, torch.full((B,), 2**40 + 3))
    assert torch.equal(torch.compile(step, backend="eager")(*args), step(*args))
