"""Benchmarks: specsampler's ops against plain-PyTorch baselines and a one-read floor, in one run.

Each case times its variants interleaved (one run of each, round after round, after a
warm-up) and reports medians. The floor of a case is one read of its inputs (a ``sum``
over every input tensor), measured in the same run; ``floor_ratio`` is the op's time over
it. Baselines are written here in plain PyTorch, the way a straightforward implementation
does it; ``baselines`` holds the op's speedup over each.

Run ``specsampler bench`` (``--out`` for the JSON, ``--plot`` for a PNG, needs matplotlib).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import Philox, SamplingParams, TokenTree, sample_from_logits, verify_chain, verify_tree_from_logits


def device_name_arg(text: str) -> str:
    """An argparse ``type`` for ``--device``: the name as given, where it names a torch device (a usage error, not a
    traceback, otherwise), whether or not this machine has it."""
    import argparse

    try:
        torch.device(text)
        return text
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({err})") from None


def device_arg(text: str) -> str:
    """An argparse ``type`` for ``--device``: the name as given, where torch can use that device here (a clear
    usage error, not a traceback from deep inside, on a machine without it)."""
    import argparse

    dev = torch.device(device_name_arg(text))
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise argparse.ArgumentTypeError(f"{text!r}: {why}; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: {torch.cuda.device_count()} GPU(s) visible")
    return text


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu: {cpu} ({os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads)"


@dataclass
class Case:
    """One benchmark: the op, its baselines and its inputs (for the floor and the byte count)."""

    op: str
    shape: dict
    inputs: list[Tensor]
    run: Callable[[], object]
    baselines: dict[str, Callable[[], object]]
    targets: dict = field(default_factory=dict)

    def bytes_read(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs)

    def read(self) -> None:
        for t in self.inputs:
            t.sum()


def steal_ms() -> float | None:
    """CPU time the hypervisor gave to others while this machine's CPUs wanted it (all CPUs,
    ms since boot; the "steal" column of /proc/stat), or None where it is not reported."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(case: Case, device: torch.device, reps: int, warmup: int = 2) -> dict:
    """Median times of the op, its baselines and the floor, interleaved; the record for the JSON."""
    variants = {"op": case.run, "floor": case.read, **case.baselines}
    times: dict[str, list[float]] = {name: [] for name in variants}
    stolen = steal_ms()
    for rep in range(warmup + reps):
        for name, fn in variants.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    if stolen is not None:
        stolen = round(steal_ms() - stolen, 1)
    record = {
        "op": case.op,
        "device": device_name(device),
        "dtype": str(case.inputs[0].dtype).replace("torch.", ""),
        "shape": case.shape,
        "median_us": round(median["op"] * 1e6, 1),
        "bytes_read": case.bytes_read(),
        "gbps": round(case.bytes_read() / median["op"] / 1e9, 2),
        "floor_us": round(median["floor"] * 1e6, 1),
        "floor_ratio": round(median["op"] / median["floor"], 2),
        "baselines": {name: round(median[name] / median["op"], 1) for name in case.baselines},
        "baseline_us": {name: round(median[name] * 1e6, 1) for name in case.baselines},
        "reps": reps,
        "steal_ms": stolen,  # CPU time taken by the hypervisor during the case: a noisy machine when large
    }
    if case.targets:
        record["targets"] = case.targets
        record["met"] = all(
            record["baselines"][name] >= need for name, need in case.targets.get("min_speedup", {}).items()
        ) and record["floor_ratio"] <= case.targets.get("max_floor_ratio", float("inf"))
    return record


# ----------------------------------------------------------------------------- baselines


def sort_sampler(logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> Tensor:
    """The textbook sampler: softmax, a full sort, top-k and top-p masks, renormalise, multinomial."""
    probs = torch.softmax(logits / temperature, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    if top_k:
        sorted_probs[:, top_k:] = 0.0
        sorted_probs /= sorted_probs.sum(-1, keepdim=True)
    if top_p < 1:
        sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) >= top_p] = 0.0
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return order.gather(1, choice)[:, 0]


