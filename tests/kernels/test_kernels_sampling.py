"""The sampling kernels (run in the Triton interpreter without a GPU, on a GPU with one) against
specsampler.sample_from_logits / sample on the CPU.

Kernel and reference draw from the same random streams (in-kernel Philox at the documented
counters, or the uniforms a torch.Generator gives the reference, passed in), so tokens must be
identical. Their sums are taken in other orders: a draw or a top-p cut within float rounding of a
boundary could differ; the random cases below hit none, so no mismatch is allowed. Small
``chunk``/``cand`` configurations push rows through every path of the kernel (candidates in
registers, the pivot search, the pass over ties) on small vocabularies.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from kernelcheck import DEVICE, on_device

import specsampler as ss
from specsampler import SamplingParams as SP
from specsampler.kernels import rows as rows_module
from specsampler.kernels import sampling as ksampling
from specsampler.kernels.rows import parts_per_row, row_config
from specsampler.rng import STREAM_SAMPLE, uniform

sample_from_logits, sample = on_device(ksampling.sample_from_logits), on_device(ksampling.sample)

VOCABS = [1, 2, 5, 17, 64, 65, 100, 130, 257, 300]


def _row_params(params: SP, B: int, M: int):
    rp = params.rows("test", B, M, torch.device("cpu"), False)
    return rp.temperature, rp.top_k, rp.top_p, rp.min_p


def _kernel(logits, params, rng, vocab_mask=None, chunk=64, cand=256):
    """The kernel on logits ``[B, V]`` or ``[B, M, V]``, with rng a Philox or a torch.Generator (whose
    uniforms are drawn here exactly as the reference draws them)."""
    B, V = logits.shape[0], logits.shape[-1]
    M = logits.numel() // (B * V)
    rows = logits.reshape(B * M, V)
    mask = None if vocab_mask is None else vocab_mask.expand(logits.shape).reshape(B * M, V).contiguous()
    kw = dict(chunk=chunk, cand=cand)
    if isinstance(rng, ss.Philox):
        seed, offset = rng.keys("test", B, logits.device)
        index = torch.arange(M).repeat(B)
        out = sample_from_logits(rows, *_row_params(params, B, M), mask, seed.repeat_interleave(M),
                                 offset.repeat_interleave(M), index, **kw)
    else:
        u = uniform(rng, "test", B, M, STREAM_SAMPLE, logits.device).reshape(-1)
        out = sample_from_logits(rows, *_row_params(params, B, M), mask, u=u, **kw)
    return out[0].view(logits.shape[:-1]), out[1].view(logits.shape[:-1])


def _reference(logits, params, rng, vocab_mask=None):
    out = ss.sample_from_logits(logits, params, rng, vocab_mask=vocab_mask)
    return out.tokens, out.logprobs


def _streams(B, seed, which):
    """(reference rng, kernel rng) pairs: a Philox stream (shared) and/or two equal torch.Generators."""
    philox = ss.Philox(torch.arange(B) * 7919 + seed, torch.arange(B) % 3 + seed)
    pairs = {"philox": (philox, philox),
             "generator": (torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed))}
    return [pairs[w] for w in (("philox", "generator") if which == "both" else (which,))]


def _check(logits, params, label, vocab_mask=None, seed=0, chunk=64, cand=256, streams="both"):
    """Kernel and reference on the same streams: same tokens, close logprobs."""
    for ref_rng, ker_rng in _streams(logits.shape[0], seed, streams):
        tokens, logprobs = _kernel(logits, params, ker_rng, vocab_mask, chunk, cand)
        ref_tokens, ref_logprobs = _reference(logits, params, ref_rng, vocab_mask)
        what = f"{label} [{type(ref_rng).__name__}, chunk {chunk}, cand {cand}]"
        assert torch.equal(tokens, ref_tokens), f"{what}: tokens\n{tokens}\n!= reference\n{ref_tokens}"
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-4, atol=1e-5, msg=what)


def _random_logits(g, shape, kind):
    if kind == "ties":  # integer-valued: many exact ties, also at the top-k / top-p cuts
        return torch.randint(-3, 3, shape, generator=g).float()
    if kind == "peaked":
        x = torch.randn(shape, generator=g)
        return x + 12.0 * (torch.rand(shape, generator=g) < 0.02)
    scale = float(torch.empty(1).uniform_(0.3, 8.0, generator=g))
    return torch.randn(shape, generator=g) * scale


def _random_params(g, B, V):
    """Per-request params mixing greedy, top-k, top-p, both, min-p and nothing (and k out of range)."""
    kind = torch.randint(0, 7, (B,), generator=g)
    temperature = torch.where(kind == 0, 0.0, torch.empty(B).uniform_(0.3, 2.5, generator=g))
    top_k = torch.where(torch.rand(B, generator=g) < 0.5, torch.randint(1, 12, (B,), generator=g),
                        torch.randint(-1, V + 3, (B,), generator=g))  # often small: the candidate list
    top_k = torch.where((kind == 1) | (kind == 3) | (kind == 6), top_k.clamp(min=1), 0)
    top_p = torch.where((kind == 2) | (kind == 3) | (kind == 6), torch.empty(B).uniform_(0.05, 0.99, generator=g), 1.0)
    min_p = torch.where((kind == 4) | (kind == 6), torch.empty(B).uniform_(0.0, 0.4, generator=g), 0.0)
    return SP(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _random_mask(g, shape):
    mask = torch.rand(shape, generator=g) < 0.85
    mask[..., 0, :] &= torch.rand(1, generator=g) < 0.7  # sometimes a whole row masked out
    return mask


@pytest.mark.parametrize("chunk, cand", [(8, 16), (4, 32)])
def test_kernel_draws_the_reference_tokens_on_random_rows(chunk, cand):
    g = torch.Generator().manual_seed(chunk * 1000 + cand)
    for case in range(12):
        V = VOCABS[int(torch.randint(0, len(VOCABS), (1,), generator=g))]
        B = int(torch.randint(1, 4, (1,), generator=g))
        shape = (B, V) if case % 3 else (B, 2, V)  # [B, V] and [B, K+1, V] (draw index = row in the request)
        kind = ("normal", "ties", "peaked")[case % 3]
        logits = _random_logits(g, shape, kind)
        dtype = (torch.float32, torch.bfloat16, torch.float16)[case % 4 % 3]
        mask = _random_mask(g, shape) if case % 2 else None
        params = _random_params(g, B, V)
        _check(logits.to(dtype), params, f"case {case}: {kind} {dtype} {shape} {params}", mask, case, chunk, cand,
               ("philox", "generator")[case % 2])


def test_kernel_with_the_default_configuration_matches_the_reference():
    # the GPU configuration (chunks of 64, 256 candidates): top-k + top-p and a small nucleus in registers
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000, generator=g) * 3
    params = SP(temperature=torch.tensor([0.9, 1.0, 0.0, 1.4, 0.7]), top_k=torch.tensor([50, 0, 0, 0, 0]),
                top_p=torch.tensor([0.95, 0.6, 1.0, 1.0, 1.0]), min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1]))
    _check(logits, params, "default configuration", None, 0, 64, 256, "philox")


@pytest.mark.parametrize(
    "params",
    [SP(temperature=0.0), SP(top_k=40), SP(top_k=7, top_p=0.6), SP(top_p=0.97), SP(top_p=0.3, temperature=0.5),
     SP(min_p=0.05), SP(temperature=1.7), SP(top_k=90, top_p=0.9, min_p=0.02)],
    ids=["greedy", "top_k", "top_k_top_p", "large_nucleus", "small_nucleus", "min_p", "plain", "all"],
)
def test_kernel_matches_the_reference_for_each_kind_of_row(params):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 300, generator=g) * 2
    _check(logits, params, str(params), None, 1, 8, 16, "philox")
    _check(logits, params, str(params), None, 2, 32, 64, "generator")


def test_ties_across_the_cut_go_to_the_lower_ids():
    # 40 tokens tie at the top (more than the candidate list holds): top-k and top-p keep the lowest ids
    x = torch.full((1, 200), -1.0)
    x[0, torch.randperm(200, generator=torch.Generator().manual_seed(0))[:40]] = 2.0
    logits = x.expand(6, 200).contiguous()
    params = SP(top_k=torch.tensor([3, 25, 40, 41, 0, 0]), top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 0.3, 0.77]))
    _check(logits, params, "ties", None, 2, 8, 16, "philox")
    _check(logits, params, "ties", None, 3, 16, 64, "generator")


def test_rows_without_an_allowed_token_draw_0_with_logprob_minus_inf():
    logits = torch.randn(5, 130)
    mask = torch.zeros(5, 130, dtype=torch.bool)  # every row fully masked
    params = SP(temperature=torch.tensor([0.0, 1.0, 1.0, 0.8, 1.2]), top_k=torch.tensor([0, 0, 5, 0, 3]),
                top_p=torch.tensor([1.0, 1.0, 0.7, 0.9, 1.0]), min_p=torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0]))
    for chunk, cand in ((64, 32), (8, 16)):
        for x, m in ((logits, mask), (torch.full((5, 130), -math.inf), None)):
            tokens, logprobs = _kernel(x, params, ss.Philox(3), m, chunk, cand)
            assert tokens.tolist() == [0] * 5
            assert torch.all(logprobs == -math.inf)
            assert torch.equal(tokens, _reference(x, params, ss.Philox(3), m)[0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and inf in the interpreter's numpy
def test_outputs_stay_in_range_on_degenerate_rows():
    V = 70
    rows = torch.tensor([[math.nan] * V, [math.inf] + [0.0] * (V - 1), [1e30, -1e30] + [0.0] * (V - 2),
                         [math.nan, 1.0] + [-math.inf] * (V - 2)])
    rows = rows.repeat(5, 1)  # each with: plain, greedy, top-k, top-p, min-p + top-k + top-p
    params = SP(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]).repeat_interleave(4),
                top_k=torch.tensor([0, 0, 3, 0, 3]).repeat_interleave(4),
                top_p=torch.tensor([1.0, 1.0, 1.0, 0.5, 0.5]).repeat_interleave(4),
                min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5]).repeat_interleave(4))
    tokens, _ = _kernel(rows, params, ss.Philox(1), chunk=8, cand=16)
    assert ((tokens >= 0) & (tokens < V)).all()


def test_large_vocabulary_rows_use_bigger_chunks():
    # 2048 chunks at most: V = 4 * 2048 + 3 with chunk 2 is read in chunks of 8
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4 * 2048 + 3, generator=g) * 4
    params = SP(temperature=torch.tensor([1.0, 0.7]), top_k=torch.tensor([0, 5]), top_p=torch.tensor([0.9, 0.8]))
    _check(logits, params, "large V", None, 0, 2, 32)


def test_top_k_from_a_bound_more_chunks_reach_keeps_the_most_likely_tokens():
    # top_candidates stops bisecting the chunk maxima once at most max(k, GROUP) chunks reach its bound while
    # that is a sixteenth of the chunks at most: here 313 chunks of 64, bounds from up to 19 chunks for k < 19
    # (the same tokens as the reference, ties at the bound included: bf16 and integer-valued rows)
    g = torch.Generator().manual_seed(12)
    V = 20000
    base = torch.randn(8, V, generator=g) * 4
    logits = torch.cat([base[:3], base[3:6].bfloat16().float(), torch.randint(-3, 30, (2, V), generator=g).float()])
    params = SP(temperature=torch.tensor([1.0, 0.8, 1.2, 1.0, 0.9, 1.1, 1.0, 0.7]),
                top_k=torch.tensor([1, 5, 12, 18, 9, 40, 3, 30]),
                top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 0.95, 0.9, 1.0, 0.83]))  # 0.8 of 30 ties: a rounding tie
    _check(logits, params, "top-k bound from more chunks", None, 7, 64, 256)


def test_candidate_lists_of_every_sort_size_draw_as_the_reference():
    # candidates and kept tokens are sorted in 64, 128 or 256 slots (the fewest that hold them, cand 256): top-k
    # on both sides of each size (chunks of 4: enough chunk maxima for a bound, the candidates in registers),
    # fewer kept than candidates (top-p, min-p), each row drawn twice
    g = torch.Generator().manual_seed(14)
    top_k = torch.tensor([40, 64, 65, 128, 129, 200, 256, 250])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.3, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2])
    logits = (torch.randn(len(top_k), 1200, generator=g) * 1.5).repeat_interleave(2, 0)
    params = SP(temperature=torch.full((logits.shape[0],), 1.3), top_k=top_k.repeat_interleave(2),
                top_p=top_p.repeat_interleave(2), min_p=min_p.repeat_interleave(2))
    _check(logits, params, "candidate lists of every sort size", None, 8, 4, 256, "philox")


def test_rows_scanned_in_parts_draw_the_same_tokens_bit_for_bit(monkeypatch):
    # small batches on a GPU split each row's first pass over several programs (scan_parts), then one program
    # per row finishes it: the same tokens and logprobs bit for bit as one program per row, on every path
    # (greedy, top-k, nuclei in registers or searched, min-p, plain, masked rows, ties across the parts,
    # bf16), with parts of several tiles, of one, and empty ones (more parts than tiles)
    g = torch.Generator().manual_seed(15)
    V = 300
    logits = torch.randn(9, V, generator=g) * 2
    logits[1, [30, 150, 290]] = 9.0  # the max tied in three parts: the lowest id
    logits[2, 250] = 12.0  # the max in the last part
    logits[8] = torch.randint(-3, 3, (V,), generator=g).float()  # ties at every cut
    mask = torch.rand(9, V, generator=g) < 0.8
    mask[5] = False  # no allowed token: draws 0
    params = SP(temperature=torch.tensor([1.0, 0.0, 0.0, 0.8, 1.2, 1.0, 0.9, 1.1, 1.0]),
                top_k=torch.tensor([5, 0, 0, 0, 3, 0, 0, 40, 7]),
                top_p=torch.tensor([0.9, 1.0, 1.0, 0.95, 1.0, 1.0, 0.5, 1.0, 0.6]),
                min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.2, 0.0, 0.0]))
    seed, offset = ss.Philox(torch.arange(9) + 40).keys("test", 9, logits.device)
    for dtype, vocab_mask in ((torch.float32, None), (torch.bfloat16, mask)):
        rows = logits.to(dtype)
        args = (rows, *_row_params(params, 9, 1), None if vocab_mask is None else vocab_mask.contiguous(), seed,
                offset, torch.zeros(9, dtype=torch.int64))
        whole = sample_from_logits(*args, chunk=8, cand=16, tile=64, parts=0)
        for parts in (2, 7):  # 5 tiles of 64: parts of 3 and 2 tiles; of one tile, and two empty parts
            split = sample_from_logits(*args, chunk=8, cand=16, tile=64, parts=parts)
            assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1]), f"{dtype} parts {parts}"
    assert whole[0][5] == 0 and whole[1][5] == float("-inf")  # the masked row (last case)
    # by size on a GPU of 132 SMs (two programs each): parts that fill the 264 slots, at most one per tile
    h100 = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h100)
    monkeypatch.setattr(rows_module, "PROGRAMS_PER_SM", 2)  # the default, whatever the environment says
    cfg, gpu = row_config(128256), torch.device("cuda")
    assert [parts_per_row(rows, 128256, cfg, gpu) for rows in (1, 5, 64, 132, 133)] == [63, 52, 4, 2, 0]
    assert parts_per_row(1, 128256, cfg, torch.device("cpu")) == 0


def test_greedy_ties_across_tiles_and_chunks_go_to_the_lowest_id():
    # the first pass keeps a running maximum per chunk position of its 2048-token tiles (32 chunks of 64)
    # and reduces them once at the end: a tie in a later tile at an earlier position, or in the same
    # position, must not win over a lower id
    V = 3 * 2048 + 5
    logits = torch.zeros(4, V)
    for row, ids in enumerate(([4100, 2200, 5000], [4100, 2100, 6148], [6148, 64], [2047, 2048, 4095])):
        logits[row, ids] = 3.0
    logits[2, 0] = float("-inf")
    params = SP(temperature=0.0)
    for mask in (None, torch.ones(4, V, dtype=torch.bool)):
        tokens, _ = _kernel(logits, params, ss.Philox(5), mask)
        assert tokens.tolist() == [2200, 2100, 64, 2047]
    _check(logits, params, "greedy ties across tiles")
    # sampled rows find their row maximum in the same pass: top-k 1 keeps the same token
    tokens, _ = _kernel(logits, SP(temperature=1.0, top_k=1), ss.Philox(6))
    assert tokens.tolist() == [2200, 2100, 64, 2047]


def test_wide_nuclei_of_every_size_draw_as_the_reference():
    # rows wider than the reference's whole-row ordering: one token reaching top-p alone, a small
    # nucleus, one compacted down to its crossing bin, and flat rows cut densely (also with min-p
    # and a vocabulary mask): the reference's counted nuclei against the kernel's pivot search
    g = torch.Generator().manual_seed(9)
    V = 4099
    logits = torch.randn(8, V, generator=g) * 0.5
    logits[0, 17] += 30.0
    logits[1, torch.randperm(V, generator=g)[:12]] += 9.0
    logits[2:4, torch.randperm(V, generator=g)[: V // 40]] += 8.0
    mask = torch.rand(8, V, generator=g) > 0.3
    params = SP(temperature=torch.tensor([1.0, 0.9, 1.0, 0.7, 1.0, 1.3, 1.0, 0.8]),
                top_p=torch.tensor([0.9, 0.9, 0.95, 0.8, 0.9, 0.5, 0.9995, 0.9]),  # 0.9995: searched from m - 110 T
                min_p=torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.3]))
    _check(logits, params, "wide nuclei", None, 3, 64, 256)
    _check(logits, params, "wide nuclei, masked", mask, 4, 64, 256, streams="philox")


def test_strided_rows_are_read_in_place():
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(4, 150, generator=g).to(DEVICE)
    logits = wide[:, :100]  # a view on DEVICE (a copy there would be contiguous)
    assert not logits.is_contiguous()
    params = SP(temperature=torch.tensor([1.0, 0.0, 1.3, 0.9]), top_k=torch.tensor([0, 0, 9, 0]),
                top_p=torch.tensor([1.0, 1.0, 0.8, 0.6]))
    rp = _row_params(params, 4, 1)
    seed, offset = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    tokens, _ = sample_from_logits(logits, *rp, None, seed, offset, torch.zeros(4, dtype=torch.int64),
                                   chunk=8, cand=16)
    assert torch.equal(tokens, _reference(logits.cpu().contiguous(), params, ss.Philox(seed, offset))[0])


def test_launchers_take_philox_keys_or_uniforms_not_both():
    logits = torch.randn(2, 10)
    rp = _row_params(SP(), 2, 1)
    keys = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="either seed, offset and index"):
        sample_from_logits(logits, *rp, None, keys, keys, keys, torch.rand(2))
    with pytest.raises(ValueError, match="either seed, offset and index"):
        sample(logits.softmax(-1))
    tokens, logprobs = sample_from_logits(logits[:0], *(t[:0] for t in rp), u=torch.rand(0))
    assert tokens.shape == logprobs.shape == (0,)


@pytest.mark.parametrize("V", [1, 7, 300, 1024, 1536])  # 1024 and 1536: the reference inverts in two steps
def test_sample_kernel_draws_the_reference_tokens(V):
    g = torch.Generator().manual_seed(V)
    B = 6
    probs = torch.softmax(torch.randn(B, V, generator=g) * 3, -1)
    probs *= torch.rand(B, V, generator=g) < 0.6  # zeros, unnormalised rows
    probs[0] = 0.0  # no mass: token 0
    probs[1, : V // 2] = 0.0
    for chunk in (64, 4):
        seed, offset = torch.arange(B) * 31, torch.full((B,), 2)
        tokens = sample(probs, seed, offset, torch.zeros(B, dtype=torch.int64), chunk=chunk)
        assert torch.equal(tokens, ss.sample(probs, ss.Philox(seed, offset))), (V, chunk)
        u = uniform(torch.Generator().manual_seed(V), "test", B, 1, STREAM_SAMPLE, probs.device).reshape(-1)
        tokens = sample(probs, u=u, chunk=chunk)
        assert torch.equal(tokens, ss.sample(probs, torch.Generator().manual_seed(V))), (V, chunk)
        assert tokens[0] == 0
        assert (probs[torch.arange(B), tokens][1:] > 0).all()


def test_sample_kernel_reads_rows_whose_last_dim_is_strided():
    # probabilities with their first two dims swapped in memory (a column stride of 3): the kernel steps one
    # element per token, so such rows are made contiguous first (read in place, it drew tokens of probability 0)
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(3, 64, generator=g) * 3, -1) * (torch.rand(3, 64, generator=g) < 0.5)
    swapped = probs.transpose(0, 1).contiguous().transpose(0, 1)
    assert swapped.stride() == (1, 3)
    u = torch.rand(3, generator=g)
    assert torch.equal(sample(swapped, u=u), sample(probs, u=u))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_sample_kernel_stays_in_range_on_bad_probabilities():
    V = 9
    probs = torch.tensor([[0.0] * V, [math.nan] * V, [-1.0] * V, [math.inf] + [1.0] * (V - 1), [-1.0, 2.0] * 4 + [0.0]])
    for chunk in (64, 4):
        tokens = sample(probs, u=torch.rand(5), chunk=chunk)
        assert ((tokens >= 0) & (tokens < V)).all()
        assert tokens[4] % 2 == 1  # negative entries weigh 0


def test_draw_index_is_the_row_inside_the_request():
    # [B, K+1, V]: row i of request b draws Philox index i; the rows of a request differ
    logits = torch.zeros(2, 3, 50)
    seed, offset = torch.tensor([5, 9]), torch.tensor([0, 4])
    tokens, _ = _kernel(logits, SP(), ss.Philox(seed, offset), chunk=8, cand=16)
    assert torch.equal(tokens, _reference(logits, SP(), ss.Philox(seed, offset))[0])
    assert len(set(tokens[0].tolist())) > 1 or len(set(tokens[1].tolist())) > 1
