"""``specsampler demo``: speculative generation with a real model pair, every method side by side.

Loads the built-in pair (:mod:`specsampler.generate.modelpair`, trained on the Python standard
library) or local Hugging Face models (``--target`` / ``--draft``), generates from a few prompts
with plain sampling, with each verification method and with the n-gram drafter, and prints the
texts and a table of what each method cost: target calls, and wall-clock tokens per second
against plain sampling (each method run once to warm up, then timed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ..generate.loop import GenerationOutput
from ..generate.timing import Method, time_methods
from ..params import SamplingParams
from .bench import device_arg

PROMPTS = [
    "def read_config(path):\n    ",
    "class Queue:\n    def __init__(self",
    "import os\nimport sys\n\n\ndef main(",
]
# (label, speculative_generate arguments; None = plain sampling)
RUNS = [
    ("plain sampling", None),
    ("chain token", dict(drafter="chain", method="token")),
    ("chain block", dict(drafter="chain", method="block")),
    ("tree rrs, iid", dict(drafter="tree", method="rrs", draft_sampling="iid")),
    ("tree rrs, w/o replacement", dict(drafter="tree", method="rrs", draft_sampling="without_replacement")),
    ("tree traversal", dict(drafter="tree", method="traversal", draft_sampling="without_replacement")),
    ("tree target-only (top-k)", dict(drafter="tree", method="target_only", draft_sampling="deterministic")),
    ("n-gram lookup, target-only", dict(drafter="ngram", method="target_only")),
]
NUM_DRAFT_TOKENS, TREE_SHAPE = 4, "2,2,1,1"  # the defaults of --num-draft-tokens and --tree-shape


def sampling_arg(name: str):
    """An argparse ``type``: a float that :class:`SamplingParams` takes as ``name`` (its error, a usage error naming the
    option before the models load)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
            SamplingParams(**{name: value})
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    return parse


def seed_arg(text: str) -> int:
    """An argparse ``type``: a Philox seed, an int in [0, 2**63) (int64)."""
    value = int_at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**63), got {text!r}")
    return value


def int_at_least(low: int):
    """An argparse ``type``: an int >= ``low`` (else a usage error naming the option, not a traceback)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}")
        return value

    return parse


# an int >= 1 (``--max-new-tokens``: the demo compares what the methods generate, and 0 new tokens leave nothing to
# compare or time; ``check --trials``, ``bench --reps``)
positive_int = int_at_least(1)


def tree_shape_arg(text: str) -> list[int]:
    """An argparse ``type`` for ``--tree-shape``: comma-separated children per node at each depth, each >= 1."""
    try:
        shape = [int(c) for c in text.split(",")]
    except ValueError:
        shape = []
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1 (children per node at each depth, "
                                         f"e.g. 3,2,1), got {text!r}")
    return shape


def prompt_arg(text: str) -> str:
    """An argparse ``type`` for ``--prompt``: a non-empty prompt (generation continues at least one token)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty prompt (generation continues at least one token), "
                                         "got ''")
    return text


def demo_defaults() -> dict:
    """The speculative_generate arguments the demo's runs share by default (chain length, tree shape)."""
    return dict(num_draft_tokens=NUM_DRAFT_TOKENS, tree_shape=tree_shape_arg(TREE_SHAPE))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="a local Hugging Face causal LM directory (default: the built-in pair)")
    p.add_argument("--draft", help="the draft model's directory (with --target)")
    p.add_argument("--prompt", action="append", type=prompt_arg,
                   help="a prompt (repeatable; default: three Python snippets)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="new tokens per prompt (>= 1)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=NUM_DRAFT_TOKENS, help="chain length")
    p.add_argument("--tree-shape", type=tree_shape_arg, default=TREE_SHAPE,
                   help="children per node at each depth, e.g. 3,2,1")
    p.add_argument("--temperature", type=sampling_arg("temperature"), default=0.8)
    p.add_argument("--top-p", type=sampling_arg("top_p"), default=0.95)
    p.add_argument("--seed", type=seed_arg, default=0, help="the Philox seed of every request (an int in [0, 2**63))")
    p.add_argument("--device", default="cpu", type=device_arg)


def _load(args: argparse.Namespace):
    """(target, draft, tokenizer): the built-in pair, or the models at ``--target`` / ``--draft``."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # the demo shows its own progress
    if args.target is None:
        if args.draft is not None:
            raise SystemExit("specsampler demo: --draft needs --target")
        from ..generate.modelpair import load_pair

        return load_pair(device=args.device)
    if args.draft is None:
        raise SystemExit("specsampler demo: --target needs --draft")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if not os.path.isdir(path):  # transformers would read it as a hub id and fail on its characters
            raise SystemExit(f"specsampler demo: {flag}: expected a local model directory, got {path!r} (no such "
                             "directory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def model(flag: str, path: str):
        try:
            return AutoModelForCausalLM.from_pretrained(path).to(args.device).eval()
        except OSError as err:  # no weights, an unreadable config: a usage error (as a directory it cannot use)
            raise ValueError(f"{flag}: expected a model directory transformers can load, got {path!r} ({err})") from err

    target, draft = model("--target", args.target), model("--draft", args.draft)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except (OSError, ValueError) as err:
        if target.config.vocab_size != 256:
            raise SystemExit(f"specsampler demo: no tokenizer in {args.target} ({err})") from err
        from ..generate.modelpair import ByteTokenizer

        tokenizer = ByteTokenizer()  # a byte-level model without tokenizer files, like the built-in pair
    return target, draft, tokenizer


def _batch(tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids int64 ``[B, L]`` and their attention mask. A prompt the tokenizer turns into no tokens is a
    ValueError naming ``--prompt`` (a usage error)."""
    ids = [tokenizer.encode(p) for p in prompts]
    for p, i in zip(prompts, ids):
        if not i:
            raise ValueError(f"--prompt: expected a prompt of at least one token, got {p!r} (no tokens)")
    L = max(map(len, ids))
    pad = [[0] * (L - len(i)) for i in ids]
    input_ids = torch.tensor([p + i for p, i in zip(pad, ids)], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * len(p) + [1] * len(i) for p, i in zip(pad, ids)], dtype=torch.long, device=device)
    return input_ids, mask


