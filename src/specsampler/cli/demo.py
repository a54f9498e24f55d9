"""``specsampler demo``: speculative generation with a real model pair, every method side by side.

Loads the built-in pair (:mod:`specsampler.modelpair`, trained on the Python standard library)
or local Hugging Face models (``--target`` / ``--draft``), generates from a few prompts with
plain sampling and with each verification method, and prints the texts and a table of what
each method cost in target calls.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..generate.loop import GenerationOutput, generate, speculative_generate
from ..params import SamplingParams
from ..rng import Philox

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
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="a local Hugging Face causal LM directory (default: the built-in pair)")
    p.add_argument("--draft", help="the draft model's directory (with --target)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three Python snippets)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=4, help="chain length")
    p.add_argument("--tree-shape", default="2,2,1,1", help="children per node at each depth, e.g. 3,2,1")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(args.target).to(args.device).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft).to(args.device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except (OSError, ValueError) as err:
        if target.config.vocab_size != 256:
            raise SystemExit(f"specsampler demo: no tokenizer in {args.target} ({err})") from err
        from ..generate.modelpair import ByteTokenizer

        tokenizer = ByteTokenizer()  # a byte-level model without tokenizer files, like the built-in pair
    return target, draft, tokenizer


def _batch(tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids ``[B, L]`` and their attention mask."""
    ids = [tokenizer.encode(p) for p in prompts]
    L = max(map(len, ids))
    pad = [[0] * (L - len(i)) for i in ids]
    input_ids = torch.tensor([p + i for p, i in zip(pad, ids)], device=device)
    mask = torch.tensor([[0] * len(p) + [1] * len(i) for p, i in zip(pad, ids)], device=device)
    return input_ids, mask


def _progress(label: str, index: int, total_runs: int, total_tokens: int):
    def show(out: GenerationOutput) -> None:
        done = int(out.lengths.sum())
        bar = "#" * (20 * done // total_tokens)
        sys.stderr.write(f"\r  [{index}/{total_runs}] {label:<28}[{bar:<20}] {done}/{total_tokens} tokens")
        sys.stderr.flush()

    return show


def _one_line(text: str, width: int = 110) -> str:
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def demo(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    print("specsampler demo: speculative generation, plain sampling against every verification method")
    target, draft, tokenizer = _load(args)
    count = lambda m: sum(p.numel() for p in m.parameters())
    print(f"target {count(target) / 1e6:.1f}M parameters, draft {count(draft) / 1e6:.2f}M; "
          f"temperature {args.temperature}, top_p {args.top_p}, {args.max_new_tokens} new tokens per prompt, "
          f"chain of {args.num_draft_tokens}, tree {args.tree_shape}\n")
    prompts = args.prompt or PROMPTS
    input_ids, mask = _batch(tokenizer, prompts, args.device)
    B = len(prompts)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    shape = [int(c) for c in args.tree_shape.split(",")]
    results = []
    for i, (label, kwargs) in enumerate(RUNS, 1):
        rng = Philox(torch.arange(B, device=args.device) + args.seed)
        show = _progress(label, i, len(RUNS), B * args.max_new_tokens)
        if kwargs is None:
            out = generate(target, input_ids, args.max_new_tokens, params, rng=rng, attention_mask=mask,
                           on_step=show)
        else:
            tree = dict(tree_shape=shape) if kwargs["drafter"] == "tree" else {}
            out = speculative_generate(target, draft, input_ids, args.max_new_tokens, params, rng=rng,
                                       attention_mask=mask, num_draft_tokens=args.num_draft_tokens, on_step=show,
                                       **tree, **kwargs)
        show(out)
        results.append((label, out))
    sys.stderr.write("\n")

    print("Texts (newlines shown as \\n):")
    for b, prompt in enumerate(prompts):
        print(f"\nprompt {b + 1}: {_one_line(prompt)}")
        for label, out in results:
            ids = [t for t in out.tokens[b].tolist() if t >= 0]
            print(f"  {label:<28}{_one_line(tokenizer.decode(ids))}")

    plain = results[0][1].stats
    print(f"\n{'method':<28}{'tokens/target call':>19}{'acceptance':>12}{'target calls':>14}{'draft calls':>13}"
          f"{'wall s':>8}{'speedup (target calls)':>24}")
    for label, out in results:
        s = out.stats
        acceptance = f"{s.acceptance_rate:.2f}" if s.draft_depth else "-"
        print(f"{label:<28}{s.tokens_per_target_call:>19.2f}{acceptance:>12}{s.target_calls:>14}"
              f"{s.draft_calls:>13}{s.wall_time_s:>8.2f}{plain.target_calls / s.target_calls:>23.2f}x")
    print("\nEvery method's tokens follow the target's own sampling distribution exactly (tests/generate/test_generate.py);"
          "\nthey differ from plain sampling's text only through different random draws. Wall time: models this"
          "\nsmall cost about the same per call (mostly framework overhead), so fewer target calls only save time"
          "\nwhen the target is much larger than the draft."
          f"\nTotal {time.perf_counter() - started:.0f} s.")
    return 0
