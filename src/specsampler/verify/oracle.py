"""Exact output distributions of speculative verification, by probability propagation (float64).

For a small vocabulary every draft the drafter can produce is enumerated with its probability and every
way the verifier can treat it followed exactly: the distribution of the emitted sequence and the expected
accepted drafts. A lossless method, continued by the target, reproduces the target's joint distribution
(:func:`extend`, :func:`target_joint`, :func:`max_error`). Models are functions of the prefix: ``target(prefix)
-> probs [V]``; ``draft(prefix) -> probs [V]`` (sampled drafts) or ``-> token`` (deterministic). Plain loops,
independent of the vectorised code, so the tests can check one against the other; public.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Prefix = tuple[int, ...]
Dist = Callable[[Prefix], Sequence[float]]


@dataclass(frozen=True)
class Outcome:
    """Exact output of a verification method.

    sequences: emitted sequence (accepted drafts + one token) -> probability.
    expected_accepted: expected number of accepted drafts.
    """

    sequences: dict[Prefix, float]
    expected_accepted: float


def _dist(f: Dist, prefix: Prefix) -> np.ndarray:
    return np.asarray(f(prefix), dtype=np.float64)


def _ratio(num: float, den: float) -> float:
    """min(1, num/den), with num == 0 -> 0 and den == 0 < num -> 1 (a strict test u*q < p)."""
    if num <= 0:
        return 0.0
    return 1.0 if num >= den else num / den


def _normalised_or(r: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    s = r.sum()
    return r / s if s > 0 else fallback / fallback.sum()


def chain_given_drafts(method: str, drafts: Prefix, p: Sequence[np.ndarray], q: Sequence[np.ndarray] | None):
    """Verification of one fixed draft chain.

    drafts: x_0..x_{K-1}; p: K+1 target distributions (after x_<i); q: K draft
    distributions (``token``, ``block``). Returns a list of (emitted sequence, probability,
    accepted count).
    """
    K = len(drafts)
    out = []
    if method == "greedy":
        for i in range(K):
            y = int(np.argmax(p[i]))
            if y != drafts[i]:
                return [(drafts[:i] + (y,), 1.0, i)]
        return [(drafts + (int(np.argmax(p[K])),), 1.0, K)]
    if method == "target_only":
        reach = 1.0
        for i in range(K):
            pi = p[i] / p[i].sum()
            out += [(drafts[:i] + (y,), reach * pi[y], i) for y in range(len(pi)) if y != drafts[i]]
            reach *= pi[drafts[i]]
        pk = p[K] / p[K].sum()
        return out + [(drafts + (y,), reach * pk[y], K) for y in range(len(pk))]
    if method == "token":
        reach = 1.0
        for i in range(K):
            accept = _ratio(p[i][drafts[i]], q[i][drafts[i]])
            if accept < 1:
                r = _normalised_or(np.maximum(p[i] - q[i], 0.0), p[i])
                out += [(drafts[:i] + (y,), reach * (1 - accept) * r[y], i) for y in range(len(r))]
            reach *= accept
        pk = p[K] / p[K].sum()
        return out + [(drafts + (y,), reach * pk[y], K) for y in range(len(pk))]
    if method == "block":
        a = [1.0]
        for i in range(K):
            a.append(_ratio(a[i] * p[i][drafts[i]], q[i][drafts[i]]))
        w = [np.maximum(a[i] * p[i] - q[i], 0.0) for i in range(K)]
        h = [w[i].sum() / (w[i].sum() + 1 - a[i]) if w[i].sum() > 0 else 0.0 for i in range(K)] + [a[K]]
        h[0] = 1.0
        for tau in range(K + 1):
            p_tau = h[tau] * float(np.prod([1 - h[j] for j in range(tau + 1, K + 1)]))
            if p_tau <= 0:
                continue
            r = p[K] / p[K].sum() if tau == K else _normalised_or(w[tau], p[tau])
            out += [(drafts[:tau] + (y,), p_tau * r[y], tau) for y in range(len(r))]
        return out
    raise ValueError(f"chain_given_drafts: method: expected one of token, block, target_only, greedy, got {method!r}")


def chain(target: Dist, draft: Callable, num_drafts: int, method: str, vocab_size: int, prefix: Prefix = ()) -> Outcome:
    """Exact output of chain verification with ``num_drafts`` drafts.

    Sampled drafts (``token``, ``block``): ``draft(prefix)`` is the distribution each draft is
    drawn from, autoregressively. Deterministic drafts (``target_only``, ``greedy``):
    ``draft(prefix)`` is the drafted token.
    """
    seqs: dict[Prefix, float] = {}
    expected = 0.0
    K, V = num_drafts, vocab_size
    if method in ("token", "block"):
        chains = itertools.product(range(V), repeat=K)
    else:
        x: Prefix = ()
        for _ in range(K):
            x += (int(draft(prefix + x)),)
        chains = [x]
    for drafts in chains:
        weight, q = 1.0, None
        if method in ("token", "block"):
            q = [_dist(draft, prefix + drafts[:i]) for i in range(K)]
            weight = float(np.prod([q[i][drafts[i]] for i in range(K)]))
            if weight == 0:
                continue
        p = [_dist(target, prefix + drafts[:i]) for i in range(K + 1)]
        for seq, prob, n in chain_given_drafts(method, drafts, p, q):
            if prob > 0:
                seqs[seq] = seqs.get(seq, 0.0) + weight * prob
                expected += weight * prob * n
    return Outcome(seqs, expected)


def extend(sequences: dict[Prefix, float], target: Dist, length: int, prefix: Prefix = ()) -> dict[Prefix, float]:
    """Continue each sequence with the target's own sampling up to ``length`` tokens."""
    out: dict[Prefix, float] = {}
    todo = list(sequences.items())
    while todo:
        seq, prob = todo.pop()
        if len(seq) >= length:
            out[seq[:length]] = out.get(seq[:length], 0.0) + prob
            continue
        p = _dist(target, prefix + seq)
        p = p / p.sum()
        todo += [(seq + (y,), prob * p[y]) for y in range(len(p)) if p[y] > 0]
    return out


