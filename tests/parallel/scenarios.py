"""What each rank of a spawned group runs: every parallel op on its shard of inputs that all ranks build from
one seed, compared with the one-device op on the whole rows. Each scenario returns the results (as lists) of
the parallel op, of the one-device op, and the collectives it sent; the test compares them across ranks.
The ops run with ``strategy="shard"`` unless a scenario is about the strategies."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import specsampler as ss
from specsampler import parallel
from specsampler.parallel import cost, walks

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


@contextlib.contextmanager
def _held_width(width: int, by_link: bool = False):
    """Chain and tree verification gather rows of at most ``width`` nonzero probabilities a rank (-1: never, the
    walks on the shards' columns, top-k rows' shared q's masses a round each, and the plans so; at V = 37 every row is
    narrower than walks.HELD_WIDTH). ``by_link``: ``width`` stands for walks.HELD_WIDTH, and wider rows are gathered
    where the call's link makes that the cheaper (walks.gathered_width)."""
    old = walks.gathered_width, walks.HELD_WIDTH, cost._cheaper, cost.columns_cheaper
    if by_link:
        walks.HELD_WIDTH = width
    else:
        walks.gathered_width = lambda *args: width
    if width < 0:  # the shared q's masses a round each, and the plans: the walk's rounds, never the entries' round
        cost._cheaper = lambda link, world, walk, entries: walk
        cost.columns_cheaper = lambda *args: False
    try:
        yield
    finally:
        walks.gathered_width, walks.HELD_WIDTH, cost._cheaper, cost.columns_cheaper = old


def _counted(op, *args, **kwargs):
    """``op(*args, **kwargs)`` (the shard strategy unless the call names one) and the collectives it called."""
    kwargs.setdefault("strategy", "shard")
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


def _top_k_params(g: torch.Generator, B: int) -> ss.SamplingParams:
    """Every row a top-k row (with top-p in some) or greedy: rows every rank holds whole after the processing."""
    kind = torch.arange(B) % 3
    temperature = torch.where(kind == 0, 0.0, torch.empty(B).uniform_(0.5, 1.5, generator=g))
    top_p = torch.where(kind == 2, torch.empty(B).uniform_(0.3, 0.95, generator=g), 1.0)
    return ss.SamplingParams(temperature=temperature, top_k=torch.randint(1, 7, (B,), generator=g), top_p=top_p)


def sampled_chain(shard, g):
    """Every chain method with mixed parameters (then top-k and greedy rows only), masks per position and ragged
    drafts (NaN in the draft rows past them)."""
    out = []
    for params_of in (_params, _params, _top_k_params):
        B, K = 10, 4
        logits, mask, params, rng = _sampled_logits(g, B, K + 1), _mask(g, B, K + 1), params_of(g, B), _philox(g, B)
        q = _draft_probs(g, B, K)
        drafts = torch.multinomial(q.view(-1, V) + 1e-9, 1, generator=g).view(B, K)
        drafts[0, 1] = V + 2  # out of range: never accepted
        num = torch.randint(0, K + 1, (B,), generator=g)
        q[torch.arange(K) >= num[:, None]] = float("nan")  # rows past a request's drafts: padding, never read
        runs = [(m, walks.HELD_WIDTH) for m in ("token", "block", "target_only", "greedy")]
        runs += [(m, -1) for m in ("token", "block")]  # every row here is narrow: also on the shards' columns
        for method, width in runs:
            dp = q if method in ("token", "block") else None
            with _held_width(width):
                res, calls = _counted(parallel.verify_chain_from_logits, _cut(logits, shard), drafts, params,
                                      draft_probs=None if dp is None else _cut(dp, shard), num_drafts=num,
                                      method=method, rng=rng, vocab_mask=_cut(mask, shard), shard=shard)
            ref = ss.verify_chain_from_logits(logits, drafts, params, draft_probs=dp, num_drafts=num, method=method,
                                              rng=rng, vocab_mask=mask)
            fields = ("tokens", "num_accepted", "expected_accepted")
            out.append([f"{method} held width {width}", [getattr(res, f).tolist() for f in fields],
                        [getattr(ref, f).tolist() for f in fields], calls])
    return out


def sampled_tree(shard, g):
    """rrs and traversal (iid, without replacement), target_only and greedy on trees of mixed shapes, with mixed
    parameters, then top-k and greedy rows only."""
    out = []
    B, N = 8, 8
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)])
                           for _ in range(B)])
    parents[2, 5:] = -1
    tree_ = ss.TokenTree.from_parents(parents)
    logits, mask, params, rng = _sampled_logits(g, B, N), _mask(g, B, N), _params(g, B), _philox(g, B)
    q = _draft_probs(g, B, N)
    drafts = torch.multinomial(q.view(-1, V) + 1e-9, 1, generator=g).view(B, N)
    runs = [(m, s, params) for m, s in (("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid"),
                                        ("traversal", "without_replacement"), ("target_only", "iid"),
                                        ("greedy", "iid"))]
    top_k = _top_k_params(g, B)
    runs += [(m, "iid", top_k) for m in ("rrs", "traversal")]
    for width in (walks.HELD_WIDTH, -1):  # the rows gathered whole (every row here is narrow), and on the shards
        for method, sampling, params in runs:
            dp = q if method in ("rrs", "traversal") else None
            with _held_width(width):
                res, calls = _counted(parallel.verify_tree_from_logits, _cut(logits, shard), drafts, tree_, params,
                                      draft_probs=None if dp is None else _cut(dp, shard), method=method,
                                      draft_sampling=sampling, rng=rng, vocab_mask=_cut(mask, shard), shard=shard)
            ref = ss.verify_tree_from_logits(logits, drafts, tree_, params, draft_probs=dp, method=method,
                                             draft_sampling=sampling, rng=rng, vocab_mask=mask)
            fields = ("path", "tokens", "num_accepted", "last_node")
            out.append([f"{method}/{sampling} held width {width}", [getattr(res, f).tolist() for f in fields],
                        [getattr(ref, f).tolist() for f in fields], calls])
    return out


