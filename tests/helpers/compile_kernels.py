"""Compile every kernel for a GPU target without a GPU: ``python tests/helpers/compile_kernels.py [--help]``.

The Triton interpreter runs code that the compiler rejects (types that do not unify across
branches, unsupported ops, shapes that are not powers of 2), so the interpreter tests alone do
not show that the kernels build for a GPU. This script calls each kernel launcher on CPU tensors
with a driver that reports a CUDA target (compute capability ``--arch``, default 90 = H100/H200) and
launches nothing: Triton specialises and compiles each kernel down to a cubin (ptxas ships with
Triton) exactly as on a GPU, for every method and flag combination of the launchers, at the
vocabulary sizes the benchmarks use. Prints a line per family and size (per kernel: registers, local
memory = spills, shared memory, and the number of `cp.async` tile copies = pipelined passes); exits non-zero on the
first failure. Slow (seconds to two minutes per kernel variant on two cores: ~130 variants), so
CI compiles one family (``tests/kernels/test_kernels_compile.py``); run the whole set, with the GPU
machine's Triton version, before a GPU session. Run it without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("compile_kernels.py: unset TRITON_INTERPRET (the interpreter does not compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from specsampler.kernels import chain, mlc, sampling, tree  # noqa: E402


class CompileOnlyDriver:
    """Stands in for the CUDA driver: a fixed target, device 0, no stream; nothing is launched."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


COMPILED: list[tuple[str, float, dict]] = []  # (kernel, seconds, resources)
# shared memory one program may use (the opt-in maximum per block), by compute capability: a launch
# asking for more fails on the GPU only (Triton's OutOfResources), so it fails here
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
_launch = JITFunction.run
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(cubin: bytes) -> dict:
    """Per-thread registers (REG), local memory in bytes (LOCAL: register spills) and shared memory
    of a cubin's kernel, as ``cuobjdump --dump-resource-usage`` reports them ({} without cuobjdump)."""
    if not os.path.exists(_CUOBJDUMP):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", out)}


