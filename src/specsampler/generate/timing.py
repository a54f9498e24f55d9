"""Where a generation's wall time goes: the models' forward passes, and the rest (the library's share).

A run's forward time is the time spent inside the models' ``forward`` (timed by wrapping it, as
:func:`forward_timer` does); everything else in the call (sampling, drafting, verification, cache
bookkeeping, masks) is the library's. :func:`time_methods` runs plain sampling and speculative
methods interleaved, round after round, and reports medians: the measurements behind
``specsampler bench generate`` and the demo's table.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..params import SamplingParams
from ..rng import Philox
from .loop import GenerationOutput, generate, speculative_generate


@dataclass
class ForwardClock:
    """Seconds spent inside each model's ``forward`` (keyed by the name given to :func:`forward_timer`)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.seconds = {name: 0.0 for name in self.seconds}


@contextlib.contextmanager
def forward_timer(models: dict[str, torch.nn.Module], sync: Callable[[], None] | None = None) -> Iterator[ForwardClock]:
    """Time every call of each model's ``forward`` while the context is open.

    ``models``: name -> module (the same module under two names is timed once, under the first).
    ``sync``: called before and after each timed call (``torch.cuda.synchronize`` on a GPU, so
    that a forward's kernels count as its time). The wrappers are removed on exit.
    """
    clock = ForwardClock({name: 0.0 for name in models})
    wrapped: list[torch.nn.Module] = []
    for name, model in models.items():
        if any(model is m for m in wrapped):
            continue
        inner = model.forward

        def timed(*args, _inner=inner, _name=name, **kwargs):
            if sync is not None:
                sync()
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                clock.seconds[_name] += time.perf_counter() - start

        model.forward = timed  # an instance attribute: nn.Module.__call__ finds it first
        wrapped.append(model)
    try:
        yield clock
    finally:
        for model in wrapped:
            del model.forward


@dataclass(frozen=True)
class Method:
    """A labelled generation setting: ``kwargs`` of :func:`speculative_generate`, or None for plain sampling."""

    label: str
    kwargs: dict | None


def _run(method: Method, target, draft, input_ids, attention_mask, max_new_tokens: int, params, seed: int,
         defaults: dict) -> GenerationOutput:
    B = input_ids.shape[0]
    rng = Philox(torch.arange(B, device=input_ids.device) + seed)
    if method.kwargs is None:
        return generate(target, input_ids, max_new_tokens, params, rng=rng, attention_mask=attention_mask)
    kwargs = {**defaults, **method.kwargs}
    if kwargs.get("drafter") != "tree":
        kwargs.pop("tree_shape", None)
    model = None if kwargs.get("drafter") == "ngram" else draft
    return speculative_generate(target, model, input_ids, max_new_tokens, params, rng=rng,
                                attention_mask=attention_mask, **kwargs)


def time_methods(target, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
                 params: SamplingParams | None, methods: Sequence[Method], *, reps: int = 3, warmup: int = 1,
                 seed: int = 0, defaults: dict | None = None,
                 on_run: Callable[[Method, GenerationOutput], None] | None = None) -> list[dict]:
    """Time each method on the same prompts, interleaved (one run of each per round), and return
    one record per method with medians over ``reps`` rounds (after ``warmup`` rounds).

    Record fields: ``method``, ``B``, ``new_tokens`` (all requests), ``steps`` (model-call steps:
    tokens for plain sampling, verification steps otherwise), ``wall_ms``, ``forward_ms``
    (target and draft, also apart as ``target_forward_ms`` / ``draft_forward_ms``),
    ``library_ms`` (wall minus forward), ``library_ms_per_step``, ``forward_ms_per_step``,
    ``library_share`` (library over forward time), ``tokens_per_s`` (wall clock),
    ``speedup`` (over the first method's tokens per second, plain sampling where it is first),
    ``target_calls``, ``draft_calls``, ``tokens_per_target_call`` and ``acceptance``. Every run of a method
    generates the same tokens (same seed), so the rounds differ in time only.
    ``defaults``: :func:`speculative_generate` arguments every speculative method gets unless
    it sets them (``tree_shape`` only reaches tree drafters). ``on_run``: called after each
    timed run.
    """
    defaults = defaults or {}
    dev = input_ids.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    samples: dict[str, list[tuple[float, float, float, float]]] = {m.label: [] for m in methods}
    outputs: dict[str, GenerationOutput] = {}
    with forward_timer({"target": target, "draft": draft} if draft is not None else {"target": target},
                       sync) as clock:
        for rnd in range(warmup + reps):
            for m in methods:
                clock.reset()
                if sync is not None:
                    sync()
                start = time.perf_counter()
                out = _run(m, target, draft, input_ids, attention_mask, max_new_tokens, params, seed, defaults)
                if sync is not None:
                    sync()
                wall = time.perf_counter() - start
                if rnd >= warmup:
                    samples[m.label].append((wall, clock.total, clock.seconds["target"],
                                             clock.seconds.get("draft", 0.0)))
                    outputs[m.label] = out
                    if on_run is not None:
                        on_run(m, out)
    records = []
    for m in methods:
        runs, out = samples[m.label], outputs[m.label]
        wall = statistics.median(r[0] for r in runs)
        fwd = statistics.median(r[1] for r in runs)
        lib = statistics.median(r[0] - r[1] for r in runs)
        s = out.stats
        steps = len(s.accepted_per_step) if m.kwargs is not None else max(s.new_tokens, default=0)
        tokens = sum(s.new_tokens)
        records.append({
            "method": m.label,
            "settings": m.kwargs,
            "B": input_ids.shape[0],
            "new_tokens": tokens,
            "steps": steps,
            "wall_ms": round(wall * 1e3, 2),
            "forward_ms": round(fwd * 1e3, 2),
            "target_forward_ms": round(statistics.median(r[2] for r in runs) * 1e3, 2),
            "draft_forward_ms": round(statistics.median(r[3] for r in runs) * 1e3, 2),
            "library_ms": round(lib * 1e3, 2),
            "library_ms_per_step": round(lib * 1e3 / max(1, steps), 3),
            "forward_ms_per_step": round(fwd * 1e3 / max(1, steps), 3),
            "library_share": round(lib / fwd, 4) if fwd > 0 else None,
            "tokens_per_s": round(tokens / wall, 1),
            "target_calls": s.target_calls,
            "draft_calls": s.draft_calls,
            "tokens_per_target_call": round(s.tokens_per_target_call, 3),
            "acceptance": round(s.acceptance_rate, 3) if s.draft_depth else None,
            "reps": reps,
        })
    base = records[0]["tokens_per_s"] if records else 0
    for r in records:
        r["speedup"] = round(r["tokens_per_s"] / base, 3) if base else None
    return records
