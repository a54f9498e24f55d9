"""GPU only (skipped without CUDA): the kernels at real sizes against the references on the same
streams, without host synchronisation, inside captured CUDA graphs (replays with advanced Philox offsets
equal eager runs), and under ``torch.compile(fullgraph=True)``."""

import os

import pytest
import torch
from kernelcheck import KERNEL_OPS, as_tuple, public_op_calls

import specsampler as ss

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _reference(monkeypatch, fn):
    """fn() on the PyTorch reference (CPU copies of the inputs are made by fn itself)."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    try:
        return fn()
    finally:
        monkeypatch.delenv("SPECSAMPLER_BACKEND")


def _chain_inputs(B=16, K=4, V=32000, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 4
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 4, -1)
    x = torch.where(torch.rand(B, K, generator=g) < 0.8, p[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g))
    return logits, p, x, q


@pytest.mark.parametrize("method", ["token", "block", "target_only", "greedy"])
def test_chain_kernel_equals_the_reference_at_a_real_vocabulary(monkeypatch, method):
    _, p, x, q = _chain_inputs(V=128256)
    q = q if method in ("token", "block") else None
    rng = ss.Philox(torch.arange(p.shape[0]), 3)
    got = ss.verify_chain(p.to(CUDA), x.to(CUDA), None if q is None else q.to(CUDA), method=method,
                          rng=ss.Philox(torch.arange(p.shape[0], device=CUDA), 3))
    ref = _reference(monkeypatch, lambda: ss.verify_chain(p, x, q, method=method, rng=rng))
    assert (got.tokens.cpu() != ref.tokens).any(1).sum() <= 1  # identical but for a float rounding tie
    torch.testing.assert_close(got.expected_accepted.cpu(), ref.expected_accepted, rtol=1e-4, atol=1e-5)


def _capture(fn):
    """A CUDA graph of fn() (after a warm-up on a side stream) and its static outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_graph_replays_with_advanced_offsets_equal_eager_runs():
    _, p, x, q = _chain_inputs()
    p, x, q = p.to(CUDA), x.to(CUDA), q.to(CUDA)
    B = p.shape[0]
    seed = torch.arange(B, device=CUDA) * 13
    offset = torch.zeros(B, dtype=torch.int64, device=CUDA)
    rng = ss.Philox(seed, offset)
    graph, out = _capture(lambda: ss.verify_chain(p, x, q, method="token", rng=rng).tokens)
    for step in range(4):
        offset.fill_(step)
        graph.replay()
        eager = ss.verify_chain(p, x, q, method="token", rng=ss.Philox(seed, step)).tokens
        assert torch.equal(out, eager)
    draws = set()
    for step in range(4):  # the offsets really change the draws
        offset.fill_(step)
        graph.replay()
        draws.add(tuple(out[:, -1].tolist()))
    assert len(draws) > 1


def test_tree_and_sampling_ops_capture_in_a_graph():
    B, V = 8, 32000
    g = torch.Generator().manual_seed(1)
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 1, 2]] * B)).to(CUDA)
    p = torch.softmax(torch.randn(B, tree.size, V, generator=g) * 4, -1).to(CUDA)
    q = torch.softmax(torch.randn(B, tree.size, V, generator=g) * 4, -1).to(CUDA)
    x = torch.randint(0, V, (B, tree.size), generator=g).to(CUDA)
    logits = (torch.randn(B, V, generator=g) * 4).to(CUDA)
    offset = torch.zeros(B, dtype=torch.int64, device=CUDA)
    rng = ss.Philox(torch.arange(B, device=CUDA), offset)
    params = ss.SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    for op in (lambda r: ss.verify_tree(p, x, tree, q, method="traversal", rng=r).tokens,
               lambda r: ss.sample_from_logits(logits, params, r).tokens):
        graph, out = _capture(lambda op=op: op(rng))
        for step in (2, 5):
            offset.fill_(step)
            graph.replay()
            assert torch.equal(out, op(ss.Philox(torch.arange(B, device=CUDA), step)))


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_every_kernel_op_runs_without_host_sync_and_replays_in_a_graph(name):
    """Each public function that runs a kernel: no host synchronisation once its kernels are compiled
    (``torch.cuda.set_sync_debug_mode("error")`` raises on any), and a captured graph's replays at
    advanced offsets equal eager runs."""
    call = public_op_calls(CUDA, V=32000)[name]
    seed = torch.arange(3, device=CUDA) * 7
    offset = torch.zeros(3, dtype=torch.int64, device=CUDA)
    call(ss.Philox(seed, offset))  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(ss.Philox(seed, offset))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, out = _capture(lambda: call(ss.Philox(seed, offset)))
    for step in (3, 11):
        offset.fill_(step)
        graph.replay()
        eager = call(ss.Philox(seed, torch.full_like(offset, step)))
        for got, want in zip(as_tuple(out), as_tuple(eager), strict=True):
            assert torch.equal(got, want), f"{name}: graph replay at offset {step} differs from the eager run"


