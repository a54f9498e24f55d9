"""Speculative generation written with the public ops only: the reference the lean loop must equal.

Every step as the public API spells it: ``logits_to_probs`` and ``sample`` for each draft level,
a ``TokenTree.from_parents`` per tree, boolean attention masks, ``verify_chain_from_logits`` /
``verify_tree_from_logits`` with their input checks, ``compact_kv`` on the caches, and each random
call taking ``rng.advance(k)`` (a ``torch.Generator`` as it is). The n-gram drafter's proposals
come from a plain backwards scan. Slow, and obviously the documented algorithm.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

import specsampler as ss


class Streams:
    def __init__(self, rng):
        self.rng, self.calls = rng, 0

    def next(self):
        self.calls += 1
        return self.rng.advance(self.calls - 1) if isinstance(self.rng, ss.Philox) else self.rng


class Model:
    """A model and its cache; ``last`` (int64 ``[B]``): positions past it are fed at it (their logits reach no output
    token; a learned position table ends at the model's limit)."""

    def __init__(self, model, batch, last):
        self.model, self.cache, self.calls, self.last = model, DynamicCache(), 0, last[:, None]
        self.committed = torch.zeros(batch, 0, dtype=torch.bool)
        self.kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

    @property
    def slots(self):
        return self.committed.shape[1]

    def forward(self, tokens, positions, visible, committed=None):
        B, n = tokens.shape
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[:, None]
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=torch.minimum(positions, self.last),
                         use_cache=True, **{self.kw: self.cache})
        self.calls += 1
        new = committed if committed is not None else torch.zeros(B, n, dtype=torch.bool)
        self.committed = torch.cat([self.committed, new], 1)
        return out.logits.float()

    def keep_path(self, start, path, num):
        ss.compact_kv(self.cache, torch.full((path.shape[0],), start), path, num)
        width = int(num.max()) + 1
        self.committed = torch.cat([self.committed[:, :start], torch.arange(width) <= num[:, None]], 1)
        extra = self.cache.get_seq_length() - self.slots
        if extra > 0:
            self.cache.crop(-extra)


def causal(real):
    n = real.shape[1]
    return (torch.ones(n, n, dtype=torch.bool).tril() & real[:, None, :]) | torch.eye(n, dtype=torch.bool)


def prefill(m, ids, real):
    return m.forward(ids, (real.long().cumsum(1) - 1).clamp(min=0), causal(real), committed=real)[:, -1]


def visible_nodes(tree):
    return tree.mask() | torch.eye(tree.size, dtype=torch.bool)