def comms_independent_of_v(shard, g):
    """Rounds and bytes of each op at two vocabulary sizes (the shard's V and 64x it, split alike), on inputs
    whose decisions are the same at both: one token (id 0) far above the others, drafted and accepted."""
    out = []
    for scale, rest in ((1, 0.0), (64, 0.0), (1, float("-inf")), (64, float("-inf"))):
        s = parallel.VocabShard(shard.start * scale, shard.size * scale, V * scale, shard.group)

        def one_hot(*lead, value, s=s, rest=rest):
            t = torch.full((*lead, s.size), rest if value == 30.0 else 0.0)
            if s.start == 0 and s.size:
                t[..., 0] = value
            return t

        x, q = one_hot(4, 3, value=30.0), one_hot(4, 2, value=1.0)
        rng = ss.Philox(torch.arange(4))
        tree_ = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0]] * 4))
        drafts = torch.zeros(4, 3, dtype=torch.long)
        ops = []
        # rows of zeros (every token weighs something: more than HELD_WIDTH a rank at 64x) verify on the shards' columns
        with _held_width(-1 if rest == 0.0 else walks.HELD_WIDTH):
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
    for method, width in ((m, w) for m in ("token", "block") for w in (-1, walks.HELD_WIDTH)):
        with _held_width(width):  # the residuals on the shards' columns, and over the rows held whole
            res = parallel.verify_chain_from_logits(logits[..., s.start:s.end].contiguous(), x, draft_probs=
                                                    q[..., s.start:s.end].contiguous(), method=method,
                                                    rng=ss.Philox(torch.arange(trials)), shard=s, strategy="shard")
        exact = oracle.chain(target, draft, K, method, Vs)
        p_emitted, impossible = ex.chi_square(ex.encode(res.tokens, Vs), ex.encode_dist(exact.sequences, K + 1, Vs))
        p_joint, more = ex.chi_square(ex.encode(ex.continue_with(P, res.tokens, gen), Vs),
                                      ex.encode_dist(joint, K + 1, Vs))
        out[f"chain/{method}/held width {width}"] = [p_emitted, p_joint, impossible + more]
    shape = (2, 2)
    D = len(shape)
    P = ex.Table(target, Vs, D)
    for method, sampling, width in ((m, d, w) for m in ("rrs", "traversal") for d in ("iid", "without_replacement")
                                    for w in (-1, walks.HELD_WIDTH)):
        drafter = draft if sampling == "iid" else ex.random_model(Vs, 1003)  # as many tokens as children
        Q = ex.Table(drafter, Vs, D - 1)
        p, x, q, tree_ = ex.tree_inputs(P, Q, shape, trials, sampling, gen)
        with _held_width(width):  # the walks on the shards' columns, and over the rows held whole
            res = parallel.verify_tree_from_logits(p.log()[..., s.start:s.end].contiguous(), x, tree_,
                                                   draft_probs=q[..., s.start:s.end].contiguous(), method=method,
                                                   draft_sampling=sampling, rng=ss.Philox(torch.arange(trials) + 7),
                                                   shard=s, strategy="shard")
        exact = oracle.tree(target, drafter, shape, method, Vs, draft_sampling=sampling)
        p_emitted, impossible = ex.chi_square(ex.encode(res.tokens, Vs), ex.encode_dist(exact.sequences, D + 1, Vs))
        out[f"tree/{method}/{sampling}/held width {width}"] = [p_emitted, impossible]
    return out


