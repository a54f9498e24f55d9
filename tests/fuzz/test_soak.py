"""Soak and thread tests: many calls of mixed ops and shapes in one process keep resident memory flat,
and ops called from 4 threads at once give the tokens of the same calls made one after another.

Sizes: CI runs ``SOAK_CALLS`` = 2,000 calls; ``SPECSAMPLER_FULL_FUZZ=1`` runs 20,000. Both on the PyTorch
path on the CPU (the Triton interpreter is too slow for thousands of calls, and it keeps launch state in
module globals, so it cannot run from threads); on a GPU the thread test also runs the real kernels.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable

import pytest
import torch
from fuzzkit import FULL, use_backend

import specsampler as ss
from specsampler import mlc

SOAK_CALLS = 20_000 if FULL else 2_000
RSS_GROWTH_BOUND = 8 * 2**20  # bytes the calls after warm-up may add (measured: 0.6 MiB over 20,000; allocator noise)
SHAPES = [(B, K, V) for B in (1, 4) for K in (0, 2, 5) for V in (7, 300, 2048)]  # 18 (B, K or N - 1, V)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _call(i: int, device: str = "cpu") -> object:
    """Call ``i`` of the mix: the op and shape cycle with ``i`` (every op meets every shape), the values
    and seeds come from ``i``. Returns what the op returns."""
    ops = len(_OPS)
    B, K, V = SHAPES[(i // ops) % len(SHAPES)]
    g = torch.Generator().manual_seed(i)
    return _OPS[i % ops](g, B, K, V, ss.Philox(torch.arange(B, device=device) + i), device)


def _logits(g, *shape, device):
    return (torch.randn(*shape, generator=g) * 3).to(device)


def _probs(g, *shape, device):
    return torch.softmax(torch.randn(*shape, generator=g) * 3, -1).to(device)


def _chain_tree(B: int, K: int, device: str) -> ss.TokenTree:
    """A tree of 1 + K nodes: a chain of K // 2 + 1 below the root, the rest children of the root."""
    parents = [-1] + [i if i <= K // 2 + 1 else 0 for i in range(K)]
    return ss.TokenTree.from_parents(torch.tensor([parents] * B)).to(device)


_METHODS = ("token", "block", "target_only", "greedy")
_TREE_METHODS = ("rrs", "traversal", "target_only", "greedy")


def _sample(g, B, K, V, rng, dev):
    p = ss.SamplingParams(temperature=0.8, top_k=min(V, 20) if K else 0, top_p=0.9 if K % 2 else 1.0)
    return ss.sample_from_logits(_logits(g, B, V, device=dev), p, rng, num_logprobs=K)


def _filters(g, B, K, V, rng, dev):
    p = ss.top_p_renorm(ss.top_k_renorm(_probs(g, B, V, device=dev), K + 1), 0.8)
    return ss.sample(ss.min_p_renorm(p, 0.05), rng)


def _chain(g, B, K, V, rng, dev):
    method = _METHODS[int(torch.randint(4, (1,), generator=g))]
    q = _probs(g, B, K, V, device=dev) if method in ("token", "block") else None
    drafts = torch.randint(V, (B, K), generator=g).to(dev)
    return ss.verify_chain(_probs(g, B, K + 1, V, device=dev), drafts, q, method=method, rng=rng)


def _chain_logits(g, B, K, V, rng, dev):
    method = _METHODS[int(torch.randint(4, (1,), generator=g))]
    q = _probs(g, B, K, V, device=dev) if method in ("token", "block") else None
    drafts = torch.randint(V, (B, K), generator=g).to(dev)
    params = ss.SamplingParams(temperature=torch.rand(B, generator=g).to(dev), top_p=0.9)
    return ss.verify_chain_from_logits(_logits(g, B, K + 1, V, device=dev), drafts, params, draft_probs=q,
                                       method=method, rng=rng)


def _tree(g, B, K, V, rng, dev):
    method = _TREE_METHODS[int(torch.randint(4, (1,), generator=g))]
    tree = _chain_tree(B, K, dev)
    q = _probs(g, B, K + 1, V, device=dev) if method in ("rrs", "traversal") else None
    drafts = torch.randint(V, (B, K + 1), generator=g).to(dev)
    sampling = "iid" if K % 2 else "without_replacement"
    return ss.verify_tree(_probs(g, B, K + 1, V, device=dev), drafts, tree, q, method=method, draft_sampling=sampling,
                          rng=rng)


def _tree_logits(g, B, K, V, rng, dev):
    method = _TREE_METHODS[int(torch.randint(4, (1,), generator=g))]
    tree = _chain_tree(B, K, dev)
    q = _probs(g, B, K + 1, V, device=dev) if method in ("rrs", "traversal") else None
    drafts = torch.randint(V, (B, K + 1), generator=g).to(dev)
    return ss.verify_tree_from_logits(_logits(g, B, K + 1, V, device=dev), drafts, tree, ss.SamplingParams(top_k=5),
                                      draft_probs=q, method=method, rng=rng)


def _kv(g, B, K, V, rng, dev):
    cache = [(torch.randn(B, 2, K + 4, 8, generator=g).to(dev), torch.randn(B, 2, K + 4, 8, generator=g).to(dev))]
    res = ss.verify_tree(_probs(g, B, K + 1, V, device=dev), torch.randint(V, (B, K + 1), generator=g).to(dev),
                         _chain_tree(B, K, dev), method="target_only", rng=rng)
    ss.compact_kv(cache, torch.full((B,), 2, device=dev), res.path, res.num_accepted)
    return cache[0][0]


def _mlc(g, B, K, V, rng, dev):
    n = B * (K + 1)
    fc = torch.tensor([(i + 1) if (i + 1) % (K + 1) else -1 for i in range(n)], device=dev)
    ns = torch.full((n,), -1, device=dev)
    model = _probs(g, n, V, device=dev)
    ptr = torch.arange(0, n, K + 1, device=dev)
    mlc.batch_spec_verify(_probs(g, n, V, device=dev), torch.randint(V, (n,), generator=g).to(dev), model, fc, ns,
                          torch.rand(n, generator=g).to(dev), ptr)
    return ptr


_OPS: list[Callable] = [_sample, _filters, _chain, _chain_logits, _tree, _tree_logits, _kv, _mlc]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from /proc/self/statm")
def test_resident_memory_stays_flat_over_thousands_of_mixed_calls():
    warmup = 2 * len(_OPS) * len(SHAPES)  # every op at every shape, twice (scratch buffers reach their sizes)
    with use_backend("torch"):
        for i in range(warmup):
            _call(i)
        gc.collect()
        start = _rss()
        peak_growth = 0
        for i in range(warmup, warmup + SOAK_CALLS):
            _call(i)
            if i % 500 == 0:
                gc.collect()
                peak_growth = max(peak_growth, _rss() - start)
        gc.collect()
        growth = max(peak_growth, _rss() - start)
    assert growth <= RSS_GROWTH_BOUND, (f"resident memory grew by {growth / 2**20:.1f} MiB over {SOAK_CALLS} calls "
                                        f"after warm-up (bound {RSS_GROWTH_BOUND / 2**20:.0f} MiB)")


def _tokens(out) -> list[torch.Tensor]:
    """The integer outputs of an op's result, on the CPU, to compare bit for bit."""
    if isinstance(out, torch.Tensor):
        return [out.cpu()]
    if isinstance(out, ss.SampleOutput):
        return [t.cpu() for t in out if t is not None]
    if isinstance(out, ss.ChainResult):
        return [out.tokens.cpu(), out.num_accepted.cpu()]
    return [out.path.cpu(), out.tokens.cpu(), out.num_accepted.cpu()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_four_threads_give_the_tokens_of_sequential_calls(device):
    calls = range(4 * len(_OPS) * 3)  # each op at 3 shapes per thread
    backend = "torch" if device == "cpu" else "triton"
    with use_backend(backend):
        expected = {i: _tokens(_call(i, device)) for i in calls}
        got: dict[int, list[torch.Tensor]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def worker(k: int) -> None:
            try:
                start.wait()
                for i in calls[k::4]:
                    got[i] = _tokens(_call(i, device))
            except BaseException as err:  # reported by the main thread
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    for i in calls:
        assert all(torch.equal(a, b) for a, b in zip(got[i], expected[i])), f"call {i}: threads differ from sequential"