@pytest.mark.skipif(os.environ.get("SPECSAMPLER_SKIP_COMPILE") == "1", reason="compile disabled")
@pytest.mark.parametrize("name", KERNEL_OPS)
def test_ops_work_under_torch_compile_fullgraph(name):
    """Each kernel op compiled with inductor in one graph with the Python around it, as eager."""
    torch._dynamo.reset()
    call = public_op_calls(CUDA, V=4096)[name]
    seed = torch.arange(3, device=CUDA)
    offset = torch.full((3,), 4, dtype=torch.int64, device=CUDA)

    def step(seed, offset):
        return call(ss.Philox(seed, offset))

    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(as_tuple(compiled(seed, offset)), as_tuple(step(seed, offset)), strict=True):
        assert torch.equal(got, want), f"{name}: compiled and eager differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_from_logits_is_the_same_with_rows_described_in_parallel(dtype):
    """The small-batch mode describes rows in a kernel of its own: compiled apart from the chain kernel, it
    must round every sum as the chain kernel does (same code, warps and tiles), or a request's tokens
    would depend on its batch's size."""
    from specsampler.kernels import chain as kchain

    B, K, V = 6, 4, 128256
    logits, p, x, q = _chain_inputs(B=B, K=K, V=V, seed=5)
    rows = B * (K + 1)
    g = torch.Generator().manual_seed(6)
    params = (torch.rand(rows, generator=g) + 0.5, torch.tensor([50, 0, 5000, 1] * rows)[:rows],
              torch.tensor([0.95, 0.8, 1.0] * rows)[:rows], torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0] * rows)[:rows])
    params = tuple(t.to(CUDA) for t in params)
    args = (logits.to(CUDA, dtype), x.to(CUDA), q.to(CUDA), torch.full((B,), K, device=CUDA))
    seed, offset = torch.arange(B, device=CUDA), torch.zeros(B, dtype=torch.int64, device=CUDA)
    for method in kchain.METHODS:
        outs = [kchain.verify_chain_from_logits(*args, method, *params, None, seed, offset, rows_in_parallel=mode)
                for mode in (False, True)]
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), method


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_only_draws_are_the_sampling_kernels_tokens(dtype):
    """target_only's draw at each position is sample_from_logits' for that row: two kernels compiled apart
    (both without FMA contraction) that must round every sum alike, plain-temperature rows included."""
    from specsampler.kernels import chain as kchain
    from specsampler.kernels import sampling as ksampling

    B, K, V = 6, 4, 128256
    logits, _, x, _ = _chain_inputs(B=B, K=K, V=V, seed=7)
    rows = B * (K + 1)
    g = torch.Generator().manual_seed(8)
    params = (torch.rand(rows, generator=g) + 0.5, torch.tensor([50, 0, 0, 5000, 1] * rows)[:rows],
              torch.tensor([0.95, 0.8, 1.0] * rows)[:rows], torch.tensor([0.0, 0.0, 0.0, 0.1] * rows)[:rows])
    params = tuple(t.to(CUDA) for t in params)
    logits = logits.to(CUDA, dtype)
    seed, offset = torch.arange(B, device=CUDA), torch.full((B,), 3, dtype=torch.int64, device=CUDA)
    tokens, n = kchain.verify_chain_from_logits(logits, x.to(CUDA), None, None, "target_only", *params, None, seed,
                                                offset)
    draws, _ = ksampling.sample_from_logits(logits.view(rows, V), *params, None, seed.repeat_interleave(K + 1),
                                            offset.repeat_interleave(K + 1), torch.arange(K + 1, device=CUDA).repeat(B))
    draws = draws.view(B, K + 1)
    upto = torch.arange(K + 1, device=CUDA) <= n[:, None]
    assert torch.equal(tokens[upto], draws[upto])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_passes_split_over_programs_change_no_token(dtype):
    """Small batches split each row's first pass over several programs (scan_parts, then one program per row):
    compiled apart from the kernels' own first pass, it must give the same results bit for bit (sampling at
    B=1 and 5, a chain at B=1 for every method)."""
    from specsampler.kernels import chain as kchain
    from specsampler.kernels import sampling as ksampling
    from specsampler.kernels.rows import parts_per_row, row_config

    V = 128256
    g = torch.Generator().manual_seed(9)
    assert parts_per_row(1, V, row_config(V), torch.device(CUDA)) >= 2
    for R in (1, 5):
        logits = (torch.randn(R, V, generator=g) * 4).to(CUDA, dtype)
        params = tuple(t[:R].to(CUDA) for t in (torch.tensor([1.0, 0.0, 0.7, 1.2, 1.0]), torch.tensor([50, 0, 0, 0, 5]),
                                                   torch.tensor([0.95, 1.0, 0.9, 1.0, 1.0]),
                                                   torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0])))
        u = torch.rand(R, generator=g).to(CUDA)
        whole = ksampling.sample_from_logits(logits, *params, u=u, parts=0)
        split = ksampling.sample_from_logits(logits, *params, u=u)
        assert torch.equal(whole[0], split[0]) and torch.equal(whole[1], split[1]), f"sampling R={R}"
    logits, _, x, q = _chain_inputs(B=1, K=4, V=V, seed=10)
    params = (torch.tensor([1.0, 0.8, 1.0, 1.2, 0.9]), torch.tensor([50, 50, 0, 0, 50]),
              torch.tensor([0.95, 0.95, 0.9, 1.0, 1.0]), torch.zeros(5))
    params = tuple(t.to(CUDA) for t in params)
    seed, offset = torch.arange(1, device=CUDA), torch.zeros(1, dtype=torch.int64, device=CUDA)
    for method in kchain.METHODS:
        qm = q.to(CUDA) if method in ("token", "block") else None
        args = (logits.to(CUDA, dtype), x.to(CUDA), qm, None, method, *params, None, seed, offset)
        whole = kchain.verify_chain_from_logits(*args, rows_in_parallel=True, parts=0)
        split = kchain.verify_chain_from_logits(*args, rows_in_parallel=True)
        assert torch.equal(whole[0], split[0]) and torch.equal(whole[1], split[1]), method