def errors(shard, g):
    """Mistakes raise on every rank, none waits for the others, with either strategy; each error names its argument
    (the message's second field): a bad value on one rank only, with validate='full' (every rank gets that rank's
    message); a torch.Generator; sampled rows without a Philox (each rank would draw its own numbers); shards that
    do not tile the vocabulary (every rank holding its first half); seeds that differ between ranks."""
    x = torch.zeros(2, shard.size)
    if shard.start == 0:
        x[1, 0] = float("nan")
    half = parallel.VocabShard(0, V // 2, V)
    sampled = ss.SamplingParams(temperature=1.0)
    caught = []
    for strategy in ("shard", "gather"):
        for rows, args, kwargs in ((x, (ss.SamplingParams(temperature=0.0),), dict(validate="full")),
                                   (x, (ss.SamplingParams(temperature=0.0), torch.Generator()), {}),
                                   (x, (sampled,), {}),
                                   (torch.zeros(2, V // 2), (sampled, ss.Philox(0)), dict(shard=half)),
                                   (x, (sampled, ss.Philox(dist.get_rank())), {})):
            try:
                parallel.sample_from_logits(rows, *args, **{"shard": shard, "strategy": strategy, **kwargs})
                caught.append(None)
            except ValueError as e:
                caught.append(f"{type(e).__name__} naming {str(e).split(': ')[1]}"
                              + (" (on rank 0)" if "(on rank 0, which holds ids [0, " in str(e) else ""))
    return caught


KINDS = {"temperature": dict(temperature=0.8), "min-p": dict(min_p=0.2), "top-k": dict(top_k=5),
         "top-k, top-p": dict(top_k=5, top_p=0.8), "top-p": dict(top_p=0.8), "top-p, min-p": dict(top_p=0.9, min_p=0.1),
         "mixed": None}  # None: _params' mix of every kind, greedy rows included
BINARY = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4]  # depth 3, at most two children a node
WIDE = [-1, 0, 0, 0, 0, 1, 1, 1, 5, 5]  # four children of the root, three of node 1


def rounds(shard, g):
    """Every op and method (shard strategy) for each kind of row: the collectives it sent, the bytes per round the
    cost model plans for it, what bounds its rounds (the top-p rows, a token verification's rejections, the tree),
    and whether it equals the one-device op."""
    B, K = 6, 4
    out = []
    x, mask, q = _sampled_logits(g, B, K + 1), _mask(g, B, K + 1), _draft_probs(g, B, K)
    drafts = torch.multinomial(q.view(-1, V) + 1e-9, 1, generator=g).view(B, K)
    rng = _philox(g, B)
    for kind, fields in KINDS.items():
        params = _params(g, B) if fields is None else ss.SamplingParams(**fields)
        top_p = bool(((params.rows("", B, 1, x.device, False).top_p < 1) & ~(
            (params.rows("", B, 1, x.device, False).top_k > 0))).any())
        rp = params.rows("", B, 1, x.device, False)
        res, calls = _counted(parallel.sample_from_logits, _cut(x[:, 0], shard), params, rng, num_logprobs=2,
                              shard=shard)
        ref = ss.sample_from_logits(x[:, 0], params, rng, num_logprobs=2)
        plan = cost.sample_plan(rp, False, 2, _cut(x[:, 0], shard), None, shard)[0]
        out.append(["sample", kind, top_p, {}, calls, plan, [t.tolist() for t in res] == [t.tolist() for t in ref]])
        rp = params.rows("", B, K + 1, x.device, False)
        for method in ("token", "block", "target_only"):
            dp = q if method != "target_only" else None
            with _held_width(-1):  # the residuals on the shards' columns (the most rounds); held rows: nuclei()
                res, calls = _counted(parallel.verify_chain_from_logits, _cut(x, shard), drafts, params,
                                      draft_probs=None if dp is None else _cut(dp, shard), method=method, rng=rng,
                                      vocab_mask=_cut(mask, shard), shard=shard)
                plan = cost.chain_plan(method, False, rp, _cut(x, shard), None if dp is None else _cut(dp, shard),
                                       _cut(mask, shard), shard, cost.link_of(None, shard))[0]
            ref = ss.verify_chain_from_logits(x, drafts, params, draft_probs=dp, method=method, rng=rng,
                                              vocab_mask=mask)
            info = {"rejected": bool((res.num_accepted < K).any())}
            out.append([f"chain {method}", kind, top_p, info, calls, plan, _outcome(res) == _outcome(ref)])
        for shape in (BINARY, WIDE):
            tree_ = ss.TokenTree.from_parents(torch.tensor([shape] * B))
            N = len(shape)
            xt, qt = torch.randn(B, N, V, generator=g) * 2, _draft_probs(g, B, N)
            dt = torch.multinomial(qt.view(-1, V) + 1e-9, 1, generator=g).view(B, N)
            rp = params.rows("", B, N, x.device, False)
            for method, sampling in (("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid"),
                                     ("traversal", "without_replacement"), ("target_only", "iid")):
                dp = qt if method != "target_only" else None
                with _held_width(-1):  # the walks over the shards' columns (the most rounds); held rows: nuclei()
                    res, calls = _counted(parallel.verify_tree_from_logits, _cut(xt, shard), dt, tree_, params,
                                          draft_probs=None if dp is None else _cut(dp, shard), method=method,
                                          draft_sampling=sampling, rng=rng, shard=shard)
                    plan = cost.tree_plan(method, sampling, False, rp, tree_, _cut(xt, shard),
                                          None if dp is None else _cut(dp, shard), None, shard,
                                          cost.link_of(None, shard))[0]
                ref = ss.verify_tree_from_logits(xt, dt, tree_, params, draft_probs=dp, method=method,
                                                 draft_sampling=sampling, rng=rng)
                info = {"shape": shape, "depth": tree_.max_depth, "children": tree_.max_children}
                same = _outcome(res) == _outcome(ref) and res.path.tolist() == ref.path.tolist()
                out.append([f"tree {method}/{sampling}", kind, top_p, info, calls, plan, same])
    return out


def settled(shard, g):
    """Trees whose drafts come from the target's own distributions (each child's q its parent's processed row), so
    that every first child is accepted: rrs and traversal on wide trees (and on roots alone, where no node has a
    child), their collectives and whether they equal the one-device op."""
    B = 5
    out = []
    for shape in ([-1] + [0] * 8, [-1, 0, 0, 0, 0, 1, 1, 1, 1], [-1]):  # eight children of the root; four of two
        tree_ = ss.TokenTree.from_parents(torch.tensor([shape] * B))
        N = len(shape)
        x = torch.randn(B, N, V, generator=g) * 2
        for kind in ("top-k", "temperature", "top-p"):
            params = ss.SamplingParams(**KINDS[kind])
            p = ss.logits_to_probs(x, params)
            q = p[:, torch.tensor(shape).clamp(min=0)]  # node i drafted from its parent's row
            drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, N)
            rng = _philox(g, B)
            for method, sampling in TREE_WALKS:  # the walks over the shards' columns, whose residual rounds end early
                same, calls, accepted = _tree_walk(shard, x, drafts, tree_, params, q, method, sampling, rng, -1)
                out.append([f"{method}/{sampling} {shape}", kind, same, len(calls), accepted])
    return out


TREE_WALKS = tuple((m, d) for m in ("rrs", "traversal") for d in ("iid", "without_replacement"))


def _tree_walk(shard, x, drafts, tree_, params, q, method: str, sampling: str, rng, width: int,
               link: parallel.Link | None = None) -> tuple:
    """verify_tree_from_logits on the shards (rows of at most ``width`` nonzero probabilities a rank gathered, and
    with a ``link`` wider ones where it makes that cheaper: :func:`_held_width`) against the one-device op: whether
    they agree, the collectives, the accepted counts."""
    with _held_width(width, by_link=link is not None):
        res, calls = _counted(parallel.verify_tree_from_logits, _cut(x, shard), drafts, tree_, params,
                              draft_probs=_cut(q, shard), method=method, draft_sampling=sampling, rng=rng, shard=shard,
                              link=link)
    ref = ss.verify_tree_from_logits(x, drafts, tree_, params, draft_probs=q, method=method, draft_sampling=sampling,
                                     rng=rng)
    return _outcome(res) == _outcome(ref) and res.path.tolist() == ref.path.tolist(), calls, res.num_accepted.tolist()


_OUTSIDE = 7  # an id the compact scenarios keep out of every row's candidates


def compact(shard, g):
    """Top-k rows and i.i.d. drafts (the walk on each rank alone, after one round that reads every child's q at its
    parent's candidates) on wide and deep trees, and chains (token, block), with draft probabilities that are valid,
    and with one below 0 or NaN outside the candidates (which gives a residual mass there: the walk keeps its
    rounds): whether each equals the one-device op, and its collectives."""
    B = 6
    out = []
    for shape in (WIDE, BINARY, [-1] + [0] * 8):
        tree_ = ss.TokenTree.from_parents(torch.tensor([shape] * B))
        N = len(shape)
        x = torch.randn(B, N, V, generator=g) * 2
        x[..., _OUTSIDE] = -20.0  # never a candidate
        q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
        drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, N)
        for bad in (None, -0.5, float("nan")):
            qb = q.clone()
            if bad is not None:
                qb[:, 1:, _OUTSIDE] = bad
            for kind in ("top-k", "top-k, top-p"):
                params = ss.SamplingParams(**KINDS[kind])
                rng = _philox(g, B)
                for method in ("rrs", "traversal"):
                    res, calls = _counted(parallel.verify_tree_from_logits, _cut(x, shard), drafts, tree_, params,
                                          draft_probs=_cut(qb, shard), method=method, rng=rng, shard=shard)
                    ref = ss.verify_tree_from_logits(x, drafts, tree_, params, draft_probs=qb, method=method, rng=rng)
                    same = _outcome(res) == _outcome(ref) and res.path.tolist() == ref.path.tolist()
                    out.append([f"{method} {shape} q {bad}", kind, same, len(calls)])
    K = 4
    x = torch.randn(B, K + 1, V, generator=g) * 2
    x[..., _OUTSIDE] = -20.0
    for accepted in (False, True):  # drafts from q, mostly rejected; drafts from the target's own rows, all accepted
        q = ss.logits_to_probs(x[:, :K], ss.SamplingParams(top_k=4)) if accepted else torch.softmax(
            torch.randn(B, K, V, generator=g), -1)
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
        for bad in (None, -0.5, float("nan")):
            qb = q.clone()
            if bad is not None:
                qb[:, :, _OUTSIDE] = bad
            for method in ("token", "block"):
                params = ss.SamplingParams(top_k=4)
                rng = _philox(g, B)
                res, calls = _counted(parallel.verify_chain_from_logits, _cut(x, shard), drafts, params,
                                      draft_probs=_cut(qb, shard), method=method, rng=rng, shard=shard)
                ref = ss.verify_chain_from_logits(x, drafts, params, draft_probs=qb, method=method, rng=rng)
                name = f"chain {method} {'accepted' if accepted else 'rejected'} q {bad}"
                out.append([name, "top-k", _outcome(res) == _outcome(ref), len(calls)])
    return out