def _compile_only(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` that compiles (for the active target) and never launches."""
    start = time.perf_counter()
    kernel = _launch(self, *args, grid=grid, warmup=True, **kwargs)
    usage = resources(kernel.asm["cubin"])
    usage["SMEM"] = kernel.metadata.shared  # bytes of shared memory a launch asks for (pipelining buffers)
    usage["CP_ASYNC"] = len(re.findall(r"\bcp\.async\.c[ag]\b", kernel.asm["ptx"]))  # pipelined tile copies
    COMPILED.append((self.__name__, time.perf_counter() - start, usage))
    return kernel


def _chain_inputs(B, K, V, dtype, sampled):
    p = torch.rand(B, K + 1, V).to(dtype)
    q = torch.rand(B, K, V).to(dtype) if sampled else None
    return p, torch.randint(0, V, (B, K)), q, torch.full((B,), K)


def _params(R):
    return (torch.full((R,), 0.8), torch.full((R,), 50, dtype=torch.int64), torch.full((R,), 0.9),
            torch.zeros(R))


def _randomness(B, n, philox):
    """(seed, offset, u_accept, u_sample) for ``B`` requests of ``n`` positions."""
    if philox:
        return torch.arange(B), torch.zeros(B, dtype=torch.int64), None, None
    return None, None, torch.rand(B, n), torch.rand(B, n)


def _tree_links(B, N):
    """A chain-shaped tree of ``N`` nodes per request: (tokens, first_child, next_sibling, max_depth)."""
    first_child = torch.arange(1, N + 1).masked_fill(torch.arange(N) == N - 1, -1).expand(B, N)
    return torch.zeros(B, N, dtype=torch.int64), first_child.contiguous(), torch.full((B, N), -1), N - 1


def chains(V, dtype):
    B, K = 2, 3
    for method in chain.METHODS:
        sampled = method in ("token", "block")
        for philox in (True, False):
            p, x, q, n = _chain_inputs(B, K, V, dtype, sampled)
            rnd = _randomness(B, K + 1, philox)
            chain.verify_chain(p, x, q, n, method, *rnd)
            for masked in (False, True):
                mask = torch.rand(B, K + 1, V) < 0.5 if masked else None
                for rows_in_parallel, parts in ((False, 0), (True, 0), (True, 2)):  # parts: scan_parts first
                    chain.verify_chain_from_logits(p, x, q, n, method, *_params(B * (K + 1)), mask, *rnd,
                                                   rows_in_parallel=rows_in_parallel, parts=parts)


def trees(V, dtype):
    B, N = 2, 5
    for method, sampling_kinds in (("greedy", ("iid",)), ("target_only", ("iid",)),
                                   ("rrs", ("iid", "without_replacement")),
                                   ("traversal", ("iid", "without_replacement"))):
        for draft_sampling in sampling_kinds:
            for philox in (True, False):
                p = torch.rand(B, N, V).to(dtype)
                q = torch.rand(B, N, V).to(dtype) if method in ("rrs", "traversal") else None
                tokens, first_child, next_sibling, D = _tree_links(B, N)
                rnd = _randomness(B, N, philox)
                tree.verify_tree(p, tokens, first_child, next_sibling, q, method, draft_sampling, D, *rnd)
                for masked in (False, True):
                    mask = torch.rand(B, N, V) < 0.5 if masked else None
                    tree.verify_tree_from_logits(p, tokens, first_child, next_sibling, q, method, draft_sampling, D,
                                                 *_params(B * N), mask, *rnd)


def samplers(V, dtype):
    R = 3
    logits = torch.randn(R, V).to(dtype)
    for philox in (True, False):
        rnd = ((torch.arange(R), torch.zeros(R, dtype=torch.int64), torch.arange(R), None) if philox
               else (None, None, None, torch.rand(R)))
        for mask in (None, torch.rand(R, V) < 0.5):
            for parts in (0, 2):  # 2: scan_parts first
                sampling.sample_from_logits(logits, *_params(R), mask, *rnd, parts=parts)
        sampling.sample(logits.float().softmax(-1).to(dtype), *rnd)


def mlc_verify(V, dtype):
    nodes = 4
    mlc.batch_spec_verify(torch.rand(nodes, V).to(dtype), torch.zeros(nodes, dtype=torch.int64),
                          torch.rand(nodes, V), torch.tensor([1, 2, 3, -1]), torch.full((nodes,), -1),
                          torch.rand(nodes), torch.zeros(1, dtype=torch.int64))


FAMILIES = {"chains": chains, "trees": trees, "samplers": samplers, "mlc": mlc_verify}
SIZES = {"small": (1000, torch.float32), "large": (128256, torch.bfloat16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90 (repeatable)")
    parser.add_argument("--family", choices=FAMILIES, action="append", help="launchers to compile (default all)")
    parser.add_argument("--size", choices=SIZES, action="append", help="vocabulary and dtype (default both)")
    args = parser.parse_args()
    JITFunction.run = _compile_only
    start = time.perf_counter()
    for arch in args.arch or [90]:
        driver.set_active(CompileOnlyDriver(arch))
        for family in [FAMILIES[f] for f in args.family or FAMILIES]:
            for V, dtype in [SIZES[s] for s in args.size or SIZES]:
                before = len(COMPILED)
                family(V, dtype)
                done = COMPILED[before:]
                limit = SMEM_LIMIT.get(arch, SMEM_LIMIT[90])
                over = [(n, r["SMEM"]) for n, _, r in done if r["SMEM"] > limit]
                if over:
                    raise SystemExit(f"sm_{arch} {family.__name__} V={V}: shared memory over the limit {limit} B: "
                                     f"{over}")
                usage = "; ".join(
                    f"{name} REG<={max(r.get('REG', 0) for n, _, r in done if n == name)} "
                    f"LOCAL<={max(r.get('LOCAL', 0) for n, _, r in done if n == name)} "
                    f"SMEM<={max(r['SMEM'] for n, _, r in done if n == name)} "
                    f"CP_ASYNC>={min(r['CP_ASYNC'] for n, _, r in done if n == name)}"
                    for name in sorted({n for n, _, _ in done}))
                print(f"sm_{arch} {family.__name__:10s} V={V:<6d} {str(dtype)[6:]:8s} {len(done):3d} launches "
                      f"{sum(t for _, t, _ in done):6.1f} s  {usage}", flush=True)
    print(f"compiled {len(COMPILED)} launches with triton {triton.__version__} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
