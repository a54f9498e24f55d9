"""GPU benchmarks of the Triton kernels (issue 7): chain and tree verification from logits and
sampling from logits, against the one-read floor, FlashInfer and plain-PyTorch baselines, in one run.

    python benchmarks/gpu.py --out benchmarks/results/gpu-<device>.json [--quick]

Timing: each variant is captured in a CUDA graph (after a warm-up) and replayed ``--inner``
times per sample; the median over ``--reps`` samples, per call, is reported. A variant that
cannot be captured is timed eagerly with CUDA events around ``--inner`` back-to-back calls
(``"timing": "eager"`` in its record), so host overhead counts there.

floor: one read of the logits at the device's copy rate, measured in the same run as the
bytes a large device-to-device copy reads and writes over its time; ``floor_ratio`` is the
op's median over it. Baselines (``baselines`` holds the op's speedup over each, > 1 = faster):

- ``flashinfer_sequential`` (chain, ``token``): FlashInfer's softmax, top_k_renorm_probs,
  top_p_renorm_probs on every position, then chain_speculative_sampling;
- ``flashinfer_fused`` (chain, ``target_only``): FlashInfer's top_k_top_p_sampling_from_logits
  at every position, then a token compare;
- ``flashinfer`` (sampling): top_k_top_p_sampling_from_logits;
- ``torch``: the plain-PyTorch baselines of :mod:`specsampler.bench` (sort-based processing
  of every row, a materialising chain verifier, an every-node tree walk).

Runs without FlashInfer (its baselines are then left out) and, for a smoke test, on the CPU.
FlashInfer is not on the GPU machines' image and they reach no network: ``bash
benchmarks/flashinfer_carry.sh`` packs its sampling path to carry there (the script says how to unpack it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

import torch

import specsampler as ss
from specsampler import bench
from specsampler.kernels import triton_available, use_triton

try:  # optional: the FlashInfer baselines
    import flashinfer
    import flashinfer.sampling as fis
except Exception:  # noqa: BLE001 - any import failure means: no FlashInfer baselines
    flashinfer = fis = None

TOP_K, TOP_P, TEMPERATURE = 50, 0.95, 1.0
BASELINES = True  # --no-baselines: time our kernels only
FI_TOPK = True  # --no-flashinfer-topk: leave out the FlashInfer baselines that need its top-k module (not built)
CHAIN_VOCABS: list[int] | None = None  # --chain-vocab: the chain shapes of these vocabulary sizes only
PROFILE = False  # --profile: list the kernels one call of each op launches, with their device times
OUT: str | None = None  # --out: rewritten after every record, so a run cut off keeps what it measured
RECORDS: list[dict] = []
STAGES = None  # the kernels' pipelining depth (SPECSAMPLER_PIPELINE_STAGES), None without Triton
PROGRAMS_PER_SM = None  # programs the kernels' register limit fits on an SM (SPECSAMPLER_PROGRAMS_PER_SM)
if triton_available():
    from specsampler.kernels import chain as kchain
    from specsampler.kernels import sampling as ksampling
    from specsampler.kernels.rows import MAX_PARTS as _MAX_PARTS
    from specsampler.kernels.rows import PROGRAMS_PER_SM, multiprocessors, parts_per_row, row_config
    from specsampler.kernels.rows import STAGES as _STAGES

    STAGES = _STAGES.value
    MAX_PARTS = _MAX_PARTS.value


def timed(fn, device: torch.device, reps: int, inner: int) -> tuple[float, str]:
    """Median seconds per call of ``fn``, from CUDA-graph replays (or eager events, or the CPU clock).

    The PyTorch baselines draw from a generator of their own, which torch does not capture unless it is
    registered with the graph; registered, a capture that then failed (the materialising chain verifier's, on an
    H100) left it unusable even eagerly. So they are timed eagerly (``baseline_timing`` says so): their launches
    count, a few microseconds against their milliseconds."""
    if device.type != "cuda":
        import time

        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts), "cpu"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        run = graph.replay
    except Exception as err:  # noqa: BLE001 - not capturable: time it eagerly
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                            for f in reversed(traceback.extract_tb(err.__traceback__)[-4:]))
        print(f"  (not capturable, timed eagerly: {type(err).__name__}: {str(err)[:160]} at {where})",
              file=sys.stderr)
        torch.cuda.synchronize()
        mode = "eager"

        def run():
            for _ in range(inner):
                fn()
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(ts), mode


def copy_rate(device: torch.device, reps: int) -> float:
    """Bytes per second a device-to-device copy of 1 GiB reads and writes (the floor's rate)."""
    n = (1 << 30) // 4 if device.type == "cuda" else (1 << 26) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    t, _ = timed(lambda: dst.copy_(src), device, reps, 5)
    return 2 * n * 4 / t


def record(op: str, device: torch.device, shape: dict, logits: torch.Tensor, ours, baselines: dict,
           rate: float, reps: int, inner: int) -> dict:
    t, mode = timed(ours, device, reps, inner)
    floor = logits.numel() * logits.element_size() / rate
    rec = {"op": op, "device": bench.device_name(device), "dtype": str(logits.dtype).replace("torch.", ""),
           "shape": shape, "median_us": round(t * 1e6, 2), "floor_us": round(floor * 1e6, 2),
           "floor_ratio": round(t / floor, 3), "gbps": round(logits.numel() * logits.element_size() / t / 1e9, 1),
           "timing": mode, "copy_rate_tbps": round(rate / 1e12, 3), "pipeline_stages": STAGES,
           "programs_per_sm": PROGRAMS_PER_SM,
           "flashinfer": getattr(flashinfer, "__version__", None), "baselines": {}, "baseline_us": {}}
    if PROFILE and device.type == "cuda":
        rec["kernels"] = kernels_of(ours)
    for name, fn in baselines.items() if BASELINES else ():
        try:
            tb, mode_b = timed(fn, device, reps, inner)
        except Exception as err:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            print(f"  baseline {name} failed: {type(err).__name__}: {str(err)[:160]}", file=sys.stderr)
            continue
        rec["baselines"][name] = round(tb / t, 3)
        rec["baseline_us"][name] = round(tb * 1e6, 2)
        rec.setdefault("baseline_timing", {})[name] = mode_b
    shape_s = " ".join(f"{k}={v}" for k, v in shape.items())
    base_s = ", ".join(f"{k} {v}x" for k, v in rec["baselines"].items())
    print(f"{op:<26}{shape_s:<80} {t * 1e6:>10.1f}{rec['floor_ratio']:>8.2f}  {base_s}", flush=True)
    for k in rec.get("kernels", ()):
        print(f"    {k['us']:>8.2f} us  {k['name'][:110]}", flush=True)
    RECORDS.append(rec)
    if OUT:
        with open(OUT, "w") as f:
            json.dump(RECORDS, f, indent=1)
    return rec


def kernels_of(fn) -> list[dict]:
    """The device kernels (and copies, memsets) one eager call of ``fn`` launches, in launch order, with their
    device times: where a small batch's time goes (a graph replays the same launches)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    return [{"name": e.name, "us": round(e.time_range.elapsed_us(), 2)} for e in events]


def chain_records(device, g, gd, rate, reps, inner, quick) -> list[dict]:
    grid = [(32, 4, 32000)] if quick else [(B, K, V) for V in (128256, 200064) for K in (4, 8) for B in (1, 32, 128)]
    grid = [(B, K, V) for B, K, V in grid if CHAIN_VOCABS is None or V in CHAIN_VOCABS]
    return [rec for B, K, V in grid for rec in chain_shape(device, g, gd, rate, reps, inner, B, K, V)]


def chain_shape(device, g, gd, rate, reps, inner, B, K, V) -> list[dict]:
    """Chain verification from logits at one shape: the token method (drafts with draft probabilities)
    against FlashInfer's sequential path, target-only against its fused sampling."""
    out = []
    params = ss.SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    logits = (torch.randn(B, K + 1, V, generator=g) * 4).to(device)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 4, -1).to(device)
    draft = logits[:, :K].argmax(-1)  # drafts the target likes: long accepted runs
    rng = ss.Philox(torch.arange(B, device=device), torch.zeros(B, dtype=torch.int64, device=device))
    shape = {"B": B, "K": K, "V": V, "top_k": TOP_K, "top_p": TOP_P}
    base = {"torch": lambda: bench.materialising_chain_verify(
        ss.logits_to_probs(logits, params), draft, q, gd)}
    if fis is not None:
        def fi_sequential():
            probs = fis.softmax(logits.view(-1, V), temperature=TEMPERATURE)
            probs = fis.top_p_renorm_probs(fis.top_k_renorm_probs(probs, TOP_K), TOP_P)
            return fis.chain_speculative_sampling(q, draft.int(), probs.view(B, K + 1, V))
        base["flashinfer_sequential"] = fi_sequential
    parallel = use_triton(device) and kchain.rows_in_parallel_by_default(device)
    split = parts_per_row(B * (K + 1), V, row_config(V), device) if use_triton(device) else 0  # with rows in parallel
    parts = split if parallel else 0
    if use_triton(device):
        shape["parts"] = parts  # each row's first pass split over this many programs (0: none)
    out.append(record("chain_verify_from_logits", device, {**shape, "method": "token", "rows_in_parallel": parallel},
                      logits, lambda: ss.verify_chain_from_logits(logits, draft, params, draft_probs=q, method="token",
                                                                  rng=rng), base, rate, reps, inner))
    if use_triton(device):  # diagnostics for the defaults: the serial walk ("chain-serial"), rows not split where
        # they are, and where they are not, split in two waves' worth of programs (a batch of rows past the GPU's
        # slots leaves a last wave part-filled: 288 rows in 264 slots measured 2.5x a read on an H100)
        rp = params.rows("bench", B, K + 1, device, False)
        variants = [(not parallel, 0 if parallel else split)]
        sms = multiprocessors(device)
        if parts:
            variants.append((True, 0))
        elif sms:
            variants.append((True, min(max(2, -(-2 * PROGRAMS_PER_SM * sms // (B * (K + 1)))), MAX_PARTS)))
        for in_parallel, n_parts in variants:
            out.append(record(
                "chain_verify_from_logits", device,
                {**shape, "parts": n_parts, "method": "token", "rows_in_parallel": in_parallel}, logits,
                lambda in_parallel=in_parallel, n_parts=n_parts: kchain.verify_chain_from_logits(
                    logits, draft, q, None, "token", rp.temperature, rp.top_k, rp.top_p, rp.min_p, None, rng.seed,
                    rng.offset, rows_in_parallel=in_parallel, parts=n_parts), {}, rate, reps, inner))
    base = {"torch": lambda: bench.sort_sampler(logits.view(-1, V), TEMPERATURE, TOP_K, TOP_P, gd)}
    if fis is not None and FI_TOPK:
        def fi_fused():
            y = fis.top_k_top_p_sampling_from_logits(logits.view(-1, V), TOP_K, TOP_P).view(B, K + 1)
            return (y[:, :K] == draft).int().cumprod(1).sum(1), y
        base["flashinfer_fused"] = fi_fused
    out.append(record("chain_verify_from_logits", device, {**shape, "method": "target_only",
                                                           "rows_in_parallel": parallel}, logits,
                      lambda: ss.verify_chain_from_logits(logits, draft, params, method="target_only", rng=rng),
                      base, rate, reps, inner))
    return out


def sampling_records(device, g, gd, rate, reps, inner, quick) -> list[dict]:
    """The targets' shapes (top-k and top-p), then diagnostics: at the largest batch the same rows with plain
    temperature (the first pass and the draw only) and greedy (one pass), what the top-k / top-p work after
    the first pass costs; at the smallest and the largest batch top-p alone, whose nucleus (about 1% of
    these rows, 1100-1800 tokens) is found by the pivot search."""
    V, batches = (32000, (16,)) if quick else (128256, (1, 64, 256))
    out = [rec for B in batches for rec in sampling_shape(device, g, gd, rate, reps, inner, B, V, TEMPERATURE, TOP_K,
                                                          TOP_P)]
    out += sampling_shape(device, g, gd, rate, reps, inner, batches[-1], V, TEMPERATURE, 0, 1.0)
    out += sampling_shape(device, g, gd, rate, reps, inner, batches[-1], V, 0.0, 0, 1.0)
    for B in sorted({batches[0], batches[-1]}):
        out += sampling_shape(device, g, gd, rate, reps, inner, B, V, TEMPERATURE, 0, TOP_P)
    return out


def sampling_shape(device, g, gd, rate, reps, inner, B, V, temperature, top_k, top_p) -> list[dict]:
    """One shape's record; with the kernels, where rows are split (``parts`` > 0), a diagnostic without."""
    params = ss.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = (torch.randn(B, V, generator=g) * 4).to(device)
    rng = ss.Philox(torch.arange(B, device=device), torch.zeros(B, dtype=torch.int64, device=device))
    if temperature == 0:
        shape = {"B": B, "V": V, "greedy": True}
        base = {"torch": lambda: logits.argmax(-1)}
    else:
        shape = {"B": B, "V": V, "top_k": top_k, "top_p": top_p}
        base = {"torch": lambda: bench.sort_sampler(logits, temperature, top_k, top_p, gd)}
        # FlashInfer's functions from logits take no temperature: the rows' is TEMPERATURE, 1
        if fis is not None and top_k and FI_TOPK:
            base["flashinfer"] = lambda: fis.top_k_top_p_sampling_from_logits(logits, top_k, top_p)
        elif fis is not None and top_p < 1 and not top_k:
            base["flashinfer"] = lambda: fis.top_p_sampling_from_probs(fis.softmax(logits, temperature), top_p)
        elif fis is not None and not top_k:
            base["flashinfer"] = lambda: fis.sampling_from_logits(logits)
    out = []
    parts = parts_per_row(B, V, row_config(V), device) if use_triton(device) else 0
    if use_triton(device):
        shape["parts"] = parts
    out.append(record("sample_from_logits", device, shape, logits, lambda: ss.sample_from_logits(logits, params, rng),
                      base, rate, reps, inner))
    if parts:
        rp = params.rows("bench", B, 1, device, False)
        index = torch.zeros(B, dtype=torch.int64, device=device)
        out.append(record("sample_from_logits", device, {**shape, "parts": 0}, logits,
                          lambda: ksampling.sample_from_logits(logits, rp.temperature, rp.top_k, rp.top_p, rp.min_p,
                                                               None, rng.seed, rng.offset, index, parts=0),
                          {}, rate, reps, inner))
    return out


def tree_records(device, g, gd, rate, reps, inner, quick) -> list[dict]:
    B, N, V, depth = (4, 64, 32000, 8) if quick else (32, 64, 128256, 8)
    parents = torch.tensor([bench.spine_tree(N, depth)] * B)
    tree = ss.TokenTree.from_parents(parents).to(device)
    logits = torch.randn(B, N, V, generator=g)
    tokens = torch.randint(0, V, (B, N), generator=g)
    spine = torch.arange(1, depth + 1)
    logits[torch.arange(B)[:, None], spine - 1, tokens[:, spine]] = 14.0  # whole spines accepted
    logits, tokens, parents = logits.to(device), tokens.to(device), parents.to(device)
    rng = ss.Philox(torch.arange(B, device=device), torch.zeros(B, dtype=torch.int64, device=device))
    params = ss.SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    return [record("tree_verify_from_logits", device,
                   {"B": B, "N": N, "V": V, "method": "target_only", "top_k": TOP_K, "top_p": TOP_P, "depth": depth},
                   logits, lambda: ss.verify_tree_from_logits(logits, tokens, tree, params, method="target_only",
                                                              rng=rng),
                   {"torch": lambda: bench.every_node_tree_verify(logits, tokens, parents, TEMPERATURE, TOP_P, gd)},
                   rate, reps, inner)]


def latency_records(device, g, gd, rate, reps, inner, quick) -> list[dict]:
    """Every op at B = 1 (V = 128256, bf16 logits; top-k 50 + top-p 0.95; chains of 4, trees of 8 nodes in 3
    levels): what a request alone waits for, by graph replay."""
    V = 32000 if quick else 128256
    params = ss.SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    rng = ss.Philox(torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device))
    K, parents = 4, [-1, 0, 0, 1, 1, 2, 3, 5]
    N = len(parents)
    tree = ss.TokenTree.from_parents(torch.tensor([parents])).to(device)
    chain = (torch.randn(1, K + 1, V, generator=g) * 4).to(device, torch.bfloat16)
    rows = (torch.randn(1, N, V, generator=g) * 4).to(device, torch.bfloat16)
    one = (torch.randn(1, V, generator=g) * 4).to(device, torch.bfloat16)
    q = torch.softmax(torch.randn(1, K, V, generator=g) * 4, -1).to(device)
    qt = torch.softmax(torch.randn(1, N, V, generator=g) * 4, -1).to(device)
    drafts = chain[:, :K].float().argmax(-1)
    nodes = torch.randint(0, V, (1, N), generator=g).to(device)
    top_p_only = ss.SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    cases = [
        ("sample_from_logits", {"top_k": TOP_K, "top_p": TOP_P}, one, lambda: ss.sample_from_logits(one, params, rng)),
        ("sample_from_logits", {"top_p": TOP_P}, one, lambda: ss.sample_from_logits(one, top_p_only, rng)),
        ("sample_from_logits", {"greedy": True}, one,
         lambda: ss.sample_from_logits(one, ss.SamplingParams(temperature=0.0), rng)),
        *[("chain_verify_from_logits", {"K": K, "method": m}, chain,
           lambda m=m: ss.verify_chain_from_logits(chain, drafts, params, draft_probs=q if m in ("token", "block")
                                                   else None, method=m, rng=rng))
          for m in ("token", "block", "target_only", "greedy")],
        *[("tree_verify_from_logits", {"N": N, "method": m, "draft_sampling": s}, rows,
           lambda m=m, s=s: ss.verify_tree_from_logits(rows, nodes, tree, params, draft_probs=qt if m in (
               "rrs", "traversal") else None, method=m, draft_sampling=s, rng=rng))
          for m, s in (("target_only", "iid"), ("greedy", "iid"), ("rrs", "iid"), ("rrs", "without_replacement"),
                       ("traversal", "without_replacement"))],
    ]
    return [record(op, device, {"B": 1, "V": V, **shape}, x, fn, {}, rate, reps, inner) for op, shape, x, fn in cases]


def compare(paths: list[str]) -> None:
    """Print the median of each record of several result files side by side (e.g. one file per setting of
    ``SPECSAMPLER_PIPELINE_STAGES`` and ``SPECSAMPLER_PROGRAMS_PER_SM``), with each file's ratio to the first."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append({(r["op"], json.dumps(r["shape"], sort_keys=True)): r for r in json.load(f)})
    def label(run: dict, path: str) -> str:
        first = next(iter(run.values()), None)
        if first is None:
            return path
        return f"stages={first.get('pipeline_stages', '?')} per_sm={first.get('programs_per_sm', '?')}"

    labels = [label(run, path) for path, run in zip(paths, runs)]
    print(f"{'op':<26}{'shape':<82}" + "".join(f"{label:>22}" for label in labels))
    for key, first in runs[0].items():
        cells = []
        for run in runs:
            rec = run.get(key)
            cells.append("-" if rec is None else
                         f"{rec['median_us']:.1f} us {rec['median_us'] / first['median_us']:.2f}x")
        shape_s = " ".join(f"{k}={v}" for k, v in first["shape"].items())
        print(f"{key[0]:<26}{shape_s:<82}" + "".join(f"{c:>22}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    global BASELINES, CHAIN_VOCABS, PROFILE, OUT, FI_TOPK
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=bench.device_arg)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--inner", type=int, default=10, help="calls per timed sample (per graph replay)")
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    p.add_argument("--only", choices=("latency", "chain", "sampling", "tree"), action="append")
    p.add_argument("--out", help="write the JSON records here")
    p.add_argument("--no-baselines", action="store_true", help="time the kernels only (tuning runs)")
    p.add_argument("--no-flashinfer-topk", action="store_true",
                   help="leave out the FlashInfer baselines built on its top-k module "
                        "(top_k_top_p_sampling_from_logits from V = 65536 on), when that module was not built")
    p.add_argument("--chain-vocab", type=int, action="append", metavar="V",
                   help="only the chain shapes of this vocabulary size (repeatable): compile passes split by it")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="print these result files side by side, run nothing")
    p.add_argument("--profile", action="store_true",
                   help="list each op's kernels (one eager call, torch.profiler) under its line and in its record")
    args = p.parse_args(argv)
    if args.compare:
        compare(args.compare)
        return 0
    BASELINES = not args.no_baselines
    FI_TOPK = not args.no_flashinfer_topk
    CHAIN_VOCABS = args.chain_vocab
    PROFILE = args.profile
    OUT = args.out
    if OUT:
        os.makedirs(os.path.dirname(os.path.abspath(OUT)), exist_ok=True)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    gd = torch.Generator(device=device).manual_seed(1)
    rate = copy_rate(device, args.reps)
    print(f"{bench.device_name(device)}; copy rate {rate / 1e12:.2f} TB/s (read + write); "
          f"flashinfer {getattr(flashinfer, '__version__', 'not installed')}; "
          f"backend {'triton' if use_triton(device) else 'torch'}; pipeline stages {STAGES}; "
          f"programs per SM {PROGRAMS_PER_SM}")
    print(f"{'op':<26}{'shape':<81}{'median us':>10}{'floor x':>8}  baselines (speedup)")
    suites = {"latency": latency_records, "chain": chain_records, "sampling": sampling_records, "tree": tree_records}
    for name in args.only or suites:
        suites[name](device, g, gd, rate, args.reps, args.inner, args.quick)
    if args.out:
        with open(args.out, "w") as f:  # also when no shape was chosen
            json.dump(RECORDS, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
