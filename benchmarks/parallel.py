"""Vocab-parallel ops, both strategies: ``python benchmarks/parallel.py [--worlds 2 4 8] [--B 8 --K 4 --V 32000]``.

For each world size, a group of processes (gloo on CPU; ``--device cuda``: NCCL, one GPU per rank); each rank holds
its even shard of the target logits. For each op (the issue's table: sampling with temperature, top-k + top-p and
top-p; chain verification, token and target_only; tree verification, rrs and traversal on 8 nodes of depth 3; chain
token and tree rrs with top-k + top-p, whose residuals run over the candidates every rank holds; chain token, tree
rrs and traversal without replacement with top-p on peaked rows (logits 3x as spread: nuclei of a few tokens,
gathered whole in one round); chain token and tree rrs at temperature 0.8 alone (every token weighs something: rows
as wide as the shard, gathered whole where the link makes that cheaper than the walk's rounds); and greedy chain
verification), per rank and call: the collectives (rounds, bytes
each rank sends, counted by ``specsampler.parallel.count_collectives``) and the median time of

- ``shard``: the rows processed on the shards, a few rounds of small collectives (its walks deciding as on NVLink
  which rows' entries to gather whole: ``link="nvlink"``);
- ``gather``: the rows (and masks, draft probabilities) all-gathered, then the one-device op (the same tokens:
  checked);
- ``floor``: one read of the logits shard (a ``sum``), the least any op costs;

and what the latency-bandwidth model (``parallel.cost``) predicts for each strategy's counted rounds and bytes on
NVLink (20 us a round, 300 GB/s), and which ``auto`` picks there and on this group's default link. Times on gloo are
of CPU processes sharing this machine's cores: they say how the strategies compare here, not what NCCL on GPUs gives;
rounds and bytes are exact. Prints a table; ``--out`` writes JSON records.
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
from specsampler.cli.bench import device_arg

TREE = [-1, 0, 0, 1, 1, 2, 3, 3]  # 8 nodes, depth 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_ms(fn, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ops(shard, B: int, K: int, V: int, device) -> dict:
    """name -> call(strategy=..., link=...): the ops measured, on this rank's shard of inputs every rank builds
    alike; each returns its tokens."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(B, K + 1, V, generator=g) * 3).to(device)
    peaked = x * 3  # nuclei of a few tokens, as a confident model's (those above: hundreds a rank)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K).to(device)
    N = len(TREE)
    xt = (torch.randn(B, N, V, generator=g) * 3).to(device)
    peaked_t = xt * 3
    qt = torch.softmax(torch.randn(B, N, V, generator=g) * 3, -1)
    dt = torch.multinomial(qt.view(-1, V), 1, generator=g).view(B, N).to(device)
    q, qt = q.to(device), qt.to(device)
    tree = ss.TokenTree.from_parents(torch.tensor([TREE] * B)).to(device)
    cut = lambda t: t[..., shard.start:shard.end].contiguous()  # noqa: E731
    x, q, xt, qt, peaked, peaked_t = cut(x), cut(q), cut(xt), cut(qt), cut(peaked), cut(peaked_t)
    rng = ss.Philox(torch.arange(B, device=device), 11)
    top_p, top_kp = ss.SamplingParams(top_p=0.9), ss.SamplingParams(top_k=50, top_p=0.9)
    warm = ss.SamplingParams(temperature=0.8)  # every token weighs something: rows as wide as the shard
    sample, chain, verify_tree = (parallel.sample_from_logits, parallel.verify_chain_from_logits,
                                  parallel.verify_tree_from_logits)
    return {
        "sample_from_logits T 0.8": lambda **kw: sample(x[:, 0], ss.SamplingParams(temperature=0.8), rng,
                                                        shard=shard, **kw).tokens,
        "sample_from_logits top-k 50 + top-p 0.9": lambda **kw: sample(x[:, 0], top_kp, rng, shard=shard,
                                                                       **kw).tokens,
        "sample_from_logits top-p 0.9": lambda **kw: sample(x[:, 0], top_p, rng, shard=shard, **kw).tokens,
        "verify_chain_from_logits token, top-p 0.9": lambda **kw: chain(
            x, drafts, top_p, draft_probs=q, method="token", rng=rng, shard=shard, **kw).tokens,
        "verify_chain_from_logits token, top-k 50 + top-p 0.9": lambda **kw: chain(
            x, drafts, top_kp, draft_probs=q, method="token", rng=rng, shard=shard, **kw).tokens,
        "verify_chain_from_logits target_only, top-k + top-p": lambda **kw: chain(
            x, drafts, top_kp, method="target_only", rng=rng, shard=shard, **kw).tokens,
        "verify_chain_from_logits token, T 0.8": lambda **kw: chain(
            x, drafts, warm, draft_probs=q, method="token", rng=rng, shard=shard, **kw).tokens,
        "verify_chain_from_logits token, top-p 0.9, peaked rows": lambda **kw: chain(
            peaked, drafts, top_p, draft_probs=q, method="token", rng=rng, shard=shard, **kw).tokens,
        "verify_tree_from_logits rrs iid, top-p 0.9": lambda **kw: verify_tree(
            xt, dt, tree, top_p, draft_probs=qt, method="rrs", rng=rng, shard=shard, **kw).tokens,
        "verify_tree_from_logits rrs iid, T 0.8": lambda **kw: verify_tree(
            xt, dt, tree, warm, draft_probs=qt, method="rrs", rng=rng, shard=shard, **kw).tokens,
        "verify_tree_from_logits rrs iid, top-k 50 + top-p 0.9": lambda **kw: verify_tree(
            xt, dt, tree, top_kp, draft_probs=qt, method="rrs", rng=rng, shard=shard, **kw).tokens,
        "verify_tree_from_logits rrs iid, top-p 0.9, peaked rows": lambda **kw: verify_tree(
            peaked_t, dt, tree, top_p, draft_probs=qt, method="rrs", rng=rng, shard=shard, **kw).tokens,
        "verify_tree_from_logits traversal w/o repl., top-p 0.9": lambda **kw: verify_tree(
            xt, dt, tree, top_p, draft_probs=qt, method="traversal", draft_sampling="without_replacement", rng=rng,
            shard=shard, **kw).tokens,
        "verify_tree_from_logits traversal w/o repl., top-p 0.9, peaked rows": lambda **kw: verify_tree(
            peaked_t, dt, tree, top_p, draft_probs=qt, method="traversal", draft_sampling="without_replacement",
            rng=rng, shard=shard, **kw).tokens,
        "verify_chain_from_logits greedy": lambda **kw: chain(x, drafts, method="greedy", shard=shard, **kw).tokens,
    }


