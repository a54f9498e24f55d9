"""Vocab-parallel ops against gathering the logits: ``python benchmarks/parallel.py [--worlds 2 4 8]``.

For each world size, a gloo group of processes on this machine; each rank holds its shard of the target logits
``[B, K+1, V]`` (B = 32, K = 8, V = 128256). For each op (greedy chain verification; token verification with
temperature 0.8, top-p 0.9 and draft probabilities; sampling with top-p 0.9 and top-k 50), per rank and call:
the collectives (rounds, bytes sent, counted by ``specsampler.parallel.count_collectives``) and the median time of

- ``parallel``: the ``specsampler.parallel`` op on the shard;
- ``gather``: what engines do: ``all_gather`` of the logits (and draft probabilities), then the one-device op on
  the whole rows (the same tokens: checked);
- ``floor``: one read of the shard (a ``sum``), the least any op costs.

Times are of gloo on CPU processes sharing this machine's cores: they say how the two compare here, not what
NCCL on GPUs gives; bytes and rounds are exact. Prints a table; ``--out`` writes JSON records.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specsampler as ss
from specsampler import parallel

B, K, V = 32, 8, 128256


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ops(shard, world: int) -> dict:
    """name -> (parallel call, gather call, bytes of the shard read): the ops measured, on this rank's inputs."""
    per = -(-V // world)
    g = torch.Generator().manual_seed(dist.get_rank())
    local = torch.randn(B, K + 1, per, generator=g)[..., : shard.size].contiguous() * 3  # pad-free shard
    q_local = torch.rand(B, K, per, generator=g)[..., : shard.size].contiguous() / V
    drafts = torch.randint(0, V, (B, K), generator=torch.Generator().manual_seed(7))
    rng = ss.Philox(torch.arange(B), 11)
    sampled = ss.SamplingParams(temperature=0.8, top_p=0.9)

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty(*t.shape[:-1], per) for _ in range(world)]
        dist.all_gather(parts, torch.nn.functional.pad(t, (0, per - t.shape[-1])))
        return torch.cat(parts, -1)[..., :V]

    return {
        "verify_chain_from_logits greedy": (
            lambda: parallel.verify_chain_from_logits(local, drafts, method="greedy", shard=shard),
            lambda: ss.verify_chain_from_logits(gather(local), drafts, method="greedy"), local.numel() * 4),
        "verify_chain_from_logits token, T 0.8, top-p 0.9": (
            lambda: parallel.verify_chain_from_logits(local, drafts, sampled, draft_probs=q_local, method="token",
                                                      rng=rng, shard=shard),
            lambda: ss.verify_chain_from_logits(gather(local), drafts, sampled, draft_probs=gather(q_local),
                                                method="token", rng=rng), (local.numel() + q_local.numel()) * 4),
        "sample_from_logits T 0.8, top-k 50 / top-p 0.9": (
            lambda: parallel.sample_from_logits(local[:, 0], _mixed(), rng, shard=shard),
            lambda: ss.sample_from_logits(gather(local[:, 0]), _mixed(), rng), local[:, 0].numel() * 4),
    }


def _mixed() -> ss.SamplingParams:
    """Half the requests top-k 50, half top-p 0.9, temperature 0.8."""
    k = torch.where(torch.arange(B) % 2 == 0, 50, 0)
    return ss.SamplingParams(temperature=0.8, top_k=k, top_p=torch.where(k > 0, 1.0, 0.9))


def _tokens(res) -> torch.Tensor:
    return res.tokens


def _rank(rank: int, world: int, port: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shard = parallel.VocabShard.even(V)
    records = {}
    for op, (run_parallel, run_gather, shard_bytes) in _ops(shard, world).items():
        assert torch.equal(_tokens(run_parallel()), _tokens(run_gather())), op
        records[op] = {"shard_bytes": shard_bytes}
        for name, fn in (("parallel", run_parallel), ("gather", run_gather)):
            with parallel.count_collectives() as log:
                fn()
            records[op][name] = {"median_ms": _median_ms(fn, reps), "rounds": log.rounds, "bytes_sent": log.bytes}
    local = torch.randn(B, K + 1, shard.size)
    records["floor"] = {"median_ms": _median_ms(local.sum, reps)}
    times = [None] * world
    dist.all_gather_object(times, records)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="JSON file for the records")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.json")
            mp.start_processes(_rank, args=(world, _port(), args.reps, path), nprocs=world, start_method="spawn")
            with open(path) as f:
                ranks = json.load(f)
        floor = max(r["floor"]["median_ms"] for r in ranks)
        for op in ranks[0]:
            if op == "floor":
                continue
            # the slowest rank's median decides a step
            rec = {k: {"median_ms": max(r[op][k]["median_ms"] for r in ranks), "rounds": ranks[0][op][k]["rounds"],
                       "bytes_sent": ranks[0][op][k]["bytes_sent"]} for k in ("parallel", "gather")}
            shard_bytes = ranks[0][op]["shard_bytes"]
            rows.append({
                "op": op, "device": f"cpu gloo, {world} processes on {os.cpu_count()} cores",
                "machine": platform.processor() or platform.machine(), "world": world, "shape": [B, K + 1, V],
                "parallel": rec["parallel"], "gather": rec["gather"], "floor_ms": floor,
                "shard_bytes": shard_bytes, "gbps": shard_bytes / rec["parallel"]["median_ms"] / 1e6,
                "floor_ratio": rec["parallel"]["median_ms"] / floor,
                "bytes_ratio_gather_over_parallel": rec["gather"]["bytes_sent"] / max(1, rec["parallel"]["bytes_sent"]),
                "speedup_over_gather": rec["gather"]["median_ms"] / rec["parallel"]["median_ms"],
            })
    print(f"B={B} K={K} V={V}; bytes = what each rank sends per call; times = median of the slowest rank, gloo on "
          f"CPU; floor = one read of the logits shard")
    print(f"{'op':<48} {'TP':>3} {'rounds':>7} {'bytes (parallel)':>17} {'bytes (gather)':>15} {'parallel ms':>12} "
          f"{'gather ms':>10} {'speedup':>8} {'x floor':>8}")
    for r in rows:
        print(f"{r['op']:<48} {r['world']:>3} {r['parallel']['rounds']:>7} {r['parallel']['bytes_sent']:>17,} "
              f"{r['gather']['bytes_sent']:>15,} {r['parallel']['median_ms']:>12.2f} {r['gather']['median_ms']:>10.2f} "
              f"{r['speedup_over_gather']:>7.1f}x {r['floor_ratio']:>8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