def softmax_multinomial(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    """Plain temperature sampling as PyTorch users write it: softmax, then ``torch.multinomial``."""
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]


def materialising_chain_verify(p: Tensor, x: Tensor, q: Tensor, generator: torch.Generator) -> Tensor:
    """Token-level verification that builds the residual distribution at every position."""
    B, K = x.shape
    residual = (p[:, :K] - q).clamp(min=0)
    residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
    px, qx = p[:, :K].gather(2, x[..., None])[..., 0], q.gather(2, x[..., None])[..., 0]
    accept = torch.rand(B, K, generator=generator, device=p.device) * qx < px
    n = accept.long().cumprod(1).sum(1)
    corrections = torch.multinomial(residual.reshape(-1, p.shape[-1]), 1, generator=generator).view(B, K)
    bonus = torch.multinomial(p[:, K], 1, generator=generator)[:, 0]
    return torch.where(n < K, corrections.gather(1, n.clamp(max=K - 1)[:, None])[:, 0], bonus), n


def every_node_tree_verify(logits: Tensor, tokens: Tensor, parents: Tensor, temperature: float, top_p: float,
                           generator: torch.Generator) -> Tensor:
    """Target-only tree verification that processes every node first (softmax and a sort-based
    top-p on all rows), then walks."""
    B, N, V = logits.shape
    probs = torch.softmax(logits / temperature, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) >= top_p] = 0.0
    draws = order.gather(2, torch.multinomial(sorted_probs.view(-1, V), 1, generator=generator).view(B, N, 1))[..., 0]
    cur = torch.zeros(B, dtype=torch.long, device=logits.device)
    n = torch.zeros_like(cur)
    walking = torch.ones(B, dtype=torch.bool, device=logits.device)
    for _ in range(N):
        y = draws.gather(1, cur[:, None])[:, 0]
        match = (parents == cur[:, None]) & (tokens == y[:, None])
        has = match.any(1) & walking
        cur = torch.where(has, match.float().argmax(1), cur)
        n += has.long()
        walking &= has
        if not bool(walking.any()):
            break
    return n


# ----------------------------------------------------------------------------- cases


def spine_tree(N: int, depth: int) -> list[int]:
    """Parents of a tree of N nodes: a spine of ``depth`` nodes, the rest leaves spread along it."""
    parents = [-1] + list(range(depth))  # nodes 1..depth: the spine
    spine = list(range(depth))  # parents of the extra leaves, round robin
    while len(parents) < N:
        parents.append(spine[(len(parents) - depth - 1) % depth])
    return parents


def chain_case(device: torch.device, g: torch.Generator, gd: torch.Generator) -> Case:
    """Chain token verification from probabilities (B=32, K=4, V=32000). g: a CPU generator
    for the inputs; gd: one on ``device`` for the baselines."""
    B, K, V = 32, 4, 32000
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1).to(device)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1).to(device)
    x = torch.multinomial(q.reshape(-1, V).cpu(), 1, generator=g).view(B, K).to(device)
    rng = Philox(torch.arange(B, device=device))
    return Case(
        "chain_verify", {"B": B, "K": K, "V": V, "method": "token"}, [p, x, q],
        lambda: verify_chain(p, x, q, method="token", rng=rng),
        {"materialising": lambda: materialising_chain_verify(p, x, q, gd)},
        {"min_speedup": {"materialising": 10}, "max_floor_ratio": 2},
    )


