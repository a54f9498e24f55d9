"""specsampler.parallel on gloo groups of 2, 3 and 4 CPU processes (spawned once per world size and shard
layout): every rank returns the same results, equal to the one-device op on the whole rows, with
collectives whose rounds and bytes do not grow with the vocabulary."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import scenarios  # noqa: E402  (tests/parallel is on sys.path: pytest's rootdir-relative import)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specsampler as ss
from specsampler import parallel

WORLDS = (2, 3, 4)
DEADLINE_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, layout: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        bounds = scenarios.splits(world)[layout]
        shard = parallel.VocabShard(bounds[rank], bounds[rank + 1] - bounds[rank], scenarios.V)
        even = parallel.VocabShard.even(scenarios.V)
        results = {"even": (even.start, even.size)}
        for name, fn in scenarios.SCENARIOS.items():
            g = torch.Generator().manual_seed(1234)  # the same inputs on every rank
            try:
                results[name] = fn(shard, g)
            except Exception as e:  # reported by the test of that scenario, the others still run
                results[name] = f"raised {type(e).__name__}: {e}"
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[(w, layout) for w in WORLDS for layout in (0, 1)],
                ids=lambda p: f"world{p[0]}-{'even' if p[1] == 0 else 'uneven'}")
def ranks(request):
    """The results of every rank of one spawned group: ``[rank] -> {scenario: result}``."""
    world, layout = request.param
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), layout, out), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"world {world}: the group did not finish in {DEADLINE_S} s (a rank waits in a collective)")
        results = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _same_on_every_rank(ranks, name):
    first = ranks[0][name]
    assert not isinstance(first, str), first
    for r, res in enumerate(ranks[1:], 1):
        assert res[name] == first, f"rank {r} differs from rank 0 in {name}"
    return first


def test_greedy_sampling_equals_the_one_device_op_on_every_rank(ranks):
    got, want, calls = _same_on_every_rank(ranks, "sample")
    assert got == want
    assert [c for c, _ in calls] == ["all_reduce"]


def test_greedy_chain_verification_equals_the_one_device_op_on_every_rank(ranks):
    for got, want, calls in _same_on_every_rank(ranks, "chain"):
        assert got == want
        assert len(calls) == 1


def test_greedy_tree_verification_equals_the_one_device_op_on_every_rank(ranks):
    for got, want, calls in _same_on_every_rank(ranks, "tree"):
        assert got == want
        assert len(calls) == 1


def test_sampling_with_every_parameter_mix_equals_the_one_device_op_on_every_rank(ranks):
    for got, want, _ in _same_on_every_rank(ranks, "sampled"):
        assert got == want


def test_every_chain_method_equals_the_one_device_op_on_every_rank(ranks):
    for method, got, want, _ in _same_on_every_rank(ranks, "sampled_chain"):
        assert got == want, method


def test_every_tree_method_equals_the_one_device_op_on_every_rank(ranks):
    for method, got, want, _ in _same_on_every_rank(ranks, "sampled_tree"):
        assert got == want, method


def test_every_collective_sends_at_most_64_scalars_per_row(ranks):
    """Every call sends O(B * (K+1)) scalars per pivot or candidate (at most 16 rows x 64 here); that this does
    not grow with the vocabulary is test_rounds_and_bytes_do_not_grow_with_the_vocabulary's."""
    for name in ("sampled", "sampled_chain", "sampled_tree"):
        for entry in ranks[0][name]:
            for _, sent in entry[-1]:
                assert sent <= 8 * 16 * 64, (name, sent)  # rows x (63 pivots + 1), 8 bytes each


def test_rounds_and_bytes_do_not_grow_with_the_vocabulary(ranks):
    (small, small_out), (large, large_out) = ranks[0]["comms"]
    assert small == large
    assert small_out == large_out  # the same decisions at both sizes: the comparison is of like with like
    assert small[0] == [("all_reduce", 8 * 4)]  # greedy sampling: one int64 key per row


def test_errors_are_raised_on_every_rank_and_none_waits(ranks):
    assert _same_on_every_rank(ranks, "errors") == ["ValidationError", "ValidationError", "ValidationError"]


def test_parallel_verification_is_exact_against_the_oracle(ranks):
    results = _same_on_every_rank(ranks, "exactness")
    if results is None:
        pytest.skip("the Monte Carlo runs at world size 2")
    for name, (p_emitted, *rest) in results.items():
        assert rest[-1] == 0, f"{name}: outcomes of probability 0"
        assert p_emitted > 1e-4, f"{name}: emitted sequences differ from the oracle's (p = {p_emitted:.2e})"
        if len(rest) == 2:
            assert rest[0] > 1e-4, f"{name}: continued sequences differ from the target's joint distribution"


# VocabShard.even at V = 37: ceil(37 / world) ids per rank in rank order, the last rank the rest
EVEN = {2: [(0, 19), (19, 18)], 3: [(0, 13), (13, 13), (26, 11)], 4: [(0, 10), (10, 10), (20, 10), (30, 7)]}


def test_even_shards_follow_megatrons_split(ranks):
    assert [tuple(r["even"]) for r in ranks] == EVEN[len(ranks)]


def test_shard_arguments_are_checked():
    with pytest.raises(ValueError, match="size"):
        parallel.VocabShard(30, 8, 37)
    with pytest.raises(ValueError, match="shard"):
        parallel.sample_from_logits(torch.zeros(1, 5), shard=None)
    with pytest.raises(ValueError, match=r"shard.size = 4"):
        parallel.sample_from_logits(torch.zeros(1, 5), ss.SamplingParams(temperature=0.0),
                                    shard=parallel.VocabShard(0, 4, 8))


def test_the_torchrun_example_runs_on_two_ranks():
    root = Path(__file__).resolve().parents[2]
    torchrun = Path(sys.executable).with_name("torchrun")
    res = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(root / "examples" / "vocab_parallel.py")],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("accepted [5, 2, 5, 5], 1 collective of 192 bytes") == 2, res.stdout
