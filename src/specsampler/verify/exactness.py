"""Monte Carlo exactness checks: the real implementations against the exact oracle.

Random context-dependent models on a small vocabulary are tabulated for every prefix, so
thousands of independent verifications run as one batch. The emitted sequences are
compared with the oracle's exact distribution (chi-square), and, continued with the target
to a fixed length, with the target's joint distribution; the mean accepted count with the
exact expectation. Used by the tests and by ``specsampler check``. Needs scipy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..rng import Philox
from . import oracle
from .chain import verify_chain
from .token_tree import TokenTree
from .tree import verify_tree

SAMPLED_DRAFTS = ("token", "block")


def random_model(V: int, seed: int, zeros: bool = False, concentration: float = 0.7):
    """A next-token model: prefix -> float64 distribution over V tokens, fixed by (seed, prefix).

    With ``zeros`` some tokens get probability 0 (truncated supports), never all of them.
    """

    def model(prefix):
        r = np.random.default_rng([seed, len(prefix), *prefix])
        d = r.dirichlet(np.full(V, concentration))
        if zeros:
            drop = r.random(V) < 0.35
            drop[r.integers(V)] = False
            d[drop] = 0.0
            d /= d.sum()
        return d

    return model


def argmax_drafter(model):
    """The deterministic drafter that proposes the model's argmax."""
    return lambda prefix: int(np.argmax(model(prefix)))


class Table:
    """A model tabulated for every prefix up to length ``depth``, looked up in batches."""

    def __init__(self, model, V: int, depth: int):
        self.V = V
        self.tables = []
        for length in range(depth + 1):
            prefixes = np.array(np.unravel_index(np.arange(V**length), (V,) * length)).T if length else [()]
            rows = [model(tuple(int(t) for t in prefix)) for prefix in prefixes]
            self.tables.append(torch.tensor(np.array(rows), dtype=torch.float64))

    def at(self, seqs: Tensor) -> Tensor:
        """Distributions after each prefix: int64 ``[N, l]`` -> float64 ``[N, V]``."""
        idx = torch.zeros(seqs.shape[0], dtype=torch.int64)
        for j in range(seqs.shape[1]):
            idx = idx * self.V + seqs[:, j]
        return self.tables[seqs.shape[1]][idx]


def encode(seqs: Tensor, V: int) -> Tensor:
    """Sequences int64 ``[N, L]`` padded with -1 -> one integer each (base V+1)."""
    code = torch.zeros(seqs.shape[0], dtype=torch.int64)
    for j in range(seqs.shape[1]):
        code = code * (V + 1) + torch.where(seqs[:, j] < 0, V, seqs[:, j])
    return code


def encode_dist(dist: dict, length: int, V: int) -> dict[int, float]:
    """A distribution over sequences (padded to ``length``) keyed by :func:`encode`'s integers."""
    out: dict[int, float] = {}
    for seq, p in dist.items():
        key = int(encode(torch.tensor([list(seq) + [-1] * (length - len(seq))]), V)[0])
        out[key] = out.get(key, 0.0) + p
    return out


def continue_with(target: Table, tokens: Tensor, generator: torch.Generator) -> Tensor:
    """Fill the ``-1`` tail of each sequence by sampling the target: int64 ``[N, L]``."""
    out = tokens.clone()
    for j in range(1, out.shape[1]):
        need = out[:, j] < 0
        if need.any():
            out[need, j] = torch.multinomial(target.at(out[need, :j].clamp(min=0)), 1, generator=generator)[:, 0]
    return out


