"""What each rank of a spawned group runs: every parallel op on its shard of inputs that all ranks build from
one seed, compared with the one-device op on the whole rows. Each scenario returns the results (as lists) of
the parallel op, of the one-device op, and the collectives it sent; the test compares them across ranks."""

from __future__ import annotations

import os

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


def _params(g: torch.Generator, B: int) -> ss.SamplingParams:
    """Per-request parameters mixing greedy, top-k, top-p, both, min-p (alone and with top-p) and none."""
    kind = torch.arange(B) % 7
    temperature = torch.where(kind == 0, 0.0, torch.empty(B).uniform_(0.5, 1.5, generator=g))
    top_k = torch.where((kind == 1) | (kind == 3), torch.randint(1, 7, (B,), generator=g), 0)
    top_p = torch.where((kind == 2) | (kind == 3) | (kind == 6), torch.empty(B).uniform_(0.3, 0.95, generator=g),
                        1.0)
    min_p = torch.where((kind == 4) | (kind == 6), torch.empty(B).uniform_(0.0, 0.3, generator=g), 0.0)
    return ss.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _sampled_logits(g: torch.Generator, *lead: int) -> torch.Tensor:
    """Continuous logits (distinct weights) in some rows, small integers (ties at every cut) in others, and the
    rows of :func:`_logits` without mass or with NaN."""
    x = torch.randn(*lead, V, generator=g) * 2
    ties = torch.rand(lead, generator=g) < 0.4
    x = torch.where(ties[..., None], torch.randint(-3, 4, (*lead, V), generator=g).float(), x)
    flat = x.view(-1, V)
    flat[1, 20] = float("nan")
    flat[3] = float("-inf")
    flat[4, 36] = 9.0
    return x


def _philox(g: torch.Generator, B: int) -> ss.Philox:
    return ss.Philox(torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 2**40, (B,), generator=g))


def sampled(shard, g):
    """Sampling with mixed parameters and masks, top-3 log-probabilities, several streams."""
    out = []
    for _ in range(4):
        B = 14
        logits, mask, params, rng = _sampled_logits(g, B), _mask(g, B), _params(g, B), _philox(g, B)
        res, calls = _counted(parallel.sample_from_logits, _cut(logits, shard), params, rng, _cut(mask, shard),
                              num_logprobs=3, shard=shard)
        ref = ss.sample_from_logits(logits, params, rng, vocab_mask=mask, num_logprobs=3)
        out.append([[t.tolist() for t in res], [t.tolist() for t in ref], calls])
    return out


def _draft_probs(g: torch.Generator, *lead: int) -> torch.Tensor:
    q = torch.softmax(torch.randn(*lead, V, generator=g) * 2, -1)
    return q * (torch.rand(*lead, V, generator=g) < 0.8)  # some zeros (truncated drafts), unnormalised rows


def sampled_chain(shard, g):
    """Every chain method with mixed parameters, masks per position and ragged drafts."""
    out = []
    for _ in range(2):
        B, K = 10, 4
        logits, mask, params, rng = _sampled_logits(g, B, K + 1), _mask(g, B, K + 1), _params(g, B), _philox(g, B)
        q = _draft_probs(g, B, K)
        drafts = torch.multinomial(q.view(-1, V) + 1e-9, 1, generator=g).view(B, K)
        drafts[0, 1] = V + 2  # out of range: never accepted
        num = torch.randint(0, K + 1, (B,), generator=g)
        for method in ("token", "block", "target_only", "greedy"):
            dp = q if method in ("token", "block") else None
            res, calls = _counted(parallel.verify_chain_from_logits, _cut(logits, shard), drafts, params,
                                  draft_probs=None if dp is None else _cut(dp, shard), num_drafts=num, method=method,
                                  rng=rng, vocab_mask=_cut(mask, shard), shard=shard)
            ref = ss.verify_chain_from_logits(logits, drafts, params, draft_probs=dp, num_drafts=num, method=method,
                                              rng=rng, vocab_mask=mask)
            fields = ("tokens", "num_accepted", "expected_accepted")
            out.append([method, [getattr(res, f).tolist() for f in fields], [getattr(ref, f).tolist() for f in fields],
                        calls])
    return out


def sampled_tree(shard, g):
    """rrs and traversal (iid, without replacement), target_only and greedy on trees of mixed shapes."""
    out = []
    B, N = 8, 8
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)])
                           for _ in range(B)])
    parents[2, 5:] = -1
    tree_ = ss.TokenTree.from_parents(parents)
    logits, mask, params, rng = _sampled_logits(g, B, N), _mask(g, B, N), _params(g, B), _philox(g, B)
    q = _draft_probs(g, B, N)
    drafts = torch.multinomial(q.view(-1, V) + 1e-9, 1, generator=g).view(B, N)
    for method, sampling in (("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid"),
                             ("traversal", "without_replacement"), ("target_only", "iid"), ("greedy", "iid")):
        dp = q if method in ("rrs", "traversal") else None
        res, calls = _counted(parallel.verify_tree_from_logits, _cut(logits, shard), drafts, tree_, params,
                              draft_probs=None if dp is None else _cut(dp, shard), method=method,
                              draft_sampling=sampling, rng=rng, vocab_mask=_cut(mask, shard), shard=shard)
        ref = ss.verify_tree_from_logits(logits, drafts, tree_, params, draft_probs=dp, method=method,
                                         draft_sampling=sampling, rng=rng, vocab_mask=mask)
        fields = ("path", "tokens", "num_accepted", "last_node")
        out.append([f"{method}/{sampling}", [getattr(res, f).tolist() for f in fields],
                    [getattr(ref, f).tolist() for f in fields], calls])
    return out


