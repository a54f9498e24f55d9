"""The PyTorch path on inputs a server meets: ``python benchmarks/inputs.py [--reps 5] [--out FILE]``.

`specsampler bench` times each op on rows of one kind; a server's batches are not so tidy. Each case here is one
such batch, timed as `specsampler bench` times its cases (the variants interleaved, medians, a one-read floor of
the inputs in the same run; :func:`specsampler.cli.bench.measure`), against baselines measured beside it:

- a batch mixing every kind of row (greedy, top-k, top-k + top-p, top-p with a wide and a one-token nucleus,
  min-p, plain), against the same rows sampled kind by kind ("kinds apart": a batch should cost no more);
- rows a grammar mask leaves 12 tokens of, sampled with top-p, against the textbook sort-based sampler;
- flat rows (every logit equal) with top-p 0.5, against the sort-based sampler;
- chain ``token`` verification from logits under a 50-token mask, against masked softmax, a sort-based top-p and
  the materialising verifier;
- ``rrs`` and ``traversal`` trees (8 requests of 16 nodes) whose target rows keep top-k 50 + top-p 0.9, against
  the same walks over whole rows ("whole rows": how they ran before their rows were held by their candidates);
- top-p over nuclei of tens of thousands of tokens (rows ``N(0, 2^2)``, top-p 0.95), against the sort-based sampler;
- greedy sampling of one request and greedy chain verification, against ``argmax`` and a textbook greedy verify;
- FlashInfer's ``top_p_sampling_from_probs`` (``specsampler.compat.flashinfer``), against the sort-based sampler on
  the same probabilities.

Prints a table; ``--out`` writes the JSON records (device, shapes, median time, GB/s, floor ratio, baselines).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch

import specsampler as ss
from specsampler.cli.bench import (
    Case,
    device_name,
    materialising_chain_verify,
    measure,
    sort_sampler,
)
from specsampler.verify import walks

SP = ss.SamplingParams
V = 128256


@contextlib.contextmanager
def whole_rows():
    """The walks over whole rows (no row held by its candidates)."""
    few = walks._few_candidates
    walks._few_candidates = lambda rp, V: 0
    try:
        yield
    finally:
        walks._few_candidates = few


def _per_row(kinds: list[tuple[int, SP]]) -> SP:
    """Per-row parameters of ``count`` rows of each kind, in order."""
    fields = ("temperature", "top_k", "top_p", "min_p")
    return SP(*(torch.tensor([getattr(p, f) for n, p in kinds for _ in range(n)]) for f in fields))


def mixed_case(g: torch.Generator) -> Case:
    kinds = [(16, SP(0.8)), (16, SP(0.8, top_k=50, top_p=0.9)), (8, SP(0.8, top_p=0.9)), (10, SP(0.8, top_p=0.9)),
             (10, SP(0.0)), (10, SP(1.0, min_p=0.1)), (10, SP(1.0, top_k=20))]
    logits = torch.randn(80, V, generator=g) * 3
    logits[40:50, 777] = 60.0  # these top-p rows: one token alone reaches top-p
    params, rng = _per_row(kinds), ss.Philox(torch.arange(80))
    starts = torch.tensor([0] + [n for n, _ in kinds]).cumsum(0).tolist()
    apart = [(logits[s:e], p, ss.Philox(torch.arange(s, e))) for (s, e), (_, p) in zip(zip(starts, starts[1:]), kinds)]
    return Case("sample_from_logits", {"B": 80, "V": V, "rows": "7 kinds"}, [logits],
                lambda: ss.sample_from_logits(logits, params, rng),
                {"kinds apart": lambda: [ss.sample_from_logits(x, p, r) for x, p, r in apart]})


def masked_case(g: torch.Generator, gd: torch.Generator) -> Case:
    logits = torch.randn(32, V, generator=g) * 3
    mask = torch.zeros(32, V, dtype=torch.bool)
    mask[:, torch.randperm(V, generator=g)[:12]] = True
    params, rng = SP(1.0, top_p=0.9), ss.Philox(torch.arange(32))
    return Case("sample_from_logits", {"B": 32, "V": V, "top_p": 0.9, "mask": "12 tokens"}, [logits, mask],
                lambda: ss.sample_from_logits(logits, params, rng, vocab_mask=mask),
                {"sort_based": lambda: sort_sampler(logits.masked_fill(~mask, -torch.inf), 1.0, 0, 0.9, gd)})


def flat_case(gd: torch.Generator) -> Case:
    logits = torch.zeros(8, V)
    params, rng = SP(1.0, top_p=0.5), ss.Philox(torch.arange(8))
    return Case("sample_from_logits", {"B": 8, "V": V, "top_p": 0.5, "rows": "flat"}, [logits],
                lambda: ss.sample_from_logits(logits, params, rng),
                {"sort_based": lambda: sort_sampler(logits, 1.0, 0, 0.5, gd)})


def masked_chain_case(g: torch.Generator, gd: torch.Generator) -> Case:
    B, K = 16, 4
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    drafts = torch.randint(0, V, (B, K), generator=g)
    logits[:, :K][torch.arange(B)[:, None], torch.arange(K), drafts] += 6
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    mask = torch.zeros(B, K + 1, V, dtype=torch.bool)
    mask[..., torch.randperm(V, generator=g)[:50]] = True
    mask[torch.arange(B)[:, None], torch.arange(K), drafts] = True
    params, rng = SP(1.0, top_p=0.9), ss.Philox(torch.arange(B))

    def textbook():
        probs = torch.softmax(logits.masked_fill(~mask, -torch.inf), -1)
        kept, order = probs.sort(-1, descending=True)
        kept[(kept.cumsum(-1) - kept) >= 0.9] = 0.0
        p = torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(-1, keepdim=True))
        return materialising_chain_verify(p, drafts, q, gd)

    return Case("verify_chain_from_logits", {"B": B, "K": K, "V": V, "method": "token", "top_p": 0.9,
                                             "mask": "50 tokens"}, [logits, q, mask],
                lambda: ss.verify_chain_from_logits(logits, drafts, params, draft_probs=q, method="token", rng=rng,
                                                    vocab_mask=mask),
                {"textbook": textbook})


def top_k_tree_cases(g: torch.Generator) -> list[Case]:
    B, N = 8, 16
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 10, 12]] * B)
    tree = ss.TokenTree.from_parents(parents)
    logits = torch.randn(B, N, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, N), generator=g)
    logits[torch.arange(B)[:, None], parents.clamp(min=0), tokens] += 7 - torch.arange(N) % 3  # drafts likely
    q = torch.softmax(torch.randn(B, N, V, generator=g) * 2, -1)
    params, rng = SP(1.0, top_k=50, top_p=0.9), ss.Philox(torch.arange(B))
    cases = []
    for method in ("rrs", "traversal"):
        def op(method=method):
            return ss.verify_tree_from_logits(logits, tokens, tree, params, draft_probs=q, method=method, rng=rng)

        def dense(op=op):
            with whole_rows():
                return op()

        cases.append(Case("verify_tree_from_logits", {"B": B, "N": N, "V": V, "method": method, "top_k": 50,
                                                      "top_p": 0.9}, [logits, q], op, {"whole rows": dense}))
    return cases


def wide_nucleus_case(g: torch.Generator, gd: torch.Generator) -> Case:
    logits = torch.randn(32, V, generator=g) * 2  # the 0.95 nucleus holds some 46,000 tokens
    params, rng = SP(1.0, top_p=0.95), ss.Philox(torch.arange(32))
    return Case("sample_from_logits", {"B": 32, "V": V, "top_p": 0.95, "nucleus": "tens of thousands"}, [logits],
                lambda: ss.sample_from_logits(logits, params, rng),
                {"sort_based": lambda: sort_sampler(logits, 1.0, 0, 0.95, gd)})


def greedy_cases(g: torch.Generator) -> list[Case]:
    one = torch.randn(1, V, generator=g)
    B, K = 32, 4
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = logits[:, :K].argmax(-1)
    drafts[::3, 2] = 0  # some chains stop early

    def textbook():
        target = logits.argmax(-1)
        n = (drafts == target[:, :K]).long().cumprod(-1).sum(-1)
        return n, target.gather(1, n[:, None])

    return [Case("sample_from_logits", {"B": 1, "V": V, "temperature": 0}, [one],
                 lambda: ss.sample_from_logits(one, SP(0.0), ss.Philox(0)), {"argmax": lambda: one.argmax(-1)}),
            Case("verify_chain_from_logits", {"B": B, "K": K, "V": V, "method": "greedy"}, [logits],
                 lambda: ss.verify_chain_from_logits(logits, drafts, SP(0.0), method="greedy"),
                 {"textbook": textbook})]


def flashinfer_case(g: torch.Generator, gd: torch.Generator) -> Case:
    from specsampler.compat import flashinfer

    logits = torch.randn(32, V, generator=g) * 3
    probs = torch.softmax(logits / 0.8, -1)
    gen = torch.Generator().manual_seed(2)
    return Case("flashinfer.top_p_sampling_from_probs", {"B": 32, "V": V, "top_p": 0.9}, [probs],
                lambda: flashinfer.sampling.top_p_sampling_from_probs(probs, 0.9, generator=gen),
                {"sort_based": lambda: sort_sampler(probs.log(), 1.0, 0, 0.9, gd)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g, gd = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    dev = torch.device("cpu")
    head = f"{'op':<38}{'shape':<58}{'median ms':>10}{'GB/s':>7}{'floor x':>9}  baselines (speedup)"
    print(device_name(dev) + "\n" + head + "\n" + "-" * (len(head) + 12))
    records = []
    cases = [mixed_case(g), masked_case(g, gd), flat_case(gd), masked_chain_case(g, gd), *top_k_tree_cases(g),
             wide_nucleus_case(g, gd), *greedy_cases(g), flashinfer_case(g, gd)]
    for case in cases:
        rec = measure(case, dev, args.reps, warmup=1)
        records.append(rec)
        shape = " ".join(f"{k}={v}" for k, v in rec["shape"].items())
        base = ", ".join(f"{k} {v}x" for k, v in rec["baselines"].items())
        print(f"{rec['op']:<38}{shape:<58}{rec['median_us'] / 1e3:>10.2f}{rec['gbps']:>7.1f}"
              f"{rec['floor_ratio']:>9.1f}  {base}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
