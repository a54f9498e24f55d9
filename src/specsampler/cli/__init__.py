"""The ``specsampler`` command line."""

from __future__ import annotations

import argparse
import os
import time

import torch

from .. import (
    Philox,
    SamplingParams,
    TokenTree,
    logits_to_probs,
    sample_from_logits,
    verify_chain,
    verify_chain_from_logits,
    verify_tree_from_logits,
)
from . import demo
from .bench import device_arg, device_name_arg


def tour(args: argparse.Namespace) -> int:
    """A short tour of the API on synthetic logits: per-request sampling on one batch, seeds, token trees."""
    torch.manual_seed(args.seed)
    V = args.vocab
    print(f"specsampler tour: 4 requests, vocabulary {V}, synthetic Zipf-like logits\n")
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

    print("\nPer-request seeds: request 2 sampled alone, and inside the same batch reversed,")
    alone = sample_from_logits(logits[2:3], SamplingParams(temperature=1.0, top_p=0.9), rng=Philox(13))
    rev = sample_from_logits(logits.flip(0), params=SamplingParams(
        temperature=params.temperature.flip(0), top_k=params.top_k.flip(0), top_p=params.top_p.flip(0),
        min_p=params.min_p.flip(0)), rng=Philox(torch.tensor([14, 13, 12, 11])))
    print(f"draws token {int(alone.tokens[0])} alone and {int(rev.tokens[1])} in the reversed batch "
          f"(batch of 4 drew {int(out.tokens[2])}).")
    offsets = [int(sample_from_logits(logits[2:3], SamplingParams(top_p=0.9), rng=Philox(13, o)).tokens[0])
               for o in range(6)]
    print(f"Offsets 0..5 of the same seed give: {offsets}")

    print("\nA draft chain of K=4 tokens per request, verified against the target logits (params as above):")
    K = 4
    target_logits = logits[:, None, :] + 0.5 * torch.randn(4, K + 1, V)
    draft_logits = target_logits[:, :K] + 0.8 * torch.randn(4, K, V)
    draft_probs = torch.softmax(draft_logits, -1)
    sampled = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=torch.Generator().manual_seed(1)).view(4, K)
    rng = Philox(torch.tensor([21, 22, 23, 24]))
    runs = [("token", sampled, draft_probs), ("block", sampled, draft_probs),
            ("target_only", draft_logits.argmax(-1), None), ("greedy", draft_logits.argmax(-1), None)]
    print(f"  {'method':<12}{'accepted':<14}{'expected':<26}emitted (request 1 | 2 | 3 | 4)")
    for method, drafts, q in runs:
        res = verify_chain_from_logits(target_logits, drafts, params, draft_probs=q, method=method, rng=rng)
        emitted = " | ".join(" ".join(str(t) for t in row.tolist() if t >= 0) for row in res.tokens)
        expected = " ".join(f"{float(e):.2f}" for e in res.expected_accepted)
        print(f"  {method:<12}{str(res.num_accepted.tolist()):<14}{expected:<26}{emitted}")

    print("\nA draft tree (parents form) and its other forms:")
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, -1, -1, -1]]))
    print(f"  {tree}")
    for name in ("parents", "first_child", "next_sibling", "depth"):
        print(f"  {name:<13} {getattr(tree, name).tolist()}")
    same = TokenTree.from_mask(tree.mask())
    print(f"  from its ancestor mask again: parents {same.parents.tolist()}")

    print("\nThat tree's two shapes verified for requests 1 and 2 (children: the drafter's top-2, or a chain):")
    tree_logits = logits[:2, None, :] + 0.5 * torch.randn(2, 7, V)
    draft_logits = tree_logits + 0.8 * torch.randn(2, 7, V)
    top2 = draft_logits.topk(2, dim=-1).indices  # each node's two most likely next tokens
    tokens = torch.zeros(2, 7, dtype=torch.long)
    for b in range(2):
        for v in range(1, 7):
            p = int(tree.parents[b, v])
            if p >= 0:
                tokens[b, v] = top2[b, p, int(tree.sibling_rank[b, v])]
    two = SamplingParams(temperature=torch.tensor([0.0, 0.7]), top_p=0.9)
    rng = Philox(torch.tensor([31, 32]))
    for method in ("greedy", "target_only"):
        res = verify_tree_from_logits(tree_logits, tokens, tree, two, method=method, rng=rng)
        print(f"  {method:<12} path {res.path.tolist()}  tokens {res.tokens.tolist()}")
    q = torch.softmax(draft_logits, -1)
    sampled = torch.multinomial(q.view(-1, V), 1, generator=torch.Generator().manual_seed(2)).view(2, 7)
    # each node's token drawn from its parent's q
    draft_rows = q.gather(1, tree.parents.clamp(min=0)[:, :, None].expand(2, 7, V))
    for method in ("rrs", "traversal"):
        res = verify_tree_from_logits(tree_logits, sampled, tree, two, draft_probs=draft_rows, method=method,
                                      rng=rng)
        print(f"  {method:<12} path {res.path.tolist()}  tokens {res.tokens.tolist()}")
    print("\n`specsampler check` proves every method exact; `specsampler bench` times them.")
    return 0


