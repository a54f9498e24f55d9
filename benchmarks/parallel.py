"""Vocab-parallel verification against gathering the logits: ``python benchmarks/parallel.py [--worlds 2 4 8]``.

For each world size, a gloo group of processes on this machine; each rank holds its shard of the target logits
``[B, K+1, V]`` (B = 32, K = 8, V = 128256). Per rank and call: the collectives (rounds, bytes sent, counted by
``specsampler.parallel.count_collectives``) and the median time of

- ``parallel``: ``specsampler.parallel.verify_chain_from_logits(method="greedy")`` on the shard;
- ``gather``: what engines do: ``all_gather`` of the logits, then the one-device op on the whole rows;
- ``floor``: one read of the shard (a ``sum``), the least any verification costs.

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


def _rank(rank: int, world: int, port: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shard = parallel.VocabShard.even(V)
    per = -(-V // world)
    g = torch.Generator().manual_seed(rank)
    local = torch.randn(B, K + 1, per, generator=g)[..., : shard.size].contiguous()  # pad-free shard
    drafts = torch.randint(0, V, (B, K), generator=torch.Generator().manual_seed(7))
    gathered = [torch.empty(B, K + 1, per) for _ in range(world)]
    padded = torch.nn.functional.pad(local, (0, per - shard.size))

    def run_parallel():
        return parallel.verify_chain_from_logits(local, drafts, method="greedy", shard=shard)

    def run_gather():
        dist.all_gather(gathered, padded)
        full = torch.cat(gathered, -1)[..., :V]
        return ss.verify_chain_from_logits(full, drafts, method="greedy")

    assert torch.equal(run_parallel().tokens, run_gather().tokens)
    records = {}
    for name, fn in (("parallel", run_parallel), ("gather", run_gather), ("floor", local.sum)):
        with parallel.count_collectives() as log:
            fn()
        records[name] = {"median_ms": _median_ms(fn, reps), "rounds": log.rounds, "bytes_sent": log.bytes}
    times = [None] * world
    dist.all_gather_object(times, records)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", help="JSON file for the records")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.json")
            mp.start_processes(_rank, args=(world, _port(), args.reps, path), nprocs=world, start_method="spawn")
            with open(path) as f:
                ranks = json.load(f)
        # the slowest rank's median decides a step
        rec = {k: {"median_ms": max(r[k]["median_ms"] for r in ranks), "rounds": ranks[0][k]["rounds"],
                   "bytes_sent": ranks[0][k]["bytes_sent"]} for k in ranks[0]}
        shard_bytes = B * (K + 1) * -(-V // world) * 4
        rows.append({
            "op": "verify_chain_from_logits greedy", "device": f"cpu gloo, {world} processes on {os.cpu_count()} cores",
            "machine": platform.processor() or platform.machine(), "world": world, "shape": [B, K + 1, V],
            "parallel": rec["parallel"], "gather": rec["gather"], "floor": rec["floor"],
            "shard_bytes": shard_bytes, "gbps": shard_bytes / rec["parallel"]["median_ms"] / 1e6,
            "floor_ratio": rec["parallel"]["median_ms"] / rec["floor"]["median_ms"],
            "bytes_ratio_gather_over_parallel": rec["gather"]["bytes_sent"] / rec["parallel"]["bytes_sent"],
            "speedup_over_gather": rec["gather"]["median_ms"] / rec["parallel"]["median_ms"],
        })
    print(f"B={B} K={K} V={V}, greedy chain verification; bytes = what each rank sends per call; times = median "
          f"of the slowest rank, gloo on CPU")
    print(f"{'TP':>3} {'rounds':>7} {'bytes (parallel)':>17} {'bytes (gather)':>15} {'parallel ms':>12} "
          f"{'gather ms':>10} {'speedup':>8} {'floor ms':>9} {'x floor':>8}")
    for r in rows:
        print(f"{r['world']:>3} {r['parallel']['rounds']:>7} {r['parallel']['bytes_sent']:>17,} "
              f"{r['gather']['bytes_sent']:>15,} {r['parallel']['median_ms']:>12.2f} {r['gather']['median_ms']:>10.2f} "
              f"{r['speedup_over_gather']:>7.1f}x {r['floor']['median_ms']:>9.2f} {r['floor_ratio']:>8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