GATHERED_BY_LINK = "wider, on a latency-bound link"  # rows wider than the width gathered: the link says so
MASSES_A_ROUND = "held, on a bandwidth-bound link"  # without replacement the shared q's masses a round each


NARROW_KINDS = ("top-p", "min-p", "top-p, min-p", "temperature", "mixed")


def _narrow_cases(g: torch.Generator, B: int, q: torch.Tensor, drafted: slice, kinds=NARROW_KINDS):
    """For each kind of row (of ``kinds``) and case of :func:`nuclei`: ``(kind, params, case, width, link, q, rng)``,
    the draft rows ``q[:, drafted]`` given a value below 0 or NaN at _OUTSIDE in those cases; "wider": every row wider
    than the width (0), gathered only where a link makes that cheaper (:func:`_held_width`)."""
    for kind in kinds:
        params = _params(g, B) if KINDS[kind] is None else ss.SamplingParams(**KINDS[kind])
        for case, width, link, bad in (("held", walks.HELD_WIDTH, None, None), (MASSES_A_ROUND, walks.HELD_WIDTH,
                                                                                 parallel.Link(0.0, 1.0), None),
                                       ("q below 0", walks.HELD_WIDTH, None, -0.5),
                                       ("q NaN", walks.HELD_WIDTH, None, float("nan")), ("wider", 0, None, None),
                                       (GATHERED_BY_LINK, 0, parallel.Link(1.0, 0.0), None),
                                       ("wider, on a bandwidth-bound link", 0, parallel.Link(0.0, 1.0), None)):
            qb = q if bad is None else q.clone()
            if bad is not None:
                qb[:, drafted, _OUTSIDE] = bad
            yield kind, params, case, width, link, qb, _philox(g, B)