def _progress(total: int):
    """Report each timed run on stderr as it ends."""
    done = []

    def show(method: Method, out: GenerationOutput) -> None:
        done.append(method.label)
        rate = int(out.lengths.sum()) / out.stats.wall_time_s
        sys.stderr.write(f"\r  [{len(done)}/{total}] {method.label:<28} {rate:8.0f} tokens/s" + " " * 10)
        sys.stderr.flush()

    return show


def _one_line(text: str, width: int = 110) -> str:
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _warm_kernels(target, device: str) -> None:
    """On a GPU, compile the kernels the runs use before timing anything (specsampler.warmup, in parallel
    processes; from Triton's on-disk cache when an earlier run compiled them)."""
    from ..kernels import use_triton

    if torch.device(device).type != "cuda" or not use_triton(torch.device(device)):
        return
    from ..kernels.warmup import warmup

    start = time.perf_counter()
    dtype = next(target.parameters()).dtype
    records = warmup(target.config.vocab_size, dtype, device,
                     ["sample", "token", "block", "target_only", "rrs", "traversal"], masks=(False,))
    print(f"kernels: {len(records)} launches compiled or loaded from Triton's cache in "
          f"{time.perf_counter() - start:.1f} s (specsampler.warmup)\n")


def demo(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    torch.set_num_threads(1)  # models this small gain nothing from more, and timings stay comparable
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)  # each value checked by its option
    print("specsampler demo: speculative generation, plain sampling against every verification method")
    target, draft, tokenizer = _load(args)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    print(f"target {count(target) / 1e6:.1f}M parameters, draft {count(draft) / 1e6:.2f}M; "
          f"temperature {args.temperature}, top_p {args.top_p}, {args.max_new_tokens} new tokens per prompt, "
          f"chain of {args.num_draft_tokens}, tree {','.join(map(str, args.tree_shape))}, one thread\n")
    _warm_kernels(target, args.device)
    prompts = args.prompt or PROMPTS
    input_ids, mask = _batch(tokenizer, prompts, args.device)
    methods = [Method(label, kwargs) for label, kwargs in RUNS]
    outputs: dict[str, GenerationOutput] = {}

    def keep(method: Method, out: GenerationOutput) -> None:
        outputs[method.label] = out
        show(method, out)

    show = _progress(len(methods))
    defaults = dict(num_draft_tokens=args.num_draft_tokens, tree_shape=args.tree_shape)
    records = time_methods(target, draft, input_ids, mask, args.max_new_tokens, params, methods, reps=1,
                           seed=args.seed, defaults=defaults, on_run=keep)
    sys.stderr.write("\n")

    print("Texts (newlines shown as \\n):")
    for b, prompt in enumerate(prompts):
        print(f"\nprompt {b + 1}: {_one_line(prompt)}")
        for m in methods:
            ids = [t for t in outputs[m.label].tokens[b].tolist() if t >= 0]
            print(f"  {m.label:<28}{_one_line(tokenizer.decode(ids))}")

    plain_calls = outputs[methods[0].label].stats.target_calls
    print(f"\n{'method':<28}{'tokens/target call':>19}{'acceptance':>12}{'target calls':>14}{'draft calls':>13}"
          f"{'wall s':>8}{'tokens/s':>10}{'speedup (wall)':>16}{'speedup (target calls)':>24}")
    for m, rec in zip(methods, records):
        s = outputs[m.label].stats
        acceptance = f"{s.acceptance_rate:.2f}" if s.draft_depth else "-"
        print(f"{m.label:<28}{s.tokens_per_target_call:>19.2f}{acceptance:>12}{s.target_calls:>14}"
              f"{s.draft_calls:>13}{rec['wall_ms'] / 1e3:>8.2f}{rec['tokens_per_s']:>10.0f}{rec['speedup']:>15.2f}x"
              f"{plain_calls / s.target_calls:>23.2f}x")
    chain = next(r for r in records if r["settings"] and r["settings"].get("drafter") == "chain")
    per_target = chain["target_forward_ms"] / max(1, chain["target_calls"])
    per_draft = chain["draft_forward_ms"] / max(1, outputs[chain["method"]].stats.draft_calls)
    print("\nEvery method's tokens follow the target's own sampling distribution exactly (tests/generate/);"
          "\nthey differ from plain sampling's text only through different random draws. Speedup (wall): tokens"
          "\nper second over plain sampling's (one thread). A step costs one target call and a draft call per"
          "\ndraft level: fewer target calls save time only as far as a target call costs more than the draft's"
          f"\ncalls. Here a target call took {per_target:.1f} ms and a draft call {per_draft:.1f} ms "
          f"({per_target / per_draft:.1f}x);\nthe n-gram drafter needs no draft calls."
          f"\nTotal {time.perf_counter() - started:.0f} s.")
    return 0