def target_joint(target: Dist, length: int, prefix: Prefix = ()) -> dict[Prefix, float]:
    """The target's joint distribution of its next ``length`` tokens."""
    return extend({(): 1.0}, target, length, prefix)


def greedy_sequence(target: Dist, length: int, prefix: Prefix = ()) -> Prefix:
    """The target's greedy continuation (argmax, ties to the lowest id)."""
    seq: Prefix = ()
    for _ in range(length):
        seq += (int(np.argmax(_dist(target, prefix + seq))),)
    return seq


def max_error(a: dict[Prefix, float], b: dict[Prefix, float]) -> float:
    """Largest absolute difference of two distributions over sequences."""
    return max((abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b)), default=0.0)


def total_variation(a: dict[Prefix, float], b: dict[Prefix, float]) -> float:
    """Total variation distance of two distributions over sequences."""
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# ----------------------------------------------------------------------------- trees

TREE_METHODS = ("greedy", "target_only", "rrs", "traversal")
DRAFTING = ("iid", "without_replacement", "top_k")


def children_drafts(q: np.ndarray, k: int, draft_sampling: str) -> list[tuple[Prefix, float]]:
    """The possible child tokens of a node, in sibling order, with their probabilities.

    ``iid``: k independent draws from q; ``without_replacement``: k draws from q without
    replacement (fewer when q has fewer than k tokens); ``top_k``: the k most likely tokens
    of q (probability desc, id asc), deterministically.
    """
    V = len(q)
    if draft_sampling == "top_k":
        return [(tuple(sorted(range(V), key=lambda t: (-q[t], t))[:k]), 1.0)]
    if draft_sampling == "iid":
        return [(c, float(np.prod([q[t] for t in c]))) for c in itertools.product(range(V), repeat=k)
                if all(q[t] > 0 for t in c)]
    if draft_sampling == "without_replacement":
        out = []

        def grow(prefix: Prefix, prob: float, left: np.ndarray):
            if len(prefix) == k or left.sum() <= 0:
                out.append((prefix, prob))
                return
            for t in range(V):
                if left[t] > 0:
                    rest = left.copy()
                    rest[t] = 0.0
                    grow(prefix + (t,), prob * left[t] / left.sum(), rest)

        grow((), 1.0, q.astype(np.float64))
        return out
    raise ValueError(f"oracle: draft_sampling: expected one of {DRAFTING}, got {draft_sampling!r}")


