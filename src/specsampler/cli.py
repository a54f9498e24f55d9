"""The ``specsampler`` command line."""

from __future__ import annotations

import argparse
import sys

import torch

from . import Philox, SamplingParams, TokenTree, logits_to_probs, sample_from_logits


def demo(args: argparse.Namespace) -> int:
    """A short tour of what exists: per-request sampling on one batch, seeds, token trees."""
    torch.manual_seed(args.seed)
    V = args.vocab
    print(f"specsampler demo: 4 requests, vocabulary {V}, synthetic Zipf-like logits\n")
    ranks = torch.randperm(V)
    logits = (-1.1 * torch.log1p(ranks.float()))[None, :].repeat(4, 1) + 0.3 * torch.randn(4, V)
    params = SamplingParams(
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.0]),
        top_k=torch.tensor([0, 50, 0, 0]),
        top_p=torch.tensor([1.0, 0.9, 0.9, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.05]),
    )
    names = ["greedy", "T=0.7 top_k=50 top_p=0.9", "T=1 top_p=0.9", "T=1 min_p=0.05"]
    probs = logits_to_probs(logits, params)
    out = sample_from_logits(logits, params, rng=Philox(torch.tensor([11, 12, 13, 14])), num_logprobs=3)
    print(f"{'request':<28}{'kept tokens':>12}{'token':>8}{'logprob':>10}   top-3 (id: logprob)")
    for b in range(4):
        top = ", ".join(f"{int(i)}: {float(lp):.2f}" for i, lp in zip(out.top_token_ids[b], out.top_logprobs[b]))
        print(f"{names[b]:<28}{int((probs[b] > 0).sum()):>12}{int(out.tokens[b]):>8}"
              f"{float(out.logprobs[b]):>10.3f}   {top}")

    print("\nPer-request seeds: request 2 alone, and moved to the front of a reversed batch,")
    alone = sample_from_logits(logits[2:3], SamplingParams(temperature=1.0, top_p=0.9), rng=Philox(13))
    rev = sample_from_logits(logits.flip(0), params=SamplingParams(
        temperature=params.temperature.flip(0), top_k=params.top_k.flip(0), top_p=params.top_p.flip(0),
        min_p=params.min_p.flip(0)), rng=Philox(torch.tensor([14, 13, 12, 11])))
    print(f"draws token {int(alone.tokens[0])} alone and {int(rev.tokens[1])} in the reversed batch "
          f"(batch of 4 drew {int(out.tokens[2])}).")
    offsets = [int(sample_from_logits(logits[2:3], SamplingParams(top_p=0.9), rng=Philox(13, o)).tokens[0])
               for o in range(6)]
    print(f"Offsets 0..5 of the same seed give: {offsets}")

    print("\nA draft tree (parents form) and its other forms:")
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, -1, -1, -1]]))
    print(f"  {tree}")
    for name in ("parents", "first_child", "next_sibling", "depth"):
        print(f"  {name:<13} {getattr(tree, name).tolist()}")
    same = TokenTree.from_mask(tree.mask())
    print(f"  from its ancestor mask again: parents {same.parents.tolist()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specsampler", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="a short demonstration of the library")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