def sampling_cases(device: torch.device, g: torch.Generator, gd: torch.Generator, quick: bool) -> list[Case]:
    """Sampling from logits (B=64, V=128256): temperature alone, top-k with top-p, and top-p alone (a nucleus of
    thousands of tokens: logits ~ N(0, 3^2) at temperature 0.8)."""
    B, V = (16, 128256) if quick else (64, 128256)
    logits = (torch.randn(B, V, generator=g) * 3).to(device)
    rng = Philox(torch.arange(B, device=device))
    plain = SamplingParams(temperature=0.8)
    both = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    nucleus = SamplingParams(temperature=0.8, top_p=0.9)
    return [
        Case("sample_from_logits", {"B": B, "V": V, "temperature": 0.8}, [logits],
             lambda: sample_from_logits(logits, plain, rng),
             {"softmax_multinomial": lambda: softmax_multinomial(logits, 0.8, gd)},
             {"min_speedup": {"softmax_multinomial": 1}, "max_floor_ratio": 2.5}),
        Case("sample_from_logits", {"B": B, "V": V, "temperature": 0.8, "top_k": 50, "top_p": 0.9}, [logits],
             lambda: sample_from_logits(logits, both, rng),
             {"sort_based": lambda: sort_sampler(logits, 0.8, 50, 0.9, gd)},
             {"min_speedup": {"sort_based": 50}, "max_floor_ratio": 3.5}),
        Case("sample_from_logits", {"B": B, "V": V, "temperature": 0.8, "top_p": 0.9, "nucleus": "thousands"},
             [logits], lambda: sample_from_logits(logits, nucleus, rng),
             {"sort_based": lambda: sort_sampler(logits, 0.8, 0, 0.9, gd)},
             {"min_speedup": {"sort_based": 30}, "max_floor_ratio": 15}),
    ]


def tree_case(device: torch.device, g: torch.Generator, gd: torch.Generator, quick: bool) -> Case:
    """Target-only tree verification from logits with top-p 0.9 (B=16, N=64, V=32000): a spine
    of 8 nodes (the depth of EAGLE-style trees of 64 nodes) whose tokens dominate their
    parents' rows, so that whole spines are accepted, and 55 leaves along it."""
    B, N, V, depth = (4, 64, 32000, 8) if quick else (16, 64, 32000, 8)
    parents = torch.tensor([spine_tree(N, depth)] * B)
    tree = TokenTree.from_parents(parents).to(device)
    logits = torch.randn(B, N, V, generator=g)
    tokens = torch.randint(0, V, (B, N), generator=g)
    spine = torch.arange(1, depth + 1)  # node i+1 is node i's child on the spine
    logits[torch.arange(B)[:, None], spine - 1, tokens[:, spine]] = 14.0
    logits, tokens, parents = logits.to(device), tokens.to(device), parents.to(device)
    rng = Philox(torch.arange(B, device=device))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    return Case(
        "tree_verify_from_logits", {"B": B, "N": N, "V": V, "method": "target_only", "top_p": 0.9, "depth": depth},
        [logits],
        lambda: verify_tree_from_logits(logits, tokens, tree, params, method="target_only", rng=rng),
        {"every_node": lambda: every_node_tree_verify(logits, tokens, parents, 1.0, 0.9, gd)},
        {"min_speedup": {"every_node": 20}, "max_floor_ratio": 2},
    )


def cases(device: torch.device, quick: bool = False) -> list[Case]:
    g = torch.Generator(device="cpu").manual_seed(0)  # inputs: the same on every device
    gd = torch.Generator(device=device).manual_seed(1)  # the baselines' own draws, where their data is
    return [chain_case(device, g, gd), *sampling_cases(device, g, gd, quick), tree_case(device, g, gd, quick)]


