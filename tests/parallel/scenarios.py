"""What each rank of a spawned group runs: every parallel op on its shard of inputs that all ranks build from
one seed, compared with the one-device op on the whole rows. Each scenario returns the results (as lists) of
the parallel op, of the one-device op, and the collectives it sent; the test compares them across ranks."""

from __future__ import annotations

import torch

import specsampler as ss
from specsampler import parallel

V = 37  # shards: even (ceil(V / world) per rank, the last fewer) and the uneven ones of SPLITS


def splits(world: int) -> list[list[int]]:
    """Shard boundaries per layout: Megatron's even split, and an uneven one (with an empty shard at 4)."""
    uneven = {1: [0, V], 2: [0, 3, V], 3: [0, 20, 21, V], 4: [0, 9, 9, 30, V]}[world]
    return [[min(r * -(-V // world), V) for r in range(world)] + [V], uneven]


def _logits(g: torch.Generator, *lead: int) -> torch.Tensor:
    """Small integers (many ties, across shard boundaries too), with rows of NaN, +inf and all -inf."""
    x = torch.randint(-3, 4, (*lead, V), generator=g).float()
    flat = x.view(-1, V)
    flat[1, 20] = float("nan")
    flat[2, 5] = float("inf")
    flat[3] = float("-inf")
    flat[4, 36] = 9.0  # the last id
    flat[5, 0] = -0.0
    return x


def _mask(g: torch.Generator, *lead: int) -> torch.Tensor:
    m = torch.rand(*lead, V, generator=g) < 0.8
    m.view(-1, V)[6] = False  # a row without an allowed token
    return m


def _drafts(g: torch.Generator, best: torch.Tensor) -> torch.Tensor:
    """The argmax, changed at random places (and out of range at some): long accepted runs and rejections."""
    wrong = torch.randint(-1, V + 1, best.shape, generator=g)
    return torch.where(torch.rand(best.shape, generator=g) < 0.25, wrong, best)


def _cut(t: torch.Tensor, shard: parallel.VocabShard) -> torch.Tensor:
    return t[..., shard.start:shard.end].contiguous()


def _counted(op, *args, **kwargs):
    """``op(*args, **kwargs)`` and the collectives it called."""
    with parallel.count_collectives() as log:
        out = op(*args, **kwargs)
    return out, log.calls


def sample(shard, g):
    B = 8
    logits, mask = _logits(g, B), _mask(g, B)
    params = ss.SamplingParams(temperature=0.0)
    res, calls = _counted(parallel.sample_from_logits, _cut(logits, shard), params, None, _cut(mask, shard),
                          num_logprobs=3, shard=shard)
    ref = ss.sample_from_logits(logits, params, vocab_mask=mask, num_logprobs=3)
    return [[t.tolist() for t in res], [t.tolist() for t in ref], calls]


def chain(shard, g):
    B, K = 9, 4
    logits, mask = _logits(g, B, K + 1), _mask(g, B, K + 1)
    drafts = _drafts(g, logits.masked_fill(~mask, float("-inf")).argmax(-1)[:, :K])
    num = torch.randint(0, K + 1, (B,), generator=g)
    out = []
    for method, params in (("greedy", ss.SamplingParams(temperature=0.7, top_k=5)),
                           ("target_only", ss.SamplingParams(temperature=torch.zeros(B))),
                           ("auto", ss.SamplingParams(temperature=0.0))):
        res, calls = _counted(parallel.verify_chain_from_logits, _cut(logits, shard), drafts, params,
                              num_drafts=num, method=method, vocab_mask=_cut(mask, shard),
                              rng=ss.Philox(torch.arange(B)), shard=shard)
        ref = ss.verify_chain_from_logits(logits, drafts, params, num_drafts=num, method=method, vocab_mask=mask,
                                          rng=ss.Philox(torch.arange(B)))
        out.append([[res.tokens.tolist(), res.num_accepted.tolist(), res.expected_accepted.tolist()],
                    [ref.tokens.tolist(), ref.num_accepted.tolist(), ref.expected_accepted.tolist()], calls])
    return out


def tree(shard, g):
    B, N = 7, 9
    # random trees of mixed shapes: node i's parent among the nodes before it; request 2's last nodes absent
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)])
                           for _ in range(B)])
    parents[2, 6:] = -1
    tree_ = ss.TokenTree.from_parents(parents)
    logits, mask = _logits(g, B, N), _mask(g, B, N)
    best = logits.masked_fill(~mask, float("-inf")).argmax(-1)
    # a node's token is the argmax at its parent, changed at random places: long accepted paths and rejections
    drafts = _drafts(g, best.gather(1, parents.clamp(min=0)))
    out = []
    for method, params in (("greedy", None), ("target_only", ss.SamplingParams(temperature=0.0))):
        res, calls = _counted(parallel.verify_tree_from_logits, _cut(logits, shard), drafts, tree_, params,
                              method=method, vocab_mask=_cut(mask, shard), shard=shard)
        ref = ss.verify_tree_from_logits(logits, drafts, tree_, params, method=method, vocab_mask=mask)
        fields = ("path", "tokens", "num_accepted", "last_node")
        out.append([[getattr(res, f).tolist() for f in fields], [getattr(ref, f).tolist() for f in fields], calls])
    return out


def comms_independent_of_v(shard, g):
    """Rounds and bytes of each op at two vocabulary sizes (the shard's V and 64x it, split alike)."""
    out = []
    for scale in (1, 64):
        s = parallel.VocabShard(shard.start * scale, shard.size * scale, V * scale, shard.group)
        x = torch.randn(4, 3, s.size, generator=g)
        _, a = _counted(parallel.sample_from_logits, x[:, 0], ss.SamplingParams(temperature=0.0), shard=s)
        _, b = _counted(parallel.verify_chain_from_logits, x, torch.zeros(4, 2, dtype=torch.long), method="greedy",
                        shard=s)
        t = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * 4))
        _, c = _counted(parallel.verify_tree_from_logits, x, torch.zeros(4, 3, dtype=torch.long), t,
                        method="greedy", shard=s)
        out.append([a, b, c])
    return out


def errors(shard, g):
    """Mistakes raise on every rank, none waits for the others: a bad value on one rank only, with
    validate='full'; a torch.Generator; sampled rows (not built yet)."""
    x = torch.zeros(2, shard.size)
    if shard.start == 0:
        x[1, 0] = float("nan")
    caught = []
    for call in (lambda: parallel.sample_from_logits(x, ss.SamplingParams(temperature=0.0), shard=shard,
                                                     validate="full"),
                 lambda: parallel.sample_from_logits(x, ss.SamplingParams(temperature=0.0), torch.Generator(),
                                                     shard=shard),
                 lambda: parallel.sample_from_logits(x, ss.SamplingParams(temperature=1.0), shard=shard)):
        try:
            call()
            caught.append(None)
        except (ValueError, NotImplementedError) as e:
            caught.append(type(e).__name__)
    return caught


SCENARIOS = {"sample": sample, "chain": chain, "tree": tree, "comms": comms_independent_of_v, "errors": errors}
