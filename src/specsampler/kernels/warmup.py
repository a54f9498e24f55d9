"""Every kernel specialisation a server needs for one model, compiled up front (:func:`warmup`).

A kernel is compiled once per specialisation: its compile-time constants (method, draft sampling, whether a
vocabulary mask is given, the row configuration of V) and the dtypes of its tensors. Sizes, strides and the kind
of randomness are run-time arguments, so for a fixed V, logits dtype and device the specialisations are few (at
most 4 per op and method: docs/design.md, "Serving on a GPU") and none depends on the batch, the chain length or
the tree. :func:`launches` lists one launch of each, on tiny inputs, through the same launchers the public ops
call; :func:`warmup` runs them (in worker processes that fill Triton's on-disk cache, then here, from it);
``benchmarks/compile.py`` compiles them for a GPU target without a GPU, and the tests check that a serving-like
trace of public calls compiles nothing that :func:`launches` does not.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

SAMPLING = ("sample",)
CHAIN = ("token", "block", "target_only", "greedy")
TREE = ("rrs", "traversal", "target_only", "greedy")
METHODS = ("sample", "token", "block", "target_only", "greedy", "rrs", "traversal", "mlc")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPILED_S = 2.5  # a first launch slower than this compiled: warm up the rest in worker processes


class Launch(NamedTuple):
    """One kernel launch of :func:`launches`: the public op it serves, its method and variant, and a call."""

    op: str
    method: str
    variant: str
    run: Callable[[], object]


def _check(vocab_size: int, dtype: torch.dtype, methods: Sequence[str] | None, masks: Sequence[bool]) -> tuple:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"warmup: vocab_size: expected an int >= 2, got {vocab_size!r}")
    if dtype not in DTYPES.values():
        raise ValueError(f"warmup: dtype: expected one of {tuple(DTYPES.values())}, got {dtype!r}")
    methods = METHODS if methods is None else tuple(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"warmup: methods: expected names from {METHODS}, got {unknown[0]!r}")
    masks = tuple(masks)
    if not masks or any(not isinstance(m, bool) for m in masks):
        raise ValueError(f"warmup: masks: expected a non-empty sequence of bools, got {masks!r}")
    return methods, masks


def launches(vocab_size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cuda",
             methods: Sequence[str] | None = None, *, masks: Sequence[bool] = (False, True),
             draft_dtype: torch.dtype = torch.float32) -> list[Launch]:
    """One launch per specialisation the public ops compile for this model: ``vocab_size`` V, logits of
    ``dtype`` (probabilities and draft probabilities of ``draft_dtype``), on ``device``.

    methods: names of :data:`METHODS` (None: all): ``"sample"`` (``sample_from_logits`` and ``sample``), the
    chain methods ``token``, ``block``, ``target_only``, ``greedy``, the tree methods ``rrs``, ``traversal``
    (both draft samplings), ``target_only``, ``greedy``, and ``"mlc"`` (``mlc.batch_spec_verify``).
    masks: the vocabulary-mask modes to cover (False: calls without ``vocab_mask``, True: with one).
    """
    from . import chain, mlc, sampling, tree

    methods, masks = _check(vocab_size, dtype, methods, masks)
    V, dev = vocab_size, torch.device(device)
    g = torch.Generator().manual_seed(0)

    def logits(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, V, generator=g) * 3).to(dev, dtype)

    def probs(*shape: int) -> torch.Tensor:
        return torch.softmax(torch.randn(*shape, V, generator=g) * 3, -1).to(dev, draft_dtype)

    def params(rows: int) -> tuple[torch.Tensor, ...]:  # greedy, top-k + top-p, top-p, min-p rows in turn
        pick = torch.arange(rows) % 4
        return (torch.tensor([0.0, 0.8, 1.0, 1.2])[pick].to(dev), torch.tensor([0, 50, 0, 0])[pick].to(dev),
                torch.tensor([1.0, 0.9, 0.95, 1.0])[pick].to(dev), torch.tensor([0.0, 0.0, 0.0, 0.05])[pick].to(dev))

    def mask(rows: int, on: bool) -> torch.Tensor | None:
        return (torch.rand(rows, V, generator=g) < 0.9).to(dev) if on else None

    keys = torch.arange(1, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
    out: list[Launch] = []
    if "sample" in methods:
        for on in masks:
            out.append(Launch("sample_from_logits", "sample", f"mask={on}", lambda on=on: sampling.sample_from_logits(
                logits(1), *params(1), mask(1, on), *keys, torch.zeros(1, dtype=torch.int64, device=dev))))
        out.append(Launch("sample", "sample", "", lambda: sampling.sample(probs(1), *keys, torch.zeros(
            1, dtype=torch.int64, device=dev))))
    K = 2
    drafts = torch.tensor([[1, 2]], device=dev) % V
    for method in (m for m in CHAIN if m in methods):
        q = probs(1, K) if method in ("token", "block") else None
        for on in masks:
            out.append(Launch("verify_chain_from_logits", method, f"mask={on}", lambda q=q, on=on, m=method:
                              chain.verify_chain_from_logits(logits(1, K + 1), drafts, q, None, m,
                                                             *params(K + 1), mask(K + 1, on), *keys)))
        out.append(Launch("verify_chain", method, "", lambda q=q, m=method: chain.verify_chain(
            probs(1, K + 1), drafts, q, None, m, *keys)))
    # root, two children, a grandchild: every walk has siblings to try and a level to descend
    parents = torch.tensor([[-1, 0, 0, 1]])
    links = [t.to(dev) for t in _links(parents)]
    nodes, depth = parents.shape[1], 2
    tokens = torch.tensor([[0, 1, 2, 3]], device=dev) % V
    for method in (m for m in TREE if m in methods):
        stochastic = method in ("rrs", "traversal")
        for sampling_kind in ("iid", "without_replacement") if stochastic else ("iid",):
            q = probs(1, nodes) if stochastic else None
            for on in masks:
                out.append(Launch("verify_tree_from_logits", method, f"{sampling_kind} mask={on}",
                                  lambda q=q, on=on, m=method, s=sampling_kind: tree.verify_tree_from_logits(
                                      logits(1, nodes), tokens, *links, q, m, s, depth, *params(nodes),
                                      mask(nodes, on), *keys)))
            out.append(Launch("verify_tree", method, sampling_kind, lambda q=q, m=method, s=sampling_kind:
                              tree.verify_tree(probs(1, nodes), tokens, *links, q, m, s, depth, *keys)))
    if "mlc" in methods:
        out.append(Launch("mlc.batch_spec_verify", "mlc", "", lambda: mlc.batch_spec_verify(
            probs(nodes), tokens[0], probs(nodes).float(), links[0][0], links[1][0], torch.rand(nodes, device=dev),
            torch.zeros(1, dtype=torch.int64, device=dev))))
    return out


class TargetDriver:
    """A stand-in for Triton's CUDA driver that reports a GPU target (compute capability ``arch``), device 0
    and no stream: with it active (``triton.runtime.driver.driver.set_active``), Triton specialises and compiles
    kernels for that GPU on a machine without one (``benchmarks/compile.py``; the tests' specialisation keys).
    Nothing can be launched through it."""

    def __init__(self, arch: int = 90):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ..verify.token_tree import TokenTree

    t = TokenTree.from_parents(parents)
    return t.first_child, t.next_sibling


def _run_share(vocab_size: int, dtype: str, device: str, methods: tuple, masks: tuple, draft_dtype: str,
               share: tuple[int, ...]) -> None:
    """A worker process: runs its share of the launches (compiling them into Triton's on-disk cache)."""
    todo = launches(vocab_size, DTYPES[dtype], device, methods, masks=masks, draft_dtype=DTYPES[draft_dtype])
    for i in share:
        todo[i].run()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def warmup(vocab_size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cuda",
           methods: Sequence[str] | None = None, *, masks: Sequence[bool] = (False, True),
           draft_dtype: torch.dtype = torch.float32, workers: int | None = None) -> list[dict]:
    """Compile every kernel specialisation the public ops need for one model, before serving: afterwards no
    call on ``device`` compiles, whatever the batch size, chain length, tree shape, per-row parameters or
    randomness (a ``Philox`` or a generator) of the calls. See :func:`launches` for the arguments.

    With ``workers`` > 1 (None: one per CPU core, at most one per launch), when the first launch had to compile,
    the others are run in that many fresh processes, which compile in parallel into Triton's on-disk cache
    (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``); this process then runs each once, loading them from
    there. A process that finds them all cached warms up in seconds, in this process alone. Returns one record
    per launch: ``op``, ``method``, ``variant``, ``seconds`` (this process's time for it: compile or load, and
    the launch).
    """
    from . import use_triton

    dev = torch.device(device)
    _check(vocab_size, dtype, methods, masks)
    if (dev.type == "cuda" and not torch.cuda.is_available()) or not use_triton(dev):
        raise ValueError(f"warmup: device: expected a device whose ops run the Triton kernels (a CUDA device; CPU "
                         f"tensors only with SPECSAMPLER_BACKEND=triton and TRITON_INTERPRET=1), got {dev}"
                         f"{'' if torch.cuda.is_available() else ' (no CUDA device here)'}")
    todo = launches(vocab_size, dtype, dev, methods, masks=masks, draft_dtype=draft_dtype)
    workers = min(os.cpu_count() or 1, len(todo)) if workers is None else workers
    records = [_timed(todo[0], dev)]
    # a first launch that loaded its kernels from the cache in well under a compile's time says the others are
    # cached too (they were compiled together): then starting worker processes would only cost their start-up
    if workers > 1 and dev.type == "cuda" and records[0]["seconds"] > COMPILED_S:
        names = {v: k for k, v in DTYPES.items()}
        args = (vocab_size, names[dtype], str(dev), tuple(methods or METHODS), tuple(masks), names[draft_dtype])
        shares = [tuple(range(1 + i, len(todo), workers)) for i in range(workers)]
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for done in [pool.submit(_run_share, *args, share) for share in shares]:
                done.result()
    return records + [_timed(launch, dev) for launch in todo[1:]]


def _timed(launch: Launch, device: torch.device) -> dict:
    """Run a launch; its record (op, method, variant, seconds)."""
    start = time.perf_counter()
    launch.run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dict(op=launch.op, method=launch.method, variant=launch.variant, seconds=time.perf_counter() - start)