CHECK_MODELS = [(4, 3, True, 11), (6, 2, False, 12), (3, 4, True, 13), (5, 4, False, 15)]  # V, K, zeros, seed
CHECK_TREES = [([2, 2], 4, True, 21), ([3, 1], 4, False, 22), ([1, 2, 1], 4, True, 23), ([2, 2, 2], 3, False, 24)]
TREE_RULES = [("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid"),
              ("traversal", "without_replacement"), ("target_only", "top_k")]
HEAD = (f"{'method':<34}{'model':<20}{'oracle err':>11}{'p emitted':>11}{'p target':>10}{'accepted':>10}"
        f"{'MC':>9}{'z':>6}")


def _check_row(name: str, model: str, mc) -> bool:
    """Print one Monte Carlo run; True when it agrees with the oracle and the oracle with the target."""
    good = mc.oracle_error < 1e-12 and min(mc.p_emitted, mc.p_continued) > 1e-4 and mc.impossible == 0
    good &= mc.z_score() < 5
    print(f"{name:<34}{model:<20}{mc.oracle_error:>11.1e}{mc.p_emitted:>11.3f}{mc.p_continued:>10.3f}"
          f"{mc.exact.expected_accepted:>10.4f}{mc.accepted.mean():>9.4f}{mc.z_score():>6.1f}"
          + ("" if good else "  FAIL"))
    return good


def _check_chains(trials: int) -> bool:
    from ..verify import oracle
    from ..verify.exactness import Table, argmax_drafter, chain_inputs, chain_monte_carlo, random_model

    print(f"Chain verification ({trials} trials per row)\n{HEAD}\n" + "-" * len(HEAD))
    ok, gains = True, []
    for V, K, zeros, seed in CHECK_MODELS:
        model = f"V={V} K={K}" + (" zeros" if zeros else "")
        expected = {}
        for method in ("token", "block", "target_only"):
            mc = chain_monte_carlo(method, V, K, trials, seed, zeros)
            ok &= _check_row(method, model, mc)
            expected[method] = mc.exact.expected_accepted
        gains.append(expected["block"] / expected["token"] - 1)
        target, draft = random_model(V, seed, zeros), random_model(V, seed + 1000, zeros)
        p, x, _ = chain_inputs(Table(target, V, K + 1), Table(draft, V, K), K, 1, False, torch.Generator())
        res = verify_chain(p, x, method="greedy")  # argmax drafts: one verification says all
        (seq,) = oracle.chain(target, argmax_drafter(draft), K, "greedy", V).sequences
        good = res.tokens[0, : len(seq)].tolist() == list(seq) == list(oracle.greedy_sequence(target, len(seq)))
        ok &= good
        print(f"{'greedy':<34}{model:<20}{'walk':>11}{'':>21}{len(seq) - 1:>10}{int(res.num_accepted[0]):>9}"
              + ("" if good else "  FAIL"))
    print("block over token, expected accepted drafts: " + ", ".join(f"{g:+.1%}" for g in gains) + "\n")
    return ok


def _check_trees(trials: int) -> bool:
    from ..verify.exactness import tree_monte_carlo

    print(f"Tree verification ({trials} trials per row; drafting: iid, without replacement, top-k)")
    print(f"{HEAD}\n" + "-" * len(HEAD))
    ok = True
    for shape, V, zeros, seed in CHECK_TREES:
        model = f"{shape} V={V}" + (" zeros" if zeros else "")
        for method, drafting in TREE_RULES:
            mc = tree_monte_carlo(method, shape, V, trials, seed, drafting, zeros)
            ok &= _check_row(f"{method} / {drafting}", model, mc)
    print()
    return ok