def run(device: str = "cpu", reps: int = 15, quick: bool = False, out: str | None = None,
        plot: str | None = None) -> list[dict]:
    """Run every case; print a table; write the JSON records (``out``) and a PNG (``plot``)."""
    dev = torch.device(device)
    records = []
    head = f"{'op':<26}{'shape':<44}{'median ms':>10}{'GB/s':>8}{'floor x':>9}{'steal ms':>9}  baselines (speedup)"
    print(device_name(dev) + "\n" + head + "\n" + "-" * (len(head) + 12))
    for case in cases(dev, quick):
        rec = measure(case, dev, reps)
        records.append(rec)
        shape = " ".join(f"{k}={v}" for k, v in rec["shape"].items())
        base = ", ".join(f"{k} {v}x" for k, v in rec["baselines"].items())
        met = "" if "met" not in rec else ("  target met" if rec["met"] else "  target MISSED")
        print(f"{rec['op']:<26}{shape:<44}{rec['median_us'] / 1e3:>10.2f}{rec['gbps']:>8.1f}"
              f"{rec['floor_ratio']:>9.1f}{_fmt(rec['steal_ms']):>9}  {base}{met}")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {out}")
    if plot:
        plot_speedups(records, plot)
    return records


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


def _case_label(shape: dict) -> str:
    """A case's short name in a plot: its method, else its sampling filters (plain temperature: "temperature")."""
    if "method" in shape:
        return shape["method"]
    kept = [name for name, on in (("top-k", shape.get("top_k")), ("top-p", shape.get("top_p"))) if on]
    return "+".join(kept) or "temperature"