def comms_independent_of_v(shard, g):
    """Rounds and bytes of each op at two vocabulary sizes (the shard's V and 64x it, split alike), on inputs
    whose decisions are the same at both: one token (id 0) far above the others, drafted and accepted."""
    out = []
    for scale in (1, 64):
        s = parallel.VocabShard(shard.start * scale, shard.size * scale, V * scale, shard.group)

        def one_hot(*lead, value, s=s):
            t = torch.zeros(*lead, s.size)
            if s.start == 0 and s.size:
                t[..., 0] = value
            return t

        x, q = one_hot(4, 3, value=30.0), one_hot(4, 2, value=1.0)
        rng = ss.Philox(torch.arange(4))
        tree_ = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * 4))
        drafts = torch.zeros(4, 3, dtype=torch.long)
        ops = []
        for params in (ss.SamplingParams(temperature=0.0), ss.SamplingParams(top_p=0.9),
                       ss.SamplingParams(top_k=3, top_p=0.9), ss.SamplingParams(min_p=0.2), ss.SamplingParams()):
            ops.append(_counted(parallel.sample_from_logits, x[:, 0], params, rng, num_logprobs=2, shard=s))
            for method in ("token", "block", "target_only"):
                dp = q if method != "target_only" else None
                ops.append(_counted(parallel.verify_chain_from_logits, x, drafts[:, :2], params, draft_probs=dp,
                                    method=method, rng=rng, shard=s))
            for method in ("rrs", "traversal", "target_only"):
                dp = one_hot(4, 3, value=1.0) if method != "target_only" else None
                ops.append(_counted(parallel.verify_tree_from_logits, x, drafts, tree_, params, draft_probs=dp,
                                    method=method, rng=rng, shard=s))
        out.append([[res_calls[1] for res_calls in ops], [_outcome(r) for r, _ in ops]])
    return out


def _outcome(res) -> list:
    """An op's tokens (and accepted counts) as lists."""
    return [res.tokens.tolist(), res.num_accepted.tolist()] if hasattr(res, "num_accepted") else res.tokens.tolist()


def exactness(shard, g):
    """Monte Carlo of the parallel chain and tree verification against the exact oracle (world 2 only: the
    decisions are those of every world size, which the scenarios above compare token for token)."""
    import torch.distributed as dist

    return monte_carlo() if dist.get_world_size() == 2 else None


def monte_carlo() -> dict:
    """The emitted sequences' chi-square p-values (and the continued ones', for chains), and the count of
    outcomes of probability 0, per method, on the default group's even split of a vocabulary of 5."""
    from specsampler.verify import exactness as ex
    from specsampler.verify import oracle

    Vs = 5
    s = parallel.VocabShard.even(Vs)
    trials = 100_000 if os.environ.get("SPECSAMPLER_FULL_MC") == "1" else 3000  # the suite's full-size switch
    out = {}
    target, draft = ex.random_model(Vs, 3, zeros=True), ex.random_model(Vs, 1003, zeros=True)
    gen = torch.Generator().manual_seed(3)
    K = 2
    P, Q = ex.Table(target, Vs, K + 1), ex.Table(draft, Vs, K)
    p, x, q = ex.chain_inputs(P, Q, K, trials, True, gen)
    logits = p.log()  # temperature 1: the processed target is p again (zeros masked by -inf)
    joint = oracle.target_joint(target, K + 1)
    for method in ("token", "block"):
        res = parallel.verify_chain_from_logits(logits[..., s.start:s.end].contiguous(), x, draft_probs=
                                                q[..., s.start:s.end].contiguous(), method=method,
                                                rng=ss.Philox(torch.arange(trials)), shard=s)
        exact = oracle.chain(target, draft, K, method, Vs)
        p_emitted, impossible = ex.chi_square(ex.encode(res.tokens, Vs), ex.encode_dist(exact.sequences, K + 1, Vs))
        p_joint, more = ex.chi_square(ex.encode(ex.continue_with(P, res.tokens, gen), Vs),
                                      ex.encode_dist(joint, K + 1, Vs))
        out[f"chain/{method}"] = [p_emitted, p_joint, impossible + more]
    shape = (2, 2)
    D = len(shape)
    P = ex.Table(target, Vs, D)
    for method, sampling in (("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid"),
                             ("traversal", "without_replacement")):
        drafter = draft if sampling == "iid" else ex.random_model(Vs, 1003)  # as many tokens as children
        Q = ex.Table(drafter, Vs, D - 1)
        p, x, q, tree_ = ex.tree_inputs(P, Q, shape, trials, sampling, gen)
        res = parallel.verify_tree_from_logits(p.log()[..., s.start:s.end].contiguous(), x, tree_,
                                               draft_probs=q[..., s.start:s.end].contiguous(), method=method,
                                               draft_sampling=sampling, rng=ss.Philox(torch.arange(trials) + 7),
                                               shard=s)
        exact = oracle.tree(target, drafter, shape, method, Vs, draft_sampling=sampling)
        p_emitted, impossible = ex.chi_square(ex.encode(res.tokens, Vs), ex.encode_dist(exact.sequences, D + 1, Vs))
        out[f"tree/{method}/{sampling}"] = [p_emitted, impossible]
    return out


def errors(shard, g):
    """Mistakes raise on every rank, none waits for the others: a bad value on one rank only, with
    validate='full'; a torch.Generator; sampled rows without a Philox (each rank would draw its own numbers)."""
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
        except ValueError as e:
            caught.append(type(e).__name__)
    return caught


SCENARIOS = {"sample": sample, "chain": chain, "tree": tree, "sampled": sampled, "sampled_chain": sampled_chain,
             "sampled_tree": sampled_tree, "comms": comms_independent_of_v, "errors": errors, "exactness": exactness}
