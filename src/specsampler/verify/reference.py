"""Plain references: one loop per request for each verification method, read beside its formula.

The same Philox draws (counters of :mod:`specsampler.rng`), the same float32 arithmetic and exact masses
(:mod:`specsampler.sampling.masses`) as the vectorised walks (:mod:`.chain`, :mod:`.tree`), and the kernels'
draws (:mod:`specsampler.kernels.chain`, :mod:`specsampler.kernels.tree`), so all three give the same tokens;
the tests hold them to it.
Python per node: for reading and for tests, and for few requests on the CPU, where a node's few operations on single
rows cost less than a batched walk's gathers over every request (the generation loop walks rrs and traversal of up to
8 requests by :func:`tree_rrs` and :func:`tree_traversal`, a lone request's chain by :func:`chain_token` and
:func:`chain_block`; ``verify_tree`` a few requests, more over wide rows). Inputs from probabilities; formulas:
docs/design.md, "Algorithms".
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, Philox, uniform
from ..sampling.masses import MASS_BITS, has_mass, row_mass, sample_by_inversion
from .token_tree import TokenTree

OP = "reference"
# The loops' scalars (acceptance weights, ratios, coins) are float32 numbers on the host: the same IEEE float32
# arithmetic as 0-d tensors, without a tensor operation's microseconds per step; like tensors, they give inf and
# NaN without a warning.
f32 = np.float32
quiet = np.errstate(all="ignore")
_UNIT = 2.0**-MASS_BITS


def _draw(weights: Tensor, u: float) -> int:
    """Inversion over one row of (unnormalised) weights ``[V]`` with uniform ``u``."""
    return int(sample_by_inversion(weights[None], torch.tensor([u], dtype=torch.float32))[0])


def _at(row: Tensor, i: int) -> np.float32:
    """``row[i]`` as a host float32."""
    return f32(row[i].item())


def _values_at(rows: Tensor, x: list[int]) -> list[np.float32]:
    """``rows[i, x[i]]`` for each row ``[n, V]`` as host float32 (0 where ``x[i]`` is not a token: never read)."""
    ids = torch.tensor([xi if _usable(xi, rows.shape[1]) else 0 for xi in x], dtype=torch.int64)
    return [f32(v) for v in rows.gather(1, ids[:, None])[:, 0].tolist()]


def _ratio(num: np.float32, den: np.float32, floor: float = 1e-30) -> np.float32:
    """``min(1, num / den)``, 0 when ``num <= 0`` (float32); chains divide by ``den`` itself (``floor=0``), trees by
    ``max(den, 1e-30)`` (a NaN ``den`` stays NaN), as their vectorised walks do."""
    if not num > 0:
        return f32(0.0)
    return f32(1.0) if num >= den else num / np.maximum(den, f32(floor))


def _mass(w: Tensor) -> tuple[float, np.float32]:
    """A row's exact mass (float) and its float32 weight (the mass rounded once, :func:`masses.as_weight`)."""
    mass = row_mass(w).item()
    return mass, f32(mass * _UNIT)


def _renormalised(w: Tensor, z: np.float32) -> Tensor:
    """``w / z`` for a row of mass (:func:`masses.divide_by`'s quotients)."""
    return w / float(z)


def _normalise(w: Tensor) -> Tensor:
    """A row over its exact sum (all 0 without mass: :func:`masses.normalise`)."""
    mass, z = _mass(w)
    return _renormalised(w, z) if mass > 0 else torch.zeros_like(w)


def _after_rejection(s: np.float32, a: np.float32, mass: float) -> np.float32:
    """The acceptance weight ``s / (s + 1 - a)`` a rejection leaves (0 where the residual has no mass or a is 0)."""
    return s / (s + f32(1.0) - a) if mass > 0 and a > 0 else f32(0.0)


def _usable(x: int, V: int) -> bool:
    return 0 <= x < V  # a draft id out of range is never accepted


@quiet
def chain_token(p: Tensor, q: Tensor, x: list[int], u_acc: list[float], u_draw: list[float]) -> tuple[list[int], int]:
    """Rejection sampling, one request: p ``[K+1, V]``, q ``[K, V]``, x its K drafts, the uniforms of its K+1 nodes
    (float32 values). -> (tokens, accepted)."""
    K, V = len(x), p.shape[1]
    p_x, q_x = _values_at(p[:K], x), _values_at(q[:K], x)
    for i, xi in enumerate(x):
        if _usable(xi, V) and f32(u_acc[i + 1]) * q_x[i] < p_x[i] and p_x[i] > 0:  # draft i is node i+1
            continue
        residual = (p[i] - q[i]).clamp(min=0.0)
        return x[:i] + [_draw(residual if has_mass(residual) else p[i], u_draw[i])], i
    return x + [_draw(p[K], u_draw[K])], K