def plot_speedups(records: list[dict], path: str) -> None:
    """A bar chart of each case's speedups over its baselines (log scale), targets marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specsampler[bench]'): no plot")
        return
    labels, values, needs = [], [], []
    for rec in records:
        for name, speedup in rec["baselines"].items():
            extra = _case_label(rec["shape"])
            labels.append(f"{rec['op']}\n{extra} vs {name}")
            values.append(speedup)
            needs.append(rec.get("targets", {}).get("min_speedup", {}).get(name))
    fig, ax = plt.subplots(figsize=(1.9 * len(labels) + 2, 4.5))
    bars = ax.bar(range(len(values)), values, color="#4477aa")
    for i, need in enumerate(needs):
        if need:
            ax.hlines(need, i - 0.4, i + 0.4, colors="#cc3311", linestyles="--")
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:.0f}x", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("speedup over the baseline (log)")
    ax.set_title(f"specsampler vs plain-PyTorch baselines: {records[0]['device']}\n(dashed: target)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- generation


LIBRARY_SHARE_TARGET = 0.30  # the library's time per step, at most this share of the models' forward time (B = 1)


def _load_avg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def run_generate(device: str = "cpu", reps: int = 3, quick: bool = False, out: str | None = None,
                 plot: str | None = None, max_new_tokens: int | None = None, threads: int = 1) -> dict:
    """``specsampler bench generate``: every demo method on the built-in pair at B = 1 and B = 3.

    Per method: wall time, the models' forward time, the library's time per step (wall minus
    forward, over the steps), tokens per second and the speedup over plain sampling (medians of
    ``reps`` interleaved rounds, ``threads`` ATen threads), ``max_new_tokens`` per prompt (default 96, 24 with
    ``quick``). Prints a table; writes the JSON (``out``) and a PNG (``plot``, needs matplotlib). Returns the report.
    """
    from ..generate.modelpair import load_pair
    from ..generate.timing import Method, time_methods
    from .demo import PROMPTS, RUNS, demo_defaults

    dev = torch.device(device)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        target, draft, tokenizer = load_pair(device=dev)
        params = SamplingParams(temperature=0.8, top_p=0.95)
        methods = [Method(label, kwargs) for label, kwargs in RUNS]
        new_tokens = max_new_tokens or (24 if quick else 96)
        report = {"benchmark": "generate", "device": device_name(dev), "threads": threads,
                  "model_pair": "built-in (target 1.8M, draft 0.23M parameters, V = 256)",
                  "params": {"temperature": 0.8, "top_p": 0.95}, "max_new_tokens": new_tokens,
                  "defaults": demo_defaults(), "reps": reps, "load_avg_before": _load_avg(), "steal_ms": steal_ms(),
                  "library_share_target": LIBRARY_SHARE_TARGET, "records": []}
        head = (f"{'method':<30}{'B':>3}{'tokens/s':>10}{'speedup':>9}{'wall ms':>10}{'forward ms':>12}"
                f"{'steps':>7}{'library ms/step':>17}{'library/forward':>17}{'tokens/call':>13}")
        print(report["device"] + f", {threads} thread(s), {new_tokens} new tokens per prompt\n" + head + "\n"
              + "-" * len(head))
        for B in (1, 3):
            ids = [tokenizer.encode(p) for p in PROMPTS[:B]]
            L = max(map(len, ids))
            input_ids = torch.tensor([[0] * (L - len(i)) + i for i in ids], device=dev)
            mask = torch.tensor([[0] * (L - len(i)) + [1] * len(i) for i in ids], device=dev)
            records = time_methods(target, draft, input_ids, mask, new_tokens, params, methods, reps=reps,
                                   defaults=demo_defaults())
            for rec in records:
                spec = rec["settings"] is not None
                if B == 1 and spec:
                    # and no slower than plain sampling
                    rec["met"] = (rec["library_share"] is not None and rec["library_share"] <= LIBRARY_SHARE_TARGET
                                  and rec["speedup"] >= 1.0)
                met = "" if "met" not in rec else ("" if rec["met"] else "  over target")
                print(f"{rec['method']:<30}{B:>3}{rec['tokens_per_s']:>10.1f}{rec['speedup']:>8.2f}x"
                      f"{rec['wall_ms']:>10.1f}{rec['forward_ms']:>12.1f}{rec['steps']:>7}"
                      f"{rec['library_ms_per_step']:>17.3f}{100 * rec['library_share']:>16.1f}%"
                      f"{rec['tokens_per_target_call']:>13.2f}{met}")
            report["records"] += records
        report["load_avg_after"] = _load_avg()
        stolen = steal_ms()
        report["steal_ms"] = None if stolen is None or report["steal_ms"] is None else round(
            stolen - report["steal_ms"], 1)
        print(f"load average before {report['load_avg_before']}, after {report['load_avg_after']}; "
              f"CPU time stolen by the hypervisor: {_fmt(report['steal_ms'])} ms")
    finally:
        torch.set_num_threads(old_threads)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out}")
    if plot:
        plot_generate(report, plot)
    return report


def plot_generate(report: dict, path: str) -> None:
    """Two panels: tokens per second of each method (B = 1 and 3, plain sampling dashed), and at
    B = 1 each method's time per step, forward and library stacked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specsampler[bench]'): no plot")
        return
    records = report["records"]
    labels = list(dict.fromkeys(r["method"] for r in records))
    by = {(r["method"], r["B"]): r for r in records}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = range(len(labels))
    for k, (B, color) in enumerate(((1, "#4477aa"), (3, "#66ccee"))):
        vals = [by[(m, B)]["tokens_per_s"] for m in labels]
        bars = ax1.bar([i + (k - 0.5) * 0.4 for i in x], vals, 0.4, color=color, label=f"B = {B}")
        for bar, m in zip(bars, labels):
            ax1.annotate(f"{by[(m, B)]['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=6)
    ax1.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=7)
    ax1.set_ylabel("tokens per second (wall clock; labels: speedup over plain)")
    ax1.legend(fontsize=8)
    fwd = [by[(m, 1)]["forward_ms_per_step"] for m in labels]
    lib = [by[(m, 1)]["library_ms_per_step"] for m in labels]
    ax2.bar(list(x), fwd, color="#999999", label="model forwards")
    ax2.bar(list(x), lib, bottom=fwd, color="#cc3311", label="library")
    for i, (f, li) in enumerate(zip(fwd, lib)):
        ax2.annotate(f"{100 * li / f:.0f}%", (i, f + li), ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=7)
    ax2.set_ylabel("ms per step, B = 1 (labels: library / forward)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"specsampler generate on the built-in pair: {report['device']}, {report['threads']} thread(s), "
                 f"{report['max_new_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