def nuclei(shard, g):
    """Rows of few nonzero probabilities a rank (peaked top-p, min-p, both, temperature over V = 37, the mixed
    parameters) with i.i.d. drafts from other distributions (rejections), on a root of eight children and wider and
    deeper trees, and chains: rrs and traversal (i.i.d. and without replacement), token and block with the rows
    gathered whole in one round after the processing; with a draft probability below 0 or NaN somewhere (the shard
    path); with rows wider than the width gathered (here: a width of 0, and on a latency-only link, which
    gathers them, and a bandwidth-only one, which does not). Whether each equals the one-device op, its
    collectives, accepted counts and the rounds it may take past the processing and one: without replacement, on a
    bandwidth-only link, the shared q's masses past the processing's two rounds, one a round (elsewhere its rows are
    gathered whole beside the rows). At the suite's size each kind of row meets one of the three trees (the root of
    eight children: top-p and temperature rows), every kind at full size (``SPECSAMPLER_FULL_MC=1``)."""
    B = 6
    out = []
    full = os.environ.get("SPECSAMPLER_FULL_MC") == "1"  # the suite's full-size switch
    for s, shape in enumerate(([-1] + [0] * 8, WIDE, BINARY)):
        kinds = NARROW_KINDS if full else NARROW_KINDS[s::3]
        tree_ = ss.TokenTree.from_parents(torch.tensor([shape] * B))
        N = len(shape)
        x = torch.randn(B, N, V, generator=g) * 4  # peaked: nuclei of a few tokens
        # each child drafted a quarter from its parent's target row, the rest at random: acceptances and rejections
        parent = torch.tensor(shape).clamp(min=0)
        q = (torch.softmax(x[:, parent], -1) + 3 * torch.softmax(torch.randn(B, N, V, generator=g), -1)) / 4
        drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, N)
        widest = max(shape.count(i) for i in range(N))
        for kind, params, case, width, link, qb, rng in _narrow_cases(g, B, q, slice(1, None), kinds):
            for method, sampling in TREE_WALKS:
                same, calls, accepted = _tree_walk(shard, x, drafts, tree_, params, qb, method, sampling, rng, width,
                                                   link)
                # without replacement, held: the shared q's masses past the processing's a round each, unless the
                # link makes its rows whole cheaper (here: on the default link, as V = 37 is short)
                extra = max(widest - 3, 0) if sampling == "without_replacement" and case == MASSES_A_ROUND else 0
                out.append([f"{method}/{sampling} {shape} {case}", kind, same, len(calls), accepted, extra])
    K = 4
    x = torch.randn(B, K + 1, V, generator=g) * 4
    q = (torch.softmax(x[:, :K], -1) + torch.softmax(torch.randn(B, K, V, generator=g), -1)) / 2
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    for kind, params, case, width, link, qb, rng in _narrow_cases(g, B, q, slice(None)):
        for method in ("token", "block"):
            with _held_width(width, by_link=link is not None):
                res, calls = _counted(parallel.verify_chain_from_logits, _cut(x, shard), drafts, params,
                                      draft_probs=_cut(qb, shard), method=method, rng=rng, shard=shard, link=link)
            ref = ss.verify_chain_from_logits(x, drafts, params, draft_probs=qb, method=method, rng=rng)
            out.append([f"chain {method} {case}", kind, _outcome(res) == _outcome(ref), len(calls),
                        res.num_accepted.tolist(), 0])
    return out


WIDE_V = 32_000 if os.environ.get("SPECSAMPLER_FULL_MC") == "1" else 3001  # the suite's full-size switch


def _wide_shard(shard: parallel.VocabShard) -> parallel.VocabShard:
    """The shard's split, scaled to a vocabulary of WIDE_V."""
    start, end = shard.start * WIDE_V // V, shard.end * WIDE_V // V
    return parallel.VocabShard(start, end - start, WIDE_V, shard.group)