def check(args: argparse.Namespace) -> int:
    """Exactness of every verification method: the oracle against the target, the real code against the oracle."""
    print("oracle err: largest deviation of the exact output (continued by the target) from the target's joint")
    print("distribution; p: chi-square p-values of the real code's emitted sequences against the oracle and,")
    print("continued, against the target; accepted: exact expected accepted drafts, and the Monte Carlo mean")
    print("with its distance z in standard errors. Random context-dependent models on small vocabularies.\n")
    ok = True
    if args.only in (None, "chain"):
        ok &= _check_chains(args.trials)
    if args.only in (None, "tree"):
        ok &= _check_trees(args.trials)
    print("all exact" if ok else "FAILURES above")
    return 0 if ok else 1


def run_bench(args: argparse.Namespace) -> int:
    """Benchmarks (specsampler.bench): a table, JSON records and optionally a plot. Measurements, not tests: the
    table and the records say which targets were met, and the command succeeds either way."""
    from .bench import run, run_generate

    if args.what == "generate":
        run_generate(args.device, args.reps or 3, args.quick, args.out, args.plot, args.max_new_tokens)
    else:
        run(args.device, args.reps or 15, args.quick, args.out, args.plot)
    return 0


def warmup(args: argparse.Namespace) -> int:
    """Compile every kernel specialisation a server needs for one model (specsampler.warmup); a table."""
    from ..kernels.warmup import DTYPES
    from ..kernels.warmup import warmup as run

    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    masks = {"both": (False, True), "none": (False,), "mask": (True,)}[args.masks]
    start = time.perf_counter()
    records = run(args.vocab_size, DTYPES[args.dtype], args.device, methods, masks=masks,
                  draft_dtype=DTYPES[args.draft_dtype], workers=args.workers)
    total = time.perf_counter() - start
    print(f"{'op':<26}{'method':<13}{'variant':<28}{'seconds':>8}")
    for r in records:
        print(f"{r['op']:<26}{r['method']:<13}{r['variant']:<28}{r['seconds']:>8.2f}")
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    print(f"{len(records)} launches warmed up in {total:.1f} s (V={args.vocab_size}, {args.dtype} logits, "
          f"{args.device}); Triton's cache: {cache}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specsampler", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="speculative generation with a real model pair: every method side by side")
    demo.add_arguments(p)
    p.set_defaults(func=demo.demo)
    p = sub.add_parser("tour", help="a short tour of the API on synthetic logits")
    p.add_argument("--vocab", type=demo.int_at_least(2), default=32000)  # the tree drafts each node's top-2
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=tour)
    p = sub.add_parser("check", help="exactness checks of every verification method (oracle and Monte Carlo)")
    # a z-test of the mean needs a sample of some size: fewer trials decide nothing
    p.add_argument("--trials", type=demo.int_at_least(1000), default=100_000, help="trials per row (>= 1000)")
    p.add_argument("--only", choices=["chain", "tree"], help="check one family only")
    p.set_defaults(func=check)
    p = sub.add_parser("bench", help="benchmarks: ops against plain-PyTorch baselines and the one-read floor, or "
                       "`bench generate`: where generation's time goes, every method on the built-in pair")
    p.add_argument("what", nargs="?", choices=["ops", "generate"], default="ops")
    p.add_argument("--device", default="cpu", type=device_arg)
    p.add_argument("--reps", type=demo.positive_int, help="rounds per case (default: 15 for ops, 3 for generate)")
    p.add_argument("--max-new-tokens", type=demo.positive_int,
                   help="generate: new tokens per prompt (>= 1; default 96, 24 with --quick)")
    p.add_argument("--quick", action="store_true", help="smaller shapes")
    p.add_argument("--out", help="write the JSON records here")
    p.add_argument("--plot", help="write a PNG of the speedups here (needs matplotlib)")
    p.set_defaults(func=run_bench)
    p = sub.add_parser("warmup", help="compile every kernel a server needs for one model, before serving")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="of the logits")
    p.add_argument("--draft-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="of draft (and target) probabilities")
    p.add_argument("--device", default="cuda", type=device_name_arg)
    p.add_argument("--methods", help="comma-separated: sample, token, block, target_only, greedy, rrs, traversal, mlc "
                   "(default: all)")
    p.add_argument("--masks", choices=["both", "none", "mask"], default="both",
                   help="calls without a vocab_mask, with one, or both")
    p.add_argument("--workers", type=int, help="compiling processes (default: one per core)")
    p.set_defaults(func=warmup)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad values of the arguments (the library's errors name them): a usage error
        parser.exit(2, f"specsampler {args.command}: error: {e}\n")