def tree(target: Dist, draft: Dist, shape: Sequence[int], method: str, vocab_size: int, *,
         draft_sampling: str = "iid", assume: str | None = None, prefix: Prefix = ()) -> Outcome:
    """Exact output of tree verification on a random draft tree of a given shape.

    shape: children per node at each depth, e.g. ``[2, 2]``: the root has 2 children and each
        of them 2 children. Every child list is drafted from ``draft(prefix of its parent)``
        with ``draft_sampling``; subtrees are drafted independently given their tokens.
    method: ``"greedy"``, ``"target_only"``, ``"rrs"`` or ``"traversal"`` (docs/design.md, "Algorithms").
    assume: the draft sampling the rrs/traversal verifier is told (``"iid"`` or
        ``"without_replacement"``); default: the true one (``"iid"`` for ``top_k``). A wrong
        assumption (the iid rule on top-k or without-replacement drafts) is lossy, and this
        function measures it.
    """
    if method not in TREE_METHODS:
        raise ValueError(f"oracle.tree: method: expected one of {TREE_METHODS}, got {method!r}")
    rule = assume or ("iid" if draft_sampling == "top_k" else draft_sampling)
    shape = tuple(shape)
    memo: dict = {}

    def emit(dist: np.ndarray, weight: float, head: Prefix, out: dict):
        for y in range(len(dist)):
            if dist[y] > 0 and weight > 0:
                out[head + (y,)] = out.get(head + (y,), 0.0) + weight * dist[y]

    def add(out: dict, sub: dict, weight: float, head: Prefix):
        for seq, pr in sub.items():
            if weight * pr > 0:
                out[head + seq] = out.get(head + seq, 0.0) + weight * pr

    def subtree(s: Prefix, depth: int) -> dict:
        """Outcomes (emitted suffixes) of the walk from a node at ``s`` (greedy, target_only, rrs)."""
        key = (s, depth)
        if key in memo:
            return memo[key]
        p = _dist(target, prefix + s)
        p = p / p.sum()
        out: dict = {}
        if depth == len(shape):
            if method == "greedy":
                emit(np.eye(len(p))[int(np.argmax(p))], 1.0, (), out)
            else:
                emit(p, 1.0, (), out)
            memo[key] = out
            return out
        q = _dist(draft, prefix + s)
        for kids, weight in children_drafts(q, shape[depth], draft_sampling):
            if method in ("greedy", "target_only"):
                draws = np.eye(len(p))[int(np.argmax(p))] if method == "greedy" else p
                for y in range(len(p)):
                    if draws[y] > 0:
                        if y in kids:
                            add(out, subtree(s + (y,), depth + 1), weight * draws[y], (y,))
                        else:
                            emit(np.eye(len(p))[y], weight * draws[y], (), out)
                continue
            r, q_cur, reach = p.copy(), q.copy(), 1.0
            for t in kids:
                accept = _ratio(r[t], q_cur[t])
                add(out, subtree(s + (t,), depth + 1), weight * reach * accept, (t,))
                reach *= 1 - accept
                residual = np.maximum(r - q_cur, 0.0)
                if residual.sum() > 0:
                    r = residual / residual.sum()
                if rule == "without_replacement":
                    q_cur = q_cur.copy()
                    q_cur[t] = 0.0
                    if q_cur.sum() > 0:
                        q_cur /= q_cur.sum()
            emit(r, weight * reach, (), out)
        memo[key] = out
        return out

    def traverse(s: Prefix, depth: int, a: float) -> tuple[dict, float]:
        """Traversal verification in the subtree at ``s`` entered with weight ``a``: the
        outcomes where a node of the subtree is accepted, and their total probability."""
        p = _dist(target, prefix + s)
        p = p / p.sum()
        out: dict = {}
        kid_lists = [((), 1.0)] if depth == len(shape) else children_drafts(
            _dist(draft, prefix + s), shape[depth], draft_sampling)
        q = None if depth == len(shape) else _dist(draft, prefix + s)
        for kids, weight in kid_lists:
            mb, ms, a_u, reach = p.copy(), None if q is None else q.copy(), a, 1.0
            for t in kids:
                a_c = _ratio(a_u * mb[t], ms[t])
                sub, accepted = traverse(s + (t,), depth + 1, a_c)
                add(out, sub, weight * reach, (t,))
                reach *= 1 - accepted
                w = np.maximum(a_u * mb - ms, 0.0)
                mass = w.sum()
                if mass > 0:
                    mb = w / mass
                a_u = mass / (mass + 1 - a_u) if mass > 0 else 0.0
                if rule == "without_replacement":
                    ms = ms.copy()
                    ms[t] = 0.0
                    if ms.sum() > 0:
                        ms /= ms.sum()
            emit(mb, weight * reach * (1.0 if depth == 0 else a_u), (), out)
        return out, sum(out.values())

    seqs = traverse((), 0, 1.0)[0] if method == "traversal" else subtree((), 0)
    return Outcome(seqs, sum(pr * (len(seq) - 1) for seq, pr in seqs.items()))