def wide(shard, g):
    """Flat rows over a wider vocabulary (many tokens at the nucleus's edge: its cut takes more than one round of
    description), peaked rows and ties, with top-p, min-p and both; sampling, chains and trees."""
    s = _wide_shard(shard)
    B, K = 6, 3
    scale = torch.tensor([0.2, 0.5, 3.0, 0.2, 1.0, 0.0])[:, None, None]  # 0: every logit equal
    x = torch.randn(B, K + 1, WIDE_V, generator=g) * scale
    x[3] = torch.randint(-2, 3, (K + 1, WIDE_V), generator=g).float()  # ties at every cut
    q = torch.softmax(torch.randn(B, K, WIDE_V, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, WIDE_V), 1, generator=g).view(B, K)
    rng = _philox(g, B)
    cut = lambda t: t[..., s.start:s.end].contiguous()  # noqa: E731
    out = []
    for params in (ss.SamplingParams(top_p=0.9), ss.SamplingParams(top_p=torch.tensor([0.5, 0.99, 0.9, 0.7, 0.3, 0.6]),
                                                                   min_p=torch.tensor([0.0, 0.5, 0.0, 0.2, 0.9, 0.0]))):
        res, calls = _counted(parallel.sample_from_logits, cut(x[:, 0]), params, rng, num_logprobs=3, shard=s)
        ref = ss.sample_from_logits(x[:, 0], params, rng, num_logprobs=3)
        out.append(["sample", [t.tolist() for t in res], [t.tolist() for t in ref], calls])
        for method in ("token", "block", "target_only"):
            dp = q if method != "target_only" else None
            res, calls = _counted(parallel.verify_chain_from_logits, cut(x), drafts, params,
                                  draft_probs=None if dp is None else cut(dp), method=method, rng=rng, shard=s)
            ref = ss.verify_chain_from_logits(x, drafts, params, draft_probs=dp, method=method, rng=rng)
            out.append([f"chain {method}", _outcome(res), _outcome(ref), calls])
    tree_ = ss.TokenTree.from_parents(torch.tensor([WIDE[:8]] * B))
    xt = x[:, :2].repeat(1, 4, 1)
    qt = torch.softmax(torch.randn(B, 8, WIDE_V, generator=g), -1)
    dt = torch.multinomial(qt.view(-1, WIDE_V), 1, generator=g).view(B, 8)
    for method, sampling in (("rrs", "iid"), ("rrs", "without_replacement"), ("traversal", "iid"),
                             ("traversal", "without_replacement")):
        res, calls = _counted(parallel.verify_tree_from_logits, cut(xt), dt, tree_, ss.SamplingParams(top_p=0.9),
                              draft_probs=cut(qt), method=method, draft_sampling=sampling, rng=rng, shard=s)
        ref = ss.verify_tree_from_logits(xt, dt, tree_, ss.SamplingParams(top_p=0.9), draft_probs=qt, method=method,
                                         draft_sampling=sampling, rng=rng)
        out.append([f"tree {method}/{sampling}", _outcome(res) + [res.path.tolist()],
                    _outcome(ref) + [ref.path.tolist()], calls])
    return out


LARGE_V = 128_256  # a Llama 3 vocabulary


def large_vocabulary(shard, g):
    """Nuclei of tens of thousands of tokens (top-p 0.9 over rows of LARGE_V logits drawn from N(0, 1), temperature
    0.8, as examples/vocab_parallel.py has them): the token chain's and the sampling's rounds, and whether each gave
    the one-device tokens."""
    start, end = shard.start * LARGE_V // V, shard.end * LARGE_V // V
    s = parallel.VocabShard(start, end - start, LARGE_V, shard.group)
    B, K = 2, 3
    x, rng = torch.randn(B, K + 1, LARGE_V, generator=g), _philox(g, B)
    q = torch.softmax(x[:, :K] / 0.7, -1)
    drafts = torch.multinomial(q.reshape(-1, LARGE_V), 1, generator=g).view(B, K)
    params = ss.SamplingParams(temperature=0.8, top_p=0.9)
    cut = lambda t: t[..., s.start:s.end].contiguous()  # noqa: E731
    res, chain_calls = _counted(parallel.verify_chain_from_logits, cut(x), drafts, params, draft_probs=cut(q),
                                method="token", rng=rng, shard=s)
    ref = ss.verify_chain_from_logits(x, drafts, params, draft_probs=q, method="token", rng=rng)
    got, sample_calls = _counted(parallel.sample_from_logits, cut(x[:, 0]), params, rng, shard=s)
    want = ss.sample_from_logits(x[:, 0], params, rng)
    return [["chain token", _outcome(res) == _outcome(ref), len(chain_calls)],
            ["sample", got.tokens.tolist() == want.tokens.tolist(), len(sample_calls)]]


def wide_auto(shard, g):
    """auto under a bandwidth-only link on rows of WIDE_V ids: its collectives and the shard strategy's, and
    whether it gave the one-device tokens."""
    s = _wide_shard(shard)
    B, K = 4, 3
    x, rng = torch.randn(B, K + 1, WIDE_V, generator=g) * 3, _philox(g, B)
    q = torch.softmax(torch.randn(B, K, WIDE_V, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, WIDE_V), 1, generator=g).view(B, K)
    cut = lambda t: t[..., s.start:s.end].contiguous()  # noqa: E731
    params = ss.SamplingParams(temperature=0.8, top_p=0.9)
    out = []
    for name, call, ref in (
            ("sample", lambda **kw: parallel.sample_from_logits(cut(x[:, 0]), params, rng, shard=s, **kw).tokens,
             ss.sample_from_logits(x[:, 0], params, rng).tokens),
            ("chain token", lambda **kw: parallel.verify_chain_from_logits(
                cut(x), drafts, params, draft_probs=cut(q), method="token", rng=rng, shard=s, **kw).tokens,
             ss.verify_chain_from_logits(x, drafts, params, draft_probs=q, method="token", rng=rng).tokens)):
        res, calls = _counted(call, strategy="auto", link=parallel.Link(0.0, 1.0))
        _, shard_calls = _counted(call, link=parallel.Link(0.0, 1.0))  # the same link: the same walk
        out.append([name, res.tolist() == ref.tolist(), calls, shard_calls])
    return out


