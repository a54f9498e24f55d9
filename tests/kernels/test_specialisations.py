"""Bounded specialisations: for one model (V, logits dtype), a serving-like trace of public calls compiles only
what ``specsampler.warmup`` compiles, at most 4 kernels per op and method for each vocabulary-mask mode, whatever
the batch size, chain length, tree shape, per-row parameters, draft kinds and randomness of the calls.

Keys are those Triton's JIT computes for an sm_90 target (tests/helpers/specialisations.py), with the launchers'
size decisions as on a GPU of 132 SMs; the kernels only record (no kernel time), so batches of 1024 cost nothing."""

import collections
import os
import random

import pytest
import torch
from specialisations import recorded_specialisations

import specsampler as ss
from specsampler.kernels import chain as kchain
from specsampler.kernels import rows as krows
from specsampler.kernels.warmup import launches


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """Public ops on CPU tensors run the kernels (interpreted), sized as on an H100 (132 SMs)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run in the Triton interpreter here")
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    monkeypatch.setattr(krows, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(kchain, "multiprocessors", lambda device: 132)


def _tree(r: random.Random, B: int) -> ss.TokenTree:
    """A random tree of up to 128 nodes and depth up to 16 (the same for every request, or one per request)."""
    N = r.choice([2, 3, 5, 8, 16, 33, 64, 128])
    max_depth = r.randint(1, min(16, N - 1))
    depth = [0]
    parents = [-1]
    for i in range(1, N):
        # a parent among the earlier nodes less deep than the maximum
        choices = [j for j in range(i) if depth[j] < max_depth]
        p = r.choice(choices)
        parents.append(p)
        depth.append(depth[p] + 1)
    rows = torch.tensor(parents)[None].repeat(B, 1)
    if B > 1 and r.random() < 0.3:
        rows[1:, -1] = -1  # some requests with a node absent
    return ss.TokenTree.from_parents(rows)


def _params(r: random.Random, rows: int, V: int) -> ss.SamplingParams:
    """Per-row mixes of greedy, temperature, top-k (including 1 and V), top-p and min-p, or scalars."""
    if r.random() < 0.3:
        return ss.SamplingParams(temperature=r.choice([0.0, 0.7, 1.0]), top_k=r.choice([0, 1, 50, V]),
                                 top_p=r.choice([1.0, 0.9]), min_p=r.choice([0.0, 0.05]))
    g = torch.Generator().manual_seed(r.randrange(1 << 30))
    pick = lambda values: torch.tensor(values)[torch.randint(len(values), (rows,), generator=g)]  # noqa: E731
    return ss.SamplingParams(temperature=pick([0.0, 0.7, 1.0, 1.3]), top_k=pick([0, 1, 20, 50, V]),
                             top_p=pick([1.0, 0.95, 0.5]), min_p=pick([0.0, 0.0, 0.1]))


def _rng(r: random.Random, B: int):
    if r.random() < 0.5:
        return ss.Philox(torch.randint(0, 1 << 40, (B,)), torch.randint(0, 100, (B,)))
    return torch.Generator().manual_seed(r.randrange(1000))


def _mask(r: random.Random, shape: tuple, V: int, with_mask: bool):
    if not with_mask:
        return None
    return torch.ones(*shape, V, dtype=torch.bool) if r.random() < 0.5 else torch.ones(V, dtype=torch.bool)


def _call(r: random.Random, V: int, dtype: torch.dtype, with_mask: bool) -> tuple[str, str]:
    """One public call of the trace; returns its (op, method)."""
    B = r.choice([1, 2, 3, 5, 8, 16, 31, 64, 100, 257, 512, 1024])
    kind = r.choice(["sample", "sample", "chain", "chain", "chain", "tree", "tree", "chain_probs", "tree_probs",
                     "sample_probs"])
    ints = r.choice([torch.int32, torch.int64])
    if kind == "sample":
        lead = (B,) if r.random() < 0.7 else (B, r.randint(1, 4))  # one row per request, or several
        ss.sample_from_logits(torch.zeros(*lead, V, dtype=dtype), _params(r, B, V) if len(lead) == 1 else
                              ss.SamplingParams(temperature=0.9, top_p=0.9), rng=_rng(r, B),
                              vocab_mask=_mask(r, lead, V, with_mask))
        return "sample_from_logits", "sample"
    if kind == "sample_probs":
        ss.sample(torch.full((B, V), 1.0 / V), rng=_rng(r, B))
        return "sample", "sample"
    if kind in ("chain", "chain_probs"):
        K = r.randint(1, 16) if B <= 256 else r.randint(1, 4)
        method = r.choice(list(kchain.METHODS))
        drafts = torch.randint(0, V, (B, K)).to(ints)
        q = torch.full((B, K, V), 1.0 / V) if method in ("token", "block") else None
        num_drafts = torch.randint(0, K + 1, (B,)).to(ints) if r.random() < 0.5 else None
        if kind == "chain":
            ss.verify_chain_from_logits(torch.zeros(B, K + 1, V, dtype=dtype), drafts, _params(r, B, V),
                                        draft_probs=q, num_drafts=num_drafts, method=method, rng=_rng(r, B),
                                        vocab_mask=_mask(r, (B, K + 1), V, with_mask))
            return "verify_chain_from_logits", method
        ss.verify_chain(torch.full((B, K + 1, V), 1.0 / V), drafts, q, num_drafts=num_drafts, method=method,
                        rng=_rng(r, B))
        return "verify_chain", method
    B = min(B, 64)  # trees of up to 128 nodes
    tree = _tree(r, B)
    N = tree.size
    method = r.choice(["greedy", "target_only", "rrs", "traversal"])
    sampling = r.choice(["iid", "without_replacement"]) if method in ("rrs", "traversal") else "iid"
    q = torch.full((B, N, V), 1.0 / V) if method in ("rrs", "traversal") else None
    drafts = torch.randint(0, V, (B, N)).to(ints)
    if kind == "tree":
        ss.verify_tree_from_logits(torch.zeros(B, N, V, dtype=dtype), drafts, tree, _params(r, B, V), draft_probs=q,
                                   method=method, draft_sampling=sampling, rng=_rng(r, B),
                                   vocab_mask=_mask(r, (B, N), V, with_mask))
        return "verify_tree_from_logits", method
    ss.verify_tree(torch.full((B, N, V), 1.0 / V), drafts, tree, q, method=method, draft_sampling=sampling,
                   rng=_rng(r, B))
    return "verify_tree", method


@pytest.mark.parametrize("V, dtype", [(4096, torch.bfloat16), (4101, torch.float32)])
def test_a_serving_trace_compiles_only_what_warmup_compiled(as_on_a_gpu, V, dtype):
    with recorded_specialisations(execute=False) as warm:
        for launch in launches(V, dtype, "cpu"):
            launch.run()
    r = random.Random(V)
    per_op: dict[tuple, set] = collections.defaultdict(set)
    traced: dict[str, set] = collections.defaultdict(set)
    for _ in range(240):
        with_mask = r.random() < 0.25
        with recorded_specialisations(execute=False) as keys:
            op, method = _call(r, V, dtype, with_mask)
        for kernel, ks in keys.items():
            traced[kernel] |= ks
            per_op[op, method, with_mask] |= {(kernel, k) for k in ks}
    assert len(per_op) >= 20  # the trace reached every op and method, with and without masks
    for kernel, ks in traced.items():
        assert ks <= warm[kernel], f"{kernel}: {len(ks - warm[kernel])} specialisation(s) warmup did not compile"
    for (op, method, with_mask), ks in per_op.items():
        assert len(ks) <= 4, f"{op} {method} mask={with_mask}: {len(ks)} specialisations"


def test_sizes_and_randomness_are_not_compiled_in(as_on_a_gpu):
    """The same op at two batch sizes, chain lengths 1 and 16 (K = 1 would be a constant to Triton), ragged or
    full drafts, int32 or int64 drafts, Philox or a generator: one key per kernel."""
    V = 4096
    calls = []
    for B, K, ints, ragged, philox in [(1, 1, torch.int64, False, True), (300, 16, torch.int32, True, False)]:
        logits = torch.zeros(B, K + 1, V, dtype=torch.bfloat16)
        drafts = torch.zeros(B, K, dtype=ints)
        rng = ss.Philox(torch.arange(B)) if philox else torch.Generator().manual_seed(0)
        calls.append(lambda logits=logits, drafts=drafts, rng=rng, B=B, K=K, ragged=ragged: (
            ss.verify_chain_from_logits(logits, drafts, ss.SamplingParams(temperature=0.7, top_p=0.9),
                                        draft_probs=torch.zeros(B, K, V), method="token", rng=rng,
                                        num_drafts=torch.full((B,), K // 2) if ragged else None)))
    with recorded_specialisations(execute=False) as keys:
        for call in calls:
            call()
    assert set(keys) == {"_describe_rows_kernel", "_chain_kernel", "_scan_parts_kernel"}
    assert all(len(ks) == 1 for ks in keys.values()), {k: len(v) for k, v in keys.items()}


def test_warmup_runs_one_launch_per_specialisation_and_reports_each(as_on_a_gpu):
    """``specsampler.warmup`` (here in the interpreter) runs every launch of the chosen methods, and the records
    name each: op, method, variant, seconds."""
    records = ss.warmup(300, torch.float32, "cpu", ["sample", "traversal"], masks=(False,), workers=1)
    assert [(r["op"], r["method"], r["variant"]) for r in records] == [
        ("sample_from_logits", "sample", "mask=False"), ("sample", "sample", ""),
        ("verify_tree_from_logits", "traversal", "iid mask=False"), ("verify_tree", "traversal", "iid"),
        ("verify_tree_from_logits", "traversal", "without_replacement mask=False"),
        ("verify_tree", "traversal", "without_replacement")]
    assert all(r["seconds"] >= 0 for r in records)


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=1), "vocab_size: expected an int >= 2, got 1"),
    (dict(vocab_size=100, dtype=torch.int32), "dtype: expected one of"),
    (dict(vocab_size=100, methods=["tokens"]), "methods: expected names from"),
    (dict(vocab_size=100, masks=()), "masks: expected a non-empty sequence of bools"),
])
def test_warmup_rejects_bad_arguments_by_name(kwargs, message):
    with pytest.raises(ValueError, match=f"warmup: {message}"):
        ss.warmup(**{"device": "cpu", **kwargs})


def test_the_warmup_command_prints_a_table(as_on_a_gpu, capsys):
    from specsampler.cli import main

    assert main(["warmup", "--vocab-size", "300", "--dtype", "float32", "--device", "cpu", "--methods", "sample",
                 "--masks", "none", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "sample_from_logits" in out and "2 launches warmed up" in out and "Triton's cache" in out, out