def layout(branching):
    levels, start, width = [range(0, 1)], 1, 1
    for c in branching:
        width *= c
        levels.append(range(start, start + width))
        start += width
    parents = [-1] + [levels[d - 1].start + k // c for d, c in enumerate(branching, 1) for k in range(len(levels[d]))]
    return levels, parents


def children(q, c, how, streams):
    B, P, V = q.shape
    if how == "deterministic":
        return q.topk(min(c, V), -1).indices.reshape(B, -1), torch.ones(B, P * c, dtype=torch.bool)
    if how == "iid":
        return ss.sample(q[:, :, None, :].expand(B, P, c, V), streams.next()).reshape(B, -1), \
            torch.ones(B, P * c, dtype=torch.bool)
    left, xs, have = q.clone(), [], []
    for _ in range(c):
        have.append(left.sum(-1) > 0)
        x = ss.sample(left, streams.next())
        left.scatter_(-1, x[..., None], 0.0)
        xs.append(x)
    return torch.stack(xs, 2).reshape(B, -1), torch.stack(have, 2).reshape(B, -1)


def draft_tree(dm, pending, pending_on, pos_root, branching, params, how, streams):
    B = pending.shape[0]
    P = 2 if bool(pending_on[:, 0].any()) else 1
    toks, on = pending[:, 2 - P:], pending_on[:, 2 - P:]
    visible = torch.cat([dm.committed[:, None, :].expand(B, P, -1), causal(on)], 2)
    positions = (pos_root[:, None] - P + 1 + torch.arange(P)).clamp(min=0)
    committed = torch.cat([on[:, :-1], torch.zeros(B, 1, dtype=torch.bool)], 1)
    root_slot = dm.slots + P - 1
    q_level = ss.logits_to_probs(dm.forward(toks, positions, visible, committed)[:, -1:], params)
    levels, layout_parents = layout(branching)
    N = levels[-1].stop
    tokens = torch.zeros(B, N, dtype=torch.long)
    tokens[:, 0] = pending[:, 1]
    parents = torch.tensor(layout_parents).expand(B, N).clone()
    q_nodes = torch.zeros(B, N, q_level.shape[-1])
    q_nodes[:, :1] = q_level
    prefix = dm.committed[:, :root_slot]
    for d, c in enumerate(branching, 1):
        lv = levels[d]
        x, have = children(q_level, c, how, streams)
        parent_ids = parents[:, lv.start:lv.stop]
        parent_on = (parent_ids == 0) | (parents.gather(1, parent_ids) >= 0)
        tokens[:, lv.start:lv.stop] = x
        parents[:, lv.start:lv.stop] = torch.where(have & parent_on, parent_ids, -1)
        if d == len(branching):
            break
        n = len(lv)
        anc = visible_nodes(ss.TokenTree.from_parents(parents[:, :lv.stop]))[:, lv.start:]
        visible = torch.cat([prefix[:, None, :].expand(B, n, -1), anc], 2)
        q_level = ss.logits_to_probs(dm.forward(x, (pos_root + d)[:, None].expand(B, n), visible), params)
        q_nodes[:, lv.start:lv.stop] = q_level
    return tokens, parents, q_nodes, root_slot


def latest_match(ctx, k, min_n, max_n):
    """The continuation of the latest earlier occurrence of the last n tokens, n = max_n .. min_n."""
    L = len(ctx)
    for n in range(max_n, min_n - 1, -1):
        for p in range(L - n - 1, -1, -1):
            if n < L and ctx[p: p + n] == ctx[L - n:]:
                return ctx[p + n: p + n + k]
    return []


def generate(target, draft, ids, max_new, params, *, drafter="chain", num_draft_tokens=4, tree_shape=None,
             draft_sampling="iid", method="auto", rng=None, attention_mask=None, prompt_lookup=(1, 3)):
    """Token lists per request (no EOS: max_new tokens each)."""
    B = ids.shape[0]
    real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    streams = Streams(rng)
    pos_root = real.long().sum(1)
    last = pos_root + max_new - 2  # the position whose logits draw the max_new-th token
    tm = Model(target, B, last)
    out = [[] for _ in range(B)]
    root = ss.sample_from_logits(prefill(tm, ids, real), params, streams.next()).tokens
    for b in range(B):
        out[b].append(int(root[b]))
    if drafter == "ngram":
        method = "target_only" if method == "auto" else method
        contexts = [row[mask].tolist() + [int(r)] for row, mask, r in zip(ids, real, root)]
        while min(map(len, out)) < max_new:
            props = [latest_match(c, num_draft_tokens, *prompt_lookup) if len(o) < max_new else []
                     for c, o in zip(contexts, out)]
            K = max(map(len, props))
            chain = torch.tensor([[int(r), *p] + [0] * (K - len(p)) for r, p in zip(root, props)])
            visible = torch.cat([tm.committed[:, None, :].expand(B, K + 1, -1),
                                 torch.ones(K + 1, K + 1, dtype=torch.bool).tril().expand(B, -1, -1)], 2)
            start = tm.slots
            logits = tm.forward(chain, pos_root[:, None] + torch.arange(K + 1), visible)
            num = torch.tensor(list(map(len, props)))
            res = ss.verify_chain_from_logits(logits, chain[:, 1:], params, num_drafts=num, method=method,
                                              rng=streams.next())
            n = res.num_accepted
            for b in range(B):
                new = res.tokens[b, : int(n[b]) + 1].tolist()
                contexts[b] += new
                out[b] += new
            tm.keep_path(start, torch.arange(K + 1).expand(B, -1), n)
            root = res.tokens.gather(1, n[:, None])[:, 0]
            pos_root = pos_root + n + 1
        return [o[:max_new] for o in out]
    how = draft_sampling
    if method == "auto":
        method = "target_only" if how == "deterministic" else "token" if drafter == "chain" else "rrs"
    branching = (1,) * num_draft_tokens if drafter == "chain" else tuple(tree_shape)
    D = len(branching)
    dm = Model(draft, B, last)
    prefill(dm, ids, real)
    pending = torch.stack([torch.zeros_like(root), root], 1)
    pending_on = torch.tensor([[False, True]] * B)
    sampled = method not in ("target_only", "greedy")
    while min(map(len, out)) < max_new:
        tokens, parents, q_nodes, root_slot = draft_tree(dm, pending, pending_on, pos_root, branching, params, how,
                                                         streams)
        tree = ss.TokenTree.from_parents(parents)
        visible = torch.cat([tm.committed[:, None, :].expand(B, tree.size, -1), visible_nodes(tree)], 2)
        start = tm.slots
        logits = tm.forward(tokens, pos_root[:, None] + tree.depth.clamp(min=0), visible)
        if drafter == "chain":
            res = ss.verify_chain_from_logits(logits, tokens[:, 1:], params, method=method, rng=streams.next(),
                                              draft_probs=q_nodes[:, :-1] if sampled else None)
            path = torch.where(torch.arange(D + 1) <= res.num_accepted[:, None], torch.arange(D + 1), -1)
        else:
            q_parent = q_nodes.gather(1, parents.clamp(min=0)[:, :, None].expand_as(q_nodes)) if sampled else None
            res = ss.verify_tree_from_logits(logits, tokens, tree, params, draft_probs=q_parent, method=method,
                                             draft_sampling="iid" if how == "iid" else "without_replacement",
                                             rng=streams.next())
            path = res.path
        n = res.num_accepted
        for b in range(B):
            out[b] += res.tokens[b, : int(n[b]) + 1].tolist()
        tm.keep_path(start, path, n)
        dm.keep_path(root_slot, path, n.clamp(max=D - 1))
        pending_on = torch.stack([n == D, torch.ones_like(n, dtype=torch.bool)], 1)
        last = res.tokens.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        pending = torch.stack([last, res.tokens.gather(1, n[:, None])[:, 0]], 1)
        pos_root = pos_root + n + 1
    return [o[:max_new] for o in out]