@quiet
def chain_block(p: Tensor, q: Tensor, x: list[int], eta: list[float], u_draw: list[float]) -> tuple[list[int], int]:
    """Block verification, one request: the weights ``a``, residuals ``w`` and ``h``; tau from the top. (The K
    residuals are formed together, each row as alone: elementwise, and its exact mass summed within it.)"""
    K, V = len(x), p.shape[1]
    p_x, q_x = _values_at(p[:K], x), _values_at(q[:K], x)
    a, h = [f32(1.0)], [f32(1.0)]
    for i, xi in enumerate(x):
        a.append(_ratio(a[i] * p_x[i], q_x[i], 0.0) if _usable(xi, V) else f32(0.0))
    w = (p[:K] * torch.tensor(a[:K], dtype=torch.float32)[:, None] - q[:K]).clamp(min=0.0)
    w_mass = row_mass(w).tolist()
    for i in range(1, K):
        h.append(_after_rejection(f32(w_mass[i] * _UNIT), a[i], w_mass[i]))  # a_i = 0 stays unaccepted
    h.append(a[K])
    if K == 0:
        h = h[:1]
    tau = max(i for i in range(K + 1) if i == 0 or f32(eta[i]) < h[i])
    stop = w[tau] if tau < K and w_mass[tau] > 0 else p[tau]
    return x[:tau] + [_draw(stop, u_draw[tau])], tau


def chain_draws(p: Tensor, x: list[int], u_draw: list[float] | None) -> tuple[list[int], int]:
    """target_only (``u_draw`` given: sample then compare) or greedy (``None``: argmax), one request."""
    for i in range(len(x) + 1):
        y = int(p[i].argmax()) if u_draw is None else _draw(p[i], u_draw[i])
        if i == len(x) or y != x[i] or (u_draw is not None and not p[i, y] > 0):  # a row without mass draws 0
            return x[:i] + [y], i
    raise AssertionError("unreachable")


def verify_chain(target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None = None, *,
                 num_drafts: Tensor | None = None, method: str, rng: Philox) -> tuple[Tensor, Tensor]:
    """The loop over requests of :func:`specsampler.verify_chain` (shapes as there; inputs assumed valid).

    Returns ``tokens`` int64 ``[B, K+1]`` (-1 after the emitted token) and ``num_accepted`` int64 ``[B]``.
    """
    B, K1, _ = target_probs.shape
    dev = target_probs.device
    u_draw = uniform(rng, OP, B, K1, STREAM_SAMPLE, dev).tolist()
    u_acc = uniform(rng, OP, B, K1, STREAM_ACCEPT, dev).tolist()
    tokens = torch.full((B, K1), -1, dtype=torch.int64)
    accepted = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        k = K1 - 1 if num_drafts is None else int(num_drafts[b])
        p, x = target_probs[b].float(), draft_tokens[b, :k].tolist()
        if method == "token":
            out, n = chain_token(p, draft_probs[b].float(), x, u_acc[b], u_draw[b])
        elif method == "block":
            out, n = chain_block(p, draft_probs[b].float(), x, u_acc[b], u_draw[b])
        else:
            out, n = chain_draws(p, x, u_draw[b] if method == "target_only" else None)
        tokens[b, : len(out)], accepted[b] = torch.tensor(out), n
    return tokens, accepted


def tree_draws(p: Tensor, x: list[int], kids: list[list[int]], u_draw: list[float] | None) -> tuple[list[int], int]:
    """Tree target_only / greedy, one request: draw at v, move to the first child carrying the draw."""
    path = [0]
    while True:
        v = path[-1]
        y = int(p[v].argmax()) if u_draw is None else _draw(p[v], u_draw[v])
        has_mass = u_draw is None or p[v, y] > 0  # without, the draw is 0, of target probability 0: no child
        nxt = next((c for c in kids[v] if x[c] == y), -1) if has_mass else -1
        if nxt < 0:
            return path, y
        path.append(nxt)