def fallbacks(shard, g):
    """What an estimate that falls short costs: a draw whose bounds on the other shards' masses are loose (its
    window cannot cover them), and top-p cuts whose estimated interval misses the crossing; the tokens and the
    rounds each took, with the one-device tokens."""
    import torch.distributed as dist

    from specsampler.parallel import draws, nucleus, rounds
    from specsampler.sampling.masses import sample_by_inversion

    R, world, s = 12, dist.get_world_size(), _wide_shard(shard)
    w = torch.rand(R, WIDE_V, generator=g) * (torch.rand(R, WIDE_V, generator=g) < 0.7)
    u = torch.rand(R, generator=g)
    layout = rounds.exchange(s, []).layout
    lo, hi = torch.zeros(world, R, dtype=torch.float64), torch.full((world, R), 2.0**40, dtype=torch.float64)
    with parallel.count_collectives() as log:
        token, _ = rounds.run(draws.draw(w[:, s.start:s.end].contiguous(), u, lo, hi, layout, s), s, w.device,
                              "draw", torch.zeros((), dtype=torch.int64))
    out = {"draw": [token.tolist(), sample_by_inversion(w, u).tolist(), log.rounds]}
    x = _sampled_logits(g, 8, 1)[:, 0]
    params, rng = ss.SamplingParams(top_p=torch.linspace(0.2, 0.95, 8)), _philox(g, 8)
    estimate = nucleus._estimated_interval
    for name, wrong in (("above", nucleus.END_KEY - 1), ("below", nucleus.MIN_KEY)):
        nucleus._estimated_interval = lambda *args, k=wrong: (torch.full((8,), k), torch.full((8,), k + 1),
                                                              torch.zeros(1, 8, dtype=torch.float64))
        try:
            res, calls = _counted(parallel.sample_from_logits, _cut(x, shard), params, rng, shard=shard)
        finally:
            nucleus._estimated_interval = estimate
        ref = ss.sample_from_logits(x, params, rng)
        out[name] = [res.tokens.tolist(), ref.tokens.tolist(), len(calls)]
    return out


def strategies(shard, g):
    """gather (the rows all-gathered, then the one-device op) for each op, greedy and sampled, in bf16 with masks;
    and auto under a latency-only link: the collectives each sent, with the shard strategy's."""
    B, K = 5, 3
    x = _sampled_logits(g, B, K + 1).bfloat16()
    mask, q, rng, params = _mask(g, B, K + 1), _draft_probs(g, B, K), _philox(g, B), _params(g, B)
    drafts = torch.multinomial(q.view(-1, V) + 1e-9, 1, generator=g).view(B, K)
    tree_ = ss.TokenTree.from_parents(torch.tensor([BINARY[:8]] * B))
    qt = _draft_probs(g, B, 8)
    calls = {
        "sample": (lambda **kw: parallel.sample_from_logits(_cut(x[:, 0], shard), params, rng, _cut(mask[:, 0], shard),
                                                            num_logprobs=2, shard=shard, **kw),
                   lambda: ss.sample_from_logits(x[:, 0], params, rng, mask[:, 0], num_logprobs=2)),
        "sample greedy": (lambda **kw: parallel.sample_from_logits(_cut(x[:, 0], shard), ss.SamplingParams(
            temperature=0.0), shard=shard, **kw), lambda: ss.sample_from_logits(x[:, 0], ss.SamplingParams(
                temperature=0.0))),
        "chain token": (lambda **kw: parallel.verify_chain_from_logits(
            _cut(x, shard), drafts, params, draft_probs=_cut(q, shard), method="token", rng=rng,
            vocab_mask=_cut(mask, shard), shard=shard, **kw), lambda: ss.verify_chain_from_logits(
                x, drafts, params, draft_probs=q, method="token", rng=rng, vocab_mask=mask)),
        "tree traversal": (lambda **kw: parallel.verify_tree_from_logits(
            _cut(x[:, :2].repeat(1, 4, 1), shard), drafts[:, :1].repeat(1, 8), tree_, params,
            draft_probs=_cut(qt, shard), method="traversal", rng=rng, shard=shard, **kw),
            lambda: ss.verify_tree_from_logits(x[:, :2].repeat(1, 4, 1), drafts[:, :1].repeat(1, 8), tree_, params,
                                               draft_probs=qt, method="traversal", rng=rng)),
    }
    out = {}
    for name, (call, one_device) in calls.items():
        ref = _outcome(one_device())
        got = {}
        for label, strategy, link in (("gather", "gather", None), ("shard", "shard", None),
                                      ("auto, latency only", "auto", parallel.Link(1.0, 0.0))):
            with parallel.count_collectives() as log:
                res = call(strategy=strategy, link=link)
            got[label] = [_outcome(res) == ref, log.calls]
        out[name] = got
    out["default link"] = parallel.cost.link_of(None, shard) == parallel.cost.LINKS["ethernet"]
    return out