def _counted(call, **kw) -> list[int]:
    """The bytes each rank sends per round in ``call(**kw)``."""
    with parallel.count_collectives() as log:
        call(**kw)
    return [b for _, b in log.calls]


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shard = parallel.VocabShard.even(args.V)
    records = {}
    for op, call in _ops(shard, args.B, args.K, args.V, device).items():
        assert torch.equal(call(strategy="shard", link="nvlink"), call(strategy="gather")), op
        records[op] = {}
        for strategy in ("shard", "gather"):
            # the shard path's walks gather wide rows' entries where the link makes that cheaper: as on NVLink
            sent = _counted(call, strategy=strategy, link="nvlink")
            ms = _median_ms(lambda call=call, strategy=strategy: call(strategy=strategy, link="nvlink"), args.reps,
                            sync)
            records[op][strategy] = {"median_ms": ms, "rounds": len(sent), "bytes_sent": sum(sent),
                                     "bytes_per_round": sent}
        # what auto picks, on NVLink and on the group's default link: the strategy whose collectives it sent
        records[op]["auto"] = {}
        for name, link in (("nvlink", "nvlink"), ("default", None)):
            sent = _counted(call, strategy="auto", link=link)
            records[op]["auto"][name] = "gather" if sent == records[op]["gather"]["bytes_per_round"] else "shard"
    local = torch.randn(args.B, args.K + 1, shard.size, device=device)
    records["floor"] = {"median_ms": _median_ms(local.sum, args.reps, sync)}
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", type=device_arg)
    ap.add_argument("--out", help="JSON file for the records")
    args = ap.parse_args()
    nvlink = parallel.LINKS["nvlink"]
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.json")
            mp.start_processes(_rank, args=(world, _port(), args, path), nprocs=world, start_method="spawn")
            with open(path) as f:
                ranks = json.load(f)
        floor = max(r["floor"]["median_ms"] for r in ranks)
        for op in ranks[0]:
            if op == "floor":
                continue
            rec = {}
            for s in ("shard", "gather"):  # the slowest rank's median decides a step
                mine = ranks[0][op][s]
                rec[s] = {"median_ms": max(r[op][s]["median_ms"] for r in ranks), "rounds": mine["rounds"],
                          "bytes_sent": mine["bytes_sent"],
                          "nvlink_model_us": nvlink.time(mine["bytes_per_round"], world) * 1e6}
            rows.append({
                "op": op, "device": f"{args.device} {'nccl' if args.device == 'cuda' else 'gloo'}, {world} processes"
                f" on {os.cpu_count()} cores", "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__, "world": world, "shape": {"B": args.B, "K": args.K, "V": args.V,
                                                                      "tree_nodes": len(TREE)},
                "shard": rec["shard"], "gather": rec["gather"], "floor_ms": floor,
                "shard_over_gather": rec["shard"]["median_ms"] / rec["gather"]["median_ms"],
                "shard_over_floor": rec["shard"]["median_ms"] / floor,
                "bytes_gather_over_shard": rec["gather"]["bytes_sent"] / max(1, rec["shard"]["bytes_sent"]),
                "auto": ranks[0][op]["auto"], "reps": args.reps,
            })
    print(f"B={args.B} K={args.K} V={args.V} (trees: {len(TREE)} nodes); bytes: what each rank sends per call; ms: "
          f"median of the slowest rank, {args.device}; NVLink: the model's prediction for the counted rounds and "
          f"bytes (us), not a measurement")
    print(f"{'op':<55} {'TP':>3} {'rounds':>9} {'bytes sent':>19} {'ms':>15} {'NVLink model us':>16} {'auto':>14}")
    print(f"{'':<55} {'':>3} {'shard/gath':>9} {'shard / gather':>19} {'shard / gather':>15} {'shard / gather':>16} "
          f"{'nvlink/here':>14}")
    for r in rows:
        s, g = r["shard"], r["gather"]
        print(f"{r['op']:<55} {r['world']:>3} {s['rounds']:>4}/{g['rounds']:<4} "
              f"{s['bytes_sent']:>9,}/{g['bytes_sent']:<9,} {s['median_ms']:>7.1f}/{g['median_ms']:<7.1f} "
              f"{s['nvlink_model_us']:>7.0f}/{g['nvlink_model_us']:<8.0f} {r['auto']['nvlink']:>6}/"
              f"{r['auto']['default']:<7}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