@quiet
def tree_rrs(p, q, x, kids, u_acc, u_draw, without_replacement: bool) -> tuple[list[int], int]:
    """Recursive rejection sampling, one request: children in sibling order against the residual r."""
    V, path = p.shape[1], [0]
    while True:
        v = path[-1]
        r = p[v]
        shared = q[kids[v][0]] if kids[v] and without_replacement else None
        for c in kids[v]:
            qc = shared if shared is not None else q[c]
            # r(x) = 0: never accepted, whatever q(x) says (a negative one passes the test)
            if _usable(x[c], V) and f32(u_acc[c]) * _at(qc, x[c]) < (r_x := _at(r, x[c])) and r_x > 0:
                path.append(c)
                break
            residual = (r - qc).clamp(min=0.0)
            mass, z = _mass(residual)
            if mass > 0:
                r = _renormalised(residual, z)
            if shared is not None:
                shared = qc.clone()
                shared[min(max(x[c], 0), V - 1)] = 0.0
                shared = _normalise(shared)
        else:
            return path, _draw(r, u_draw[v])


@quiet
def tree_traversal(p, q, x, kids, eta, u_draw, without_replacement: bool) -> tuple[list[int], int]:
    """Traversal verification, one request: test the first leaf in depth-first order; on rejection
    delete it and update its parent's Mb, Ms and a; recompute a down the new leftmost path."""
    V = p.shape[1]
    xs = [min(max(t, 0), V - 1) for t in x]
    stack, a, mb, ms = [0], [f32(1.0)], [p[0]], [None]
    siblings_left = [list(kids[0])]

    def push(node: int) -> None:
        j = len(stack) - 1
        q_x = _at(ms[j] if without_replacement else q[node], xs[node])
        a.append(_ratio(a[j] * _at(mb[j], xs[node]), q_x) if _usable(x[node], V) else f32(0.0))
        stack.append(node), mb.append(p[node]), ms.append(None), siblings_left.append(list(kids[node]))

    def descend() -> None:
        while siblings_left[-1]:
            kid = siblings_left[-1].pop(0)
            if without_replacement:
                ms[-1] = q[kid]  # all children of a node share its q
            push(kid)

    descend()
    while True:
        j, leaf = len(stack) - 1, stack[-1]
        if j == 0 or f32(eta[leaf]) < a[j]:
            return list(stack), _draw(mb[j], u_draw[leaf])
        for lst in (stack, a, mb, ms, siblings_left):
            lst.pop()
        j -= 1
        qq = ms[j] if without_replacement else q[leaf]
        w = (mb[j] * float(a[j]) - qq).clamp(min=0.0)
        mass, s = _mass(w)
        if mass > 0:
            mb[j] = _renormalised(w, s)
        a[j] = _after_rejection(s, a[j], mass)  # a = 0 stays 0
        if without_replacement:
            qq = qq.clone()
            qq[xs[leaf]] = 0.0
            ms[j] = _normalise(qq)
        if siblings_left[-1]:
            push(siblings_left[-1].pop(0))
            descend()


def verify_tree(target_probs: Tensor, draft_tokens: Tensor, tree: TokenTree, draft_probs: Tensor | None = None, *,
                method: str, draft_sampling: str = "iid", rng: Philox) -> tuple[Tensor, Tensor, Tensor]:
    """The loop over requests of :func:`specsampler.verify_tree` (shapes as there; inputs assumed valid).

    Returns ``path`` int64 ``[B, D+1]``, ``tokens`` int64 ``[B, D+1]`` (-1 padded) and ``num_accepted`` ``[B]``.
    """
    B, N, _ = target_probs.shape
    D, dev = tree.max_depth, target_probs.device
    u_draw = uniform(rng, OP, B, N, STREAM_SAMPLE, dev).tolist()
    u_acc = uniform(rng, OP, B, N, STREAM_ACCEPT, dev).tolist()
    path_out = torch.full((B, D + 1), -1, dtype=torch.int64)
    tokens = torch.full((B, D + 1), -1, dtype=torch.int64)
    wo = draft_sampling == "without_replacement"
    for b in range(B):
        p, x = target_probs[b].float(), draft_tokens[b].tolist()
        kids = [[] for _ in range(N)]
        for v in range(N):  # sibling order: the first_child / next_sibling links
            c = int(tree.first_child[b, v])
            while c >= 0:
                kids[v].append(c)
                c = int(tree.next_sibling[b, c])
        if method == "rrs":
            path, y = tree_rrs(p, draft_probs[b].float(), x, kids, u_acc[b], u_draw[b], wo)
        elif method == "traversal":
            path, y = tree_traversal(p, draft_probs[b].float(), x, kids, u_acc[b], u_draw[b], wo)
        else:
            path, y = tree_draws(p, x, kids, u_draw[b] if method == "target_only" else None)
        path_out[b, : len(path)] = torch.tensor(path)
        tokens[b, : len(path)] = torch.tensor([x[v] for v in path[1:]] + [y])
    return path_out, tokens, (path_out >= 0).sum(1) - 1