def edges(shard, g):
    """Calls at the contract's edges, by strategy: a batch of no requests (``auto`` planned from an empty batch);
    logits that require grad (straight from a forward pass); validate='full' on draft probabilities (a negative one
    on one rank's shard: raised on every rank) and on the rows of absent tree nodes (padding: not checked); a
    tree's target-only verification of greedy rows (its expected count, as the one-device op's: None). Each entry:
    (parallel result, one-device result), or the error's argument."""
    B, K, N = 3, 2, 4
    x, q = torch.randn(B, K + 1, V, generator=g) * 2, _draft_probs(g, B, K)  # values validate='full' takes
    drafts = torch.randint(0, V, (B, K), generator=g)
    tree_ = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, -1], [-1, 0, 1, 2], [-1, -1, -1, -1]]))
    xt, qt = torch.randn(B, N, V, generator=g) * 2, _draft_probs(g, B, N)
    xt[tree_.depth < 0] = float("nan")  # absent nodes' rows: padding
    dt = torch.randint(0, V, (B, N), generator=g)
    bad, bad_t = _cut(q, shard).clone(), _cut(qt, shard).clone()
    if shard.start == 0 and shard.size:  # on one rank: request 1's first draft, its node 1
        bad[1, 0, 0] = bad_t[1, 1, 0] = -0.5
    params, greedy = ss.SamplingParams(temperature=0.9, top_p=0.8), ss.SamplingParams(temperature=0.0)
    none = ss.TokenTree.from_parents(torch.zeros(0, N, dtype=torch.long))

    def rng(n=B):
        return ss.Philox(torch.arange(n))

    def named(fn, *args, **kwargs):
        try:
            return outcome(fn(*args, **kwargs))
        except ValueError as e:
            return f"ValueError naming {str(e).split(': ')[1]}"

    def outcome(r):  # every output, the expected count included
        return {k: getattr(r, k).tolist() if isinstance(getattr(r, k), torch.Tensor) else getattr(r, k)
                for k in ("path", "tokens", "num_accepted", "last_node", "expected_accepted") if hasattr(r, k)}

    out = {}
    for strategy in ("auto", "shard", "gather"):
        kw = dict(shard=shard, strategy=strategy)
        out[strategy, "empty"] = [
            outcome(parallel.verify_chain_from_logits(_cut(x[:0], shard), drafts[:0], params,
                                                      draft_probs=_cut(q[:0], shard), rng=rng(0), **kw)),
            outcome(parallel.verify_tree_from_logits(_cut(xt[:0], shard), dt[:0], none, params, method="rrs",
                                                     draft_probs=_cut(qt[:0], shard), rng=rng(0), **kw))]
        grad = _cut(x, shard).requires_grad_()
        out[strategy, "grad"] = (
            outcome(parallel.verify_chain_from_logits(grad, drafts, params, draft_probs=_cut(q, shard), rng=rng(),
                                                      **kw)),
            outcome(ss.verify_chain_from_logits(x.clone().requires_grad_(), drafts, params, draft_probs=q, rng=rng())))
        out[strategy, "negative q"] = (
            named(parallel.verify_chain_from_logits, _cut(x, shard), drafts, params, draft_probs=bad, rng=rng(),
                  validate="full", **kw),
            named(parallel.verify_tree_from_logits, _cut(xt, shard), dt, tree_, params, draft_probs=bad_t,
                  method="rrs", rng=rng(), validate="full", **kw))
        out[strategy, "absent rows"] = (
            named(parallel.verify_tree_from_logits, _cut(xt, shard), dt, tree_, params, draft_probs=_cut(qt, shard),
                  method="rrs", rng=rng(), validate="full", **kw),
            outcome(ss.verify_tree_from_logits(xt, dt, tree_, params, draft_probs=qt, method="rrs", rng=rng(),
                                               validate="full")))
        out[strategy, "greedy target-only"] = (
            outcome(parallel.verify_tree_from_logits(_cut(xt, shard), dt, tree_, greedy, method="target_only", **kw)),
            outcome(ss.verify_tree_from_logits(xt, dt, tree_, greedy, method="target_only")))
    return out


def compiled(shard, g):
    """The shard path under a plain torch.compile in inference mode (dynamo's guards failed on the PyTorch path's
    NumPy views written in place): sampling and a token chain, compiled against eager and the one-device op."""
    B, K = 6, 3
    logits, params, rng = _sampled_logits(g, B, K + 1), _params(g, B), _philox(g, B)
    drafts, q = torch.randint(0, V, (B, K), generator=g), _draft_probs(g, B, K)

    def step(x):
        return (parallel.sample_from_logits(x[:, 0], params, rng, shard=shard, strategy="shard").tokens,
                parallel.verify_chain_from_logits(x, drafts, params, draft_probs=_cut(q, shard), method="token",
                                                  rng=rng, shard=shard, strategy="shard").tokens)

    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(step, backend="aot_eager")(_cut(logits, shard))
        ref = (ss.sample_from_logits(logits[:, 0], params, rng).tokens,
               ss.verify_chain_from_logits(logits, drafts, params, draft_probs=q, method="token", rng=rng).tokens)
    return [[t.tolist() for t in got], [t.tolist() for t in ref]]


SCENARIOS = {"sample": sample, "chain": chain, "tree": tree, "sampled": sampled, "sampled_chain": sampled_chain,
             "sampled_tree": sampled_tree, "comms": comms_independent_of_v, "errors": errors, "exactness": exactness,
             "rounds": rounds, "settled": settled, "compact": compact, "nuclei": nuclei, "wide": wide,
             "large vocabulary": large_vocabulary, "wide auto": wide_auto, "fallbacks": fallbacks,
             "strategies": strategies, "edges": edges, "compiled": compiled}