def chi_square_counts(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Goodness of fit of observed ``counts`` to exact ``probs`` (same order).

    Returns the chi-square p-value (outcomes with expected count < 5 pooled) and the number
    of draws of probability-0 outcomes (which must be 0).
    """
    from scipy import stats

    counts, probs = np.asarray(counts, dtype=np.float64).ravel(), np.asarray(probs, dtype=np.float64).ravel()
    impossible = int(counts[probs <= 0].sum())
    n = counts.sum()
    counts, expected = counts[probs > 0], probs[probs > 0] / probs[probs > 0].sum() * n
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    p = 1.0 if len(counts) < 2 else float(stats.chisquare(counts, expected).pvalue)
    return p, impossible


def chi_square(codes: Tensor, exact: dict[int, float]) -> tuple[float, int]:
    """:func:`chi_square_counts` of outcome ``codes`` (int64 ``[N]``) against ``exact``."""
    keys = sorted(set(exact) | set(codes.unique().tolist()))
    counts = torch.bincount(torch.searchsorted(torch.tensor(keys), codes), minlength=len(keys))
    return chi_square_counts(counts.numpy(), np.array([exact.get(k, 0.0) for k in keys]))


@dataclass(frozen=True)
class MonteCarlo:
    """One Monte Carlo run of a verification method against its oracle.

    p_emitted / p_continued: chi-square p-values of the emitted sequences against the oracle
    and of the continued sequences against the target's joint distribution; impossible:
    draws of probability-0 outcomes; accepted: the accepted counts (float64 ``[trials]``);
    meter: each trial's ``expected_accepted`` (None where not reported); exact: the
    oracle's outcome; oracle_error: the oracle's largest deviation from the target's joint
    distribution (0 for greedy, which is not sampling).
    """

    p_emitted: float
    p_continued: float
    impossible: int
    accepted: np.ndarray
    meter: np.ndarray | None
    exact: oracle.Outcome
    oracle_error: float

    def z_score(self) -> float:
        """Distance of the mean accepted count from the exact expectation, in standard errors of the exact law (its
        variance from the oracle's sequences, each accepting its length - 1 drafts: a sample of equal counts has no
        spread of its own to measure it by)."""
        mean = self.exact.expected_accepted
        var = sum(pr * (len(seq) - 1) ** 2 for seq, pr in self.exact.sequences.items()) - mean**2
        gap = abs(self.accepted.mean() - mean)
        if gap < 1e-9:
            return 0.0
        se = np.sqrt(max(var, 0.0) / len(self.accepted))
        return gap / se if se > 0 else float("inf")


def chain_inputs(P: Table, Q: Table, K: int, trials: int, sampled: bool, generator: torch.Generator):
    """``trials`` draft chains of length K (drawn from Q, or Q's argmax), with their target rows
    float32 ``[N, K+1, V]``, tokens ``[N, K]`` and draft rows ``[N, K, V]``."""
    x = torch.zeros(trials, K, dtype=torch.int64)
    q = []
    for i in range(K):
        qi = Q.at(x[:, :i])
        x[:, i] = torch.multinomial(qi, 1, generator=generator)[:, 0] if sampled else qi.argmax(-1)
        q.append(qi)
    p = torch.stack([P.at(x[:, :i]) for i in range(K + 1)], 1).float()
    q = torch.stack(q, 1).float() if K else torch.zeros(trials, 0, P.V)
    return p, x, q


def chain_monte_carlo(method: str, V: int, K: int, trials: int, seed: int = 0, zeros: bool = False,
                      device: str | torch.device = "cpu") -> MonteCarlo:
    """Run ``verify_chain(method)`` on ``trials`` chains of random models (verified on ``device``:
    the Triton kernels on a GPU) and compare with the oracle."""
    target, draft_model = random_model(V, seed, zeros), random_model(V, seed + 1000, zeros)
    P, Q = Table(target, V, K + 1), Table(draft_model, V, K)
    sampled = method in SAMPLED_DRAFTS
    gen = torch.Generator().manual_seed(seed)
    p, x, q = chain_inputs(P, Q, K, trials, sampled, gen)
    d = torch.device(device)
    res = verify_chain(p.to(d), x.to(d), q.to(d) if sampled else None, method=method,
                       rng=Philox(torch.arange(trials, device=d) + seed * trials))
    tokens, accepted, meter = res.tokens.cpu(), res.num_accepted.cpu(), res.expected_accepted.cpu()
    exact = oracle.chain(target, draft_model if sampled else argmax_drafter(draft_model), K, method, V)
    joint = oracle.target_joint(target, K + 1)
    p_emitted, impossible = chi_square(encode(tokens, V), encode_dist(exact.sequences, K + 1, V))
    p_continued, impossible2 = chi_square(encode(continue_with(P, tokens, gen), V), encode_dist(joint, K + 1, V))
    error = oracle.max_error(oracle.extend(exact.sequences, target, K + 1), joint)
    return MonteCarlo(p_emitted, p_continued, impossible + impossible2, accepted.double().numpy(),
                      meter.double().numpy(), exact, error)


def shape_parents(shape) -> list[int]:
    """Parent of each node of the complete tree with ``shape[d]`` children per node at depth d,
    numbered breadth first (node 0 the root)."""
    parents, level = [-1], [0]
    for k in shape:
        nxt = []
        for v in level:
            for _ in range(k):
                parents.append(v)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def draft_children(q: Tensor, k: int, draft_sampling: str, generator: torch.Generator) -> Tensor:
    """k child tokens per row of ``q`` float64 ``[T, V]`` (iid, without replacement, or top-k)."""
    if draft_sampling == "top_k":  # ties to the lower id: a stable sort
        return torch.sort(q, dim=1, descending=True, stable=True).indices[:, :k]
    if draft_sampling == "iid":
        return torch.multinomial(q, k, replacement=True, generator=generator)
    out, left = [], q.clone()
    for _ in range(k):
        t = torch.multinomial(left, 1, generator=generator)
        out.append(t)
        left.scatter_(1, t, 0.0)
    return torch.cat(out, 1)


def tree_inputs(P: Table, Q: Table, shape, trials: int, draft_sampling: str, generator: torch.Generator):
    """``trials`` random draft trees of a shape: target rows ``[T, N, V]``, tokens ``[T, N]``,
    draft rows ``[T, N, V]`` (node c: the q its token was drawn from, the parent's) and the tree."""
    parents = shape_parents(shape)
    N = len(parents)
    x = torch.zeros(trials, N, dtype=torch.int64)
    prefix = {0: torch.zeros(trials, 0, dtype=torch.int64)}
    p = torch.zeros(trials, N, P.V, dtype=torch.float32)
    q = torch.zeros(trials, N, P.V, dtype=torch.float32)
    for v in range(N):
        p[:, v] = P.at(prefix[v]).float()
        kids = [c for c in range(N) if parents[c] == v]
        if kids:
            qv = Q.at(prefix[v])
            x[:, kids] = draft_children(qv, len(kids), draft_sampling, generator)
            for c in kids:
                q[:, c] = qv.float()
                prefix[c] = torch.cat([prefix[v], x[:, c : c + 1]], 1)
    tree = TokenTree.from_parents(torch.tensor([parents] * trials))
    return p, x, q, tree


def tree_monte_carlo(method: str, shape, V: int, trials: int, seed: int = 0, draft_sampling: str = "iid",
                     zeros: bool = False, device: str | torch.device = "cpu") -> MonteCarlo:
    """Run ``verify_tree(method)`` on ``trials`` random draft trees and compare with the oracle.

    ``draft_sampling`` ("iid", "without_replacement", "top_k") is how the children are drafted
    and what the rrs/traversal verifier is told. ``zeros`` truncates the target's supports, and
    the draft's unless it drafts without replacement (which needs as many tokens as children).
    The trees are verified on ``device`` (the Triton kernels on a GPU).
    """
    target = random_model(V, seed, zeros)
    draft_model = random_model(V, seed + 1000, zeros and draft_sampling != "without_replacement")
    D = len(shape)
    P, Q = Table(target, V, D), Table(draft_model, V, D - 1)
    gen = torch.Generator().manual_seed(seed)
    p, x, q, tree = tree_inputs(P, Q, shape, trials, draft_sampling, gen)
    sampled = method in ("rrs", "traversal")
    d = torch.device(device)
    res = verify_tree(p.to(d), x.to(d), tree.to(d), q.to(d) if sampled else None, method=method,
                      draft_sampling="iid" if draft_sampling == "top_k" else draft_sampling,
                      rng=Philox(torch.arange(trials, device=d) + seed * trials))
    tokens, accepted = res.tokens.cpu(), res.num_accepted.cpu()
    exact = oracle.tree(target, draft_model, shape, method, V, draft_sampling=draft_sampling)
    p_emitted, impossible = chi_square(encode(tokens, V), encode_dist(exact.sequences, D + 1, V))
    p_continued, error = 1.0, 0.0
    if method != "greedy":
        joint = oracle.target_joint(target, D + 1)
        full = continue_with(P, tokens, gen)
        p_continued, more = chi_square(encode(full, V), encode_dist(joint, D + 1, V))
        impossible += more
        error = oracle.max_error(oracle.extend(exact.sequences, target, D + 1), joint)
    meter = res.expected_accepted
    meter = None if meter is None or method == "greedy" else meter.cpu().double().numpy()
    return MonteCarlo(p_emitted, p_continued, impossible, accepted.double().numpy(), meter, exact, error)
