"""Compile time of every kernel specialisation a server needs, for a GPU target, without a GPU.

    python benchmarks/compile.py --out benchmarks/results/compile-<machine>.json [--vocab-size 128256]
        [--dtype bfloat16 --dtype float32] [--arch 90] [--methods token,rrs] [--masks both|none|mask]

The launches are those of ``specsampler.warmup`` (:func:`specsampler.kernels.warmup.launches`), with the launchers'
size decisions as on a GPU of 132 SMs; each is specialised and compiled down to a cubin exactly as on a GPU
(Triton ships ptxas), by a driver that reports a CUDA target and launches nothing. One JSON record per compiled
kernel: ``{kernel, specialisation, seconds, registers, spills, shared_bytes, cp_async}`` (``specialisation``: the
op, method and variant that first needed it, and the logits dtype; ``spills``: local memory per thread, bytes;
``shared_bytes``: what a launch asks for; ``cp_async``: 16-byte asynchronous copies, the pipelined passes' tiles),
and the Triton version, target and machine. Compiles in a fresh Triton cache (a temporary directory) unless
``--cache DIR``. Prints a table, slowest first. Run it without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("compile.py: unset TRITON_INTERPRET (the interpreter does not compile)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from specsampler.kernels import chain, rows  # noqa: E402
from specsampler.kernels.warmup import DTYPES, METHODS, TargetDriver, launches  # noqa: E402

# shared memory one program may use (the opt-in maximum per block), by compute capability: a launch asking for
# more fails on the GPU only (Triton's OutOfResources), so it fails here
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
SMS = 132  # the launchers decide as on an H100 SXM (parts of a row's first pass, rows in parallel)
# a 16-byte asynchronous copy into shared memory: a tile of a pipelined pass (software pipelining, num_stages)
_CP_ASYNC_16 = re.compile(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], 0x10\b")
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(cubin: bytes) -> dict:
    """Per-thread registers (REG), local memory in bytes (LOCAL: spills) and static shared memory (SHARED) of a
    cubin's kernel, as ``cuobjdump --dump-resource-usage`` reports them ({} without cuobjdump)."""
    if not os.path.exists(_CUOBJDUMP):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", out)}


COMPILED: list[dict] = []  # one record per compiled kernel
_LABEL = {"specialisation": ""}  # the launch being compiled (set by compile_all)
_run = JITFunction.run


def compile_only(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` that compiles for the active target (a record per new specialisation) and launches
    nothing."""
    cached = {id(k) for cache in self.device_caches.values() for k in cache[0].values()}
    start = time.perf_counter()
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    if id(kernel) not in cached:
        usage = resources(kernel.asm["cubin"])
        COMPILED.append(dict(kernel=self.__name__, specialisation=_LABEL["specialisation"],
                             seconds=round(time.perf_counter() - start, 2), registers=usage.get("REG"),
                             spills=usage.get("LOCAL"), shared_bytes=kernel.metadata.shared,
                             cp_async=len(re.findall(_CP_ASYNC_16, kernel.asm["ptx"]))))
    return kernel


def compile_all(vocab_size: int, dtypes: list[torch.dtype], arch: int, methods, masks) -> list[dict]:
    """Compile every launch of :func:`launches` for each logits dtype; returns the records."""
    JITFunction.run = compile_only
    rows.multiprocessors = chain.multiprocessors = lambda device: SMS
    driver.set_active(TargetDriver(arch))
    for dtype in dtypes:
        for launch in launches(vocab_size, dtype, "cpu", methods, masks=masks):
            label = (launch.op, launch.method, launch.variant, str(dtype).removeprefix("torch."))
            _LABEL["specialisation"] = " ".join(filter(None, label))
            launch.run()
    limit = SMEM_LIMIT.get(arch, SMEM_LIMIT[90])
    over = [r for r in COMPILED if r["shared_bytes"] > limit]
    if over:
        raise SystemExit(f"sm_{arch}: shared memory over the limit {limit} B: {over}")
    return COMPILED


def machine() -> str:
    """The CPU's model name and core count."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or platform.machine()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--dtype", choices=DTYPES, action="append", help="logits dtype (default: bfloat16, float32)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    parser.add_argument("--methods", help=f"comma-separated, from {','.join(METHODS)} (default: all)")
    parser.add_argument("--masks", choices=["both", "none", "mask"], default="both")
    parser.add_argument("--cache", help="Triton cache directory (default: a fresh temporary one)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args()
    methods = None if args.methods is None else args.methods.split(",")
    masks = {"both": (False, True), "none": (False,), "mask": (True,)}[args.masks]
    dtypes = [DTYPES[d] for d in args.dtype or ["bfloat16", "float32"]]
    with tempfile.TemporaryDirectory() as fresh:
        os.environ["TRITON_CACHE_DIR"] = args.cache or fresh
        start = time.perf_counter()
        records = compile_all(args.vocab_size, dtypes, args.arch, methods, masks)
        total = time.perf_counter() - start
    print(f"{'kernel':<28}{'specialisation (first needed by)':<62}{'s':>6}{'regs':>6}{'spill':>6}{'smem':>8}")
    for r in sorted(records, key=lambda r: -r["seconds"]):
        print(f"{r['kernel']:<28}{r['specialisation']:<62}{r['seconds']:>6.1f}{r['registers'] or 0:>6}"
              f"{r['spills'] or 0:>6}{r['shared_bytes']:>8}")
    slowest = max((r["seconds"] for r in records), default=0.0)
    print(f"compiled {len(records)} kernels for sm_{args.arch} with triton {triton.__version__} in {total:.0f} s "
          f"(slowest {slowest:.1f} s) on {os.cpu_count()} cores, V={args.vocab_size}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "torch": torch.__version__, "target": f"cuda sm_{args.arch}",
                       "machine": machine(),
                       "python": sys.version.split()[0], "vocab_size": args.vocab_size,
                       "total_seconds": round(total, 1), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
