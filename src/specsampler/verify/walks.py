"""The tree walks: greedy / target_only (draw, then move to the child carrying the draw), rrs (recursive
rejection sampling) and traversal (leaves tested in depth-first order, parents updated on deletion).

Each step is one batched operation over the requests still walking, and only the rows the walk visits are
read (:class:`TargetRows`). Formulas: docs/design.md, "Algorithms"; random counters: "Randomness". Public
entry points: :mod:`specsampler.verify.tree`; plain loop per request: :mod:`specsampler.verify.reference`;
kernel: :mod:`specsampler.kernels.tree`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..lazy import cached_property
from ..params import RowParams
from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, Philox, planned
from ..sampling.filters import masked_logits
from ..sampling.greedy import greedy_ids
from ..sampling.masses import as_weight, divide_by, has_mass, nonnegative_rows, sample_by_inversion
from ..sampling.processing import SCRATCH, Processed, process
from ..sampling.vocab import Vocab
from .chain import accepts
from .drafts import Drafts
from .token_tree import TokenTree


@dataclass(frozen=True)
class TreeInputs(Drafts):
    """Validated inputs. x_raw: the drafts as given (int64 ``[B, N]``); q: float32 ``[B, N, vocab.width]`` (or a
    :class:`_RequestView` of a larger batch's); columns: the columns the rows hold (None: the whole vocabulary);
    given_usable, given_nonnegative: :attr:`usable`, :attr:`nonnegative` where the caller has them. ``x``,
    ``usable`` and ``nonnegative`` are made on first use (:class:`~specsampler.verify.drafts.Drafts`)."""

    B: int
    N: int
    V: int
    method: str
    sampling: str
    tree: TokenTree
    x_raw: Tensor
    q: Tensor | None
    columns: Vocab | None = None
    given_usable: Tensor | None = field(default=None, repr=False)
    given_nonnegative: Tensor | None = field(default=None, repr=False)

    @cached_property
    def nonnegative(self) -> Tensor:
        """bool ``[B, N]``: the draft rows holding no value below 0 and no NaN."""
        return self.given_nonnegative if self.given_nonnegative is not None else nonnegative_rows(self.q)

    def _usable(self) -> Tensor:
        """Non-root present nodes whose token is in range (the others are never accepted)."""
        return (self.tree.depth > 0) & (self.x_raw >= 0) & (self.x_raw < self.V)

    def take(self, requests: Tensor) -> TreeInputs:
        """The inputs of requests ``requests`` (int64 ``[b]``) as a batch of their own, their draft rows read where
        they lie (:class:`_RequestView`)."""
        t = self.tree
        tree = TokenTree(t.parents[requests], t.first_child[requests], t.next_sibling[requests], t.depth[requests],
                         t.device)
        return TreeInputs(requests.numel(), self.N, self.V, self.method, self.sampling, tree, self.x_raw[requests],
                          _RequestView(self.q, requests), self.columns, self.usable[requests],
                          self.nonnegative[requests])


class _RequestView:
    """The draft rows ``q`` float32 ``[B, N, V]`` of requests ``requests`` (int64 ``[b]``), not copied: ``view[b, ...]``
    is ``q[requests[b], ...]`` (the rrs and traversal walks index q by their requests first)."""

    def __init__(self, q: Tensor, requests: Tensor):
        self.q, self.requests = q, requests

    def __getitem__(self, index: tuple) -> Tensor:
        return self.q[(self.requests[index[0]], *index[1:])]


class TargetRows:
    """The target distribution at (request, node) pairs, read (and processed) on demand."""

    def __init__(self, probs: Tensor | None = None, logits: Tensor | None = None, rp: RowParams | None = None,
                 mask: Tensor | None = None):
        self.probs, self.logits, self.rp, self.mask = probs, logits, rp, mask

    @cached_property
    def few(self) -> int:
        """The most candidates a row is processed into, where every row keeps at most :data:`_FEW` (top-k or
        greedy rows from logits, in a vocabulary at least 8 times wider); else 0."""
        return _few_candidates(self.rp, self.logits.shape[-1]) if self.logits is not None and self.rp is not None else 0

    def held(self, b: Tensor, node: Tensor, width: int) -> tuple[Tensor | None, Tensor]:
        """The rows ``(b[i], node[i])`` as the rrs and traversal walks hold them (``width``: :func:`_held_width`):
        ``(None, probabilities float32 [m, V])`` for a width of 0; else their candidates' ids int64 ``[m, width]``
        in increasing order and probabilities float32 ``[m, width]``, padded with id 0 at probability 0 (the other
        columns are 0: a walk's residuals stay among them)."""
        proc = self.at(b, node)
        return proc.candidates(width) if width else (None, proc.dense())

    @staticmethod
    def _rows(t: Tensor, flat: Tensor) -> Tensor:
        """Rows ``flat`` (= b * N + node) of ``[B, N, V]``, whole rows copied."""
        return t.flatten(0, -2).index_select(0, flat)

    def _logits(self, b: Tensor, node: Tensor, flat: Tensor) -> Tensor:
        """The logit rows (``flat`` = b * N + node), gathered into a scratch buffer (processing never
        keeps its input), float32."""
        V = self.logits.shape[-1]
        out = SCRATCH.get("visited logits", (flat.numel(), V), self.logits.dtype, self.logits.device)
        x = torch.index_select(self.logits.flatten(0, -2), 0, flat, out=out).float()
        return x if self.mask is None else masked_logits(x, self.mask[b, node])

    def _flat(self, b: Tensor, node: Tensor) -> Tensor:
        """Row indices ``b * N + node`` into the rows ``[B * N, V]``."""
        return b * (self.logits if self.probs is None else self.probs).shape[1] + node

    def at(self, b: Tensor, node: Tensor) -> Processed:
        """Processed distributions of rows ``(b[i], node[i])``."""
        flat = self._flat(b, node)
        if self.probs is not None:
            return Processed.from_dense(self._rows(self.probs, flat).float())
        return process(self._logits(b, node, flat), self.rp.take(flat), logits=True)

    def argmax(self, b: Tensor, node: Tensor) -> Tensor:
        flat = self._flat(b, node)
        return greedy_ids(self._rows(self.probs, flat) if self.probs is not None else self._logits(b, node, flat))


class _RequestRows(TargetRows):
    """The target rows of requests ``requests`` (int64 ``[b]``: a walk's request i is ``requests[i]``) of ``rows``,
    read where they lie."""

    def __init__(self, rows: TargetRows, requests: Tensor):
        super().__init__(rows.probs, rows.logits, rows.rp, rows.mask)
        self.requests = requests

    @cached_property
    def few(self) -> int:
        N, V = self.logits.shape[1:]
        flat = (self.requests[:, None] * N + torch.arange(N, device=self.requests.device)).view(-1)
        return _few_candidates(self.rp.take(flat), V)

    def _flat(self, b: Tensor, node: Tensor) -> Tensor:
        return super()._flat(self.requests[b], node)

    def _logits(self, b: Tensor, node: Tensor, flat: Tensor) -> Tensor:
        return super()._logits(self.requests[b], node, flat)


_FEW = 1024  # candidates a row may keep for the walks to hold it by its candidates


def _kept(rp: RowParams, V: int) -> Tensor:
    """int64 ``[R]`` (one value where the rows share their parameters): the candidates each row of ``rp`` over ``V``
    tokens keeps where that is few enough to hold it by them (top-k or greedy, at most :data:`_FEW`, in a
    vocabulary 8 times wider), else 0."""
    s = rp.shared if rp.shared is not None else rp
    keep = torch.where(torch.as_tensor(s.temperature) == 0, 1, torch.as_tensor(s.top_k))
    return torch.where((keep > 0) & (keep <= min(_FEW, V // 8)), keep, 0)


def _few_candidates(rp: RowParams, V: int) -> int:
    """:attr:`TargetRows.few` of rows ``rp`` over ``V`` tokens."""
    kept = _kept(rp, V)
    return int(kept.max()) if kept.numel() and bool((kept > 0).all()) else 0


def _held_width(c: TreeInputs, rows: TargetRows) -> int:
    """How wide the rrs and traversal walks hold the target rows by their candidates: :attr:`TargetRows.few`
    where the rows hold the whole vocabulary and the draft rows the walks read (the children's) hold no value
    below 0 and no NaN (a residual ``max(r - q, 0)`` is then 0 wherever ``r`` is); 0 (whole rows) elsewhere."""
    if not rows.few or c.columns is not None:
        return 0
    return rows.few if bool((c.nonnegative | (c.tree.depth <= 0)).all()) else 0


def _held_requests(c: TreeInputs, rows: TargetRows) -> Tensor | None:
    """bool ``[B]``: the requests whose rows the rrs and traversal walks could hold by their candidates
    (:func:`_held_width`, request by request); None where the rows' parameters are shared (one answer for all)."""
    if rows.logits is None or rows.rp is None or rows.rp.shared is not None or c.columns is not None:
        return None
    few = (_kept(rows.rp, rows.logits.shape[-1]).view(c.B, c.N) > 0).all(1)
    if not bool(few.any()):  # no request to hold: the draft rows need not be read
        return few
    return few & (c.nonnegative | (c.tree.depth <= 0)).all(1)


def walk_held_apart(walk, c: TreeInputs, rows: TargetRows, rng, op: str) -> tuple[Tensor, Tensor, Tensor]:
    """``walk`` (:func:`walk_rrs` or :func:`walk_traversal`) of a batch where some requests' rows can be held by
    their candidates and others' cannot (top-k requests beside top-p ones): each group walked as a batch of its
    own, on the uniforms the whole batch draws (a request's numbers are its own, and each stream is drawn once,
    in the walk's order), so that one request's whole rows do not make every request's walk read whole rows. Any
    other batch: one walk. Returns the walk's path ``[B, D + 1]``, counts and tokens.

    Each group reads the draft rows where they lie (:meth:`TreeInputs.take`)."""
    held = _held_requests(c, rows)
    if held is None or bool(held.all()) or not bool(held.any()):
        return walk(c, rows, rng, op)
    whole, drawn = drawer(c, rng, op, None), {}

    def draw(stream: int, count: int) -> Tensor:
        if (stream, count) not in drawn:
            drawn[stream, count] = whole(stream, count)
        return drawn[stream, count]

    dev = c.x.device
    path = torch.full((c.B, c.tree.max_depth + 1), -1, dtype=torch.int64, device=dev)
    n, y = torch.zeros(c.B, dtype=torch.int64, device=dev), torch.zeros(c.B, dtype=torch.int64, device=dev)
    for group in (held.nonzero()[:, 0], (~held).nonzero()[:, 0]):
        part, n[group], y[group] = walk(c.take(group), _RequestRows(rows, group), rng, op,
                                        lambda stream, count, group=group: draw(stream, count)[group])
        path[group, : part.shape[1]] = part
    return path, n, y


def _value(r: Tensor, ids: Tensor | None, x: Tensor, vocab: Vocab) -> Tensor:
    """float32 ``[m]``: rows ``r`` (dense, or held by their candidates ``ids``) at tokens ``x`` int64 ``[m]``."""
    return vocab.value(r, x) if ids is None else torch.where(ids == x[:, None], r, 0.0).sum(-1)


def _at(q: Tensor, ids: Tensor | None) -> Tensor:
    """Dense rows ``q`` ``[m, V]`` at the columns of rows held as ``ids`` (None: all of them)."""
    return q if ids is None else q.gather(1, ids)


def _draw(r: Tensor, ids: Tensor | None, u: Tensor, vocab: Vocab) -> Tensor:
    """:meth:`Vocab.draw` of rows ``r`` (dense, or held by their candidates ``ids``): the same token, and 0 for a
    row without mass, as over the dense rows."""
    if ids is None:
        return vocab.draw(r, u)
    return torch.where(has_mass(r), ids.gather(1, sample_by_inversion(r, u)[:, None])[:, 0], 0)


class _ChildIndex:
    """Finds, for requests at nodes, the first child (sibling order) carrying a token.

    Every usable node's key ``parent * V + token`` is listed per request in sibling-rank order,
    so that a step's lookup is one comparison of the request's keys with ``v * V + y`` and a
    first-match reduction."""

    def __init__(self, c: TreeInputs):
        t = c.tree
        key = torch.where(c.usable, t.parents * c.V + c.x, -1)
        self.order = t.sibling_rank.argsort(dim=1, stable=True)  # siblings: lower rank first
        self.keys = key.gather(1, self.order)
        self.V = c.V

    def find(self, at: Tensor | slice, v: Tensor, y: Tensor) -> Tensor:
        """For requests ``at`` (indices, or a slice) at nodes ``v``: the first child carrying token
        ``y``, or -1."""
        hit, first = (self.keys[at] == (v * self.V + y)[:, None]).max(1)
        return torch.where(hit, self.order[at].gather(1, first[:, None])[:, 0], -1)


def _walk_start(c: TreeInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A walk from the root: the path ``[B, D+2]`` (root, then -1; the extra column because
    nobody moves past depth D), accepted counts, emitted tokens, and the walking requests."""
    B, dev = c.B, c.x.device
    path = torch.full((B, c.tree.max_depth + 2), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    zeros = lambda: torch.zeros(B, dtype=torch.int64, device=dev)
    return path, zeros(), zeros(), torch.arange(B, device=dev)


def drawer(c: TreeInputs, rng, op: str, draw: Callable[[int, int], Tensor] | None) -> Callable[[int, int], Tensor]:
    """``draw(stream, count)``: the uniforms ``[B, count]`` of a stream, from ``rng`` unless given."""
    plan = ((STREAM_ACCEPT, c.N), (STREAM_SAMPLE, c.N)) if c.method in ("rrs", "traversal") else ()
    return draw or planned(rng, op, c.B, plan, c.x.device)


def walk_draws(c: TreeInputs, rows: TargetRows, rng, op: str, draw=None) -> tuple[Tensor, Tensor, Tensor]:
    """greedy / target_only: draw at the current node, move to the child carrying the draw."""
    B, D = c.B, c.tree.max_depth
    u = None if c.method == "greedy" else drawer(c, rng, op, draw)(STREAM_SAMPLE, c.N)
    if u is None and isinstance(rng, Philox):  # greedy draws nothing; a Philox of another batch is still a mistake
        rng.keys(op, B, c.x.device)
    children = _ChildIndex(c)
    path, n, y_out, walking = _walk_start(c)
    for d in range(D + 1):
        at = slice(None) if walking.numel() == B else walking  # everyone: views, not gathers
        v = path[at, d]
        if u is None:
            y = rows.argmax(walking, v)
            kid = children.find(at, v, y)
        else:
            row = rows.at(walking, v)
            y = row.sample(u[at].gather(1, v[:, None])[:, 0])
            # a row without mass draws 0, of target probability 0: no child carrying it is accepted
            kid = torch.where(row.prob(y) > 0, children.find(at, v, y), -1)
        # the step's outcome for everyone walking; those who move overwrite n and y next step
        path[at, d + 1], n[at], y_out[at] = kid, d, y
        walking = walking[kid >= 0]
        if walking.numel() == 0:
            break
    return path[:, : D + 1], n, y_out


def walk_rrs(c: TreeInputs, rows: TargetRows, rng, op: str, draw=None) -> tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling down the tree."""
    D, t, vocab = c.tree.max_depth, c.tree, c.vocab
    draw = drawer(c, rng, op, draw)
    u_accept = draw(STREAM_ACCEPT, c.N)
    u_draw = draw(STREAM_SAMPLE, c.N)
    path, n, y_out, walking = _walk_start(c)
    width = _held_width(c, rows)
    for d in range(D + 1):
        v = path[walking, d]
        ids, r = rows.held(walking, v, width)  # owned: updated below
        kid = t.first_child[walking, v]
        q_shared = c.q[walking, kid.clamp(min=0)] if c.sampling == "without_replacement" else None
        chosen = torch.full_like(kid, -1)
        trying = (kid >= 0).nonzero()[:, 0]
        while trying.numel():
            b, k = walking[trying], kid[trying]
            xk = c.x[b, k]
            held = None if ids is None else ids[trying]
            q = q_shared[trying] if q_shared is not None else c.q[b, k] if ids is None else None
            q_x = c.q[b, k, xk] if q is None else vocab.value(q, xk)  # held rows: q read where needed only
            ok = c.usable[b, k] & accepts(u_accept[b, k], q_x, _value(r[trying], held, xk, vocab))
            chosen[trying[ok]] = k[ok]
            rej = trying[~ok]
            if q is None:
                q_rej = c.q[b[~ok, None], k[~ok, None], held[~ok]]
            else:
                q = q[~ok]
                q_rej = _at(q, None if ids is None else held[~ok])
            residual = (r[rej] - q_rej).clamp_(min=0.0)
            mass = vocab.mass(residual, keepdim=True)
            r[rej] = torch.where(mass > 0, divide_by(residual, mass), r[rej])
            if q_shared is not None:
                q_shared[rej] = vocab.normalise(vocab.zero_at(q, xk[~ok]))
            kid[rej] = t.next_sibling[walking[rej], kid[rej]]
            trying = rej[kid[rej] >= 0]
        moved = chosen >= 0
        path[walking[moved], d + 1] = chosen[moved]
        stop = (~moved).nonzero()[:, 0]
        bs = walking[stop]
        n[bs], y_out[bs] = d, _draw(r[stop], None if ids is None else ids[stop], u_draw[bs, v[stop]], vocab)
        walking = walking[moved]
        if walking.numel() == 0:
            break
    return path[:, : D + 1], n, y_out


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``min(1, num / den)`` with ``num <= 0 -> 0`` and ``den == 0 < num -> 1``."""
    return torch.where(num > 0, torch.where(num >= den, 1.0, num / den.clamp(min=1e-30)), 0.0)


def walk_traversal(c: TreeInputs, rows: TargetRows, rng, op: str, draw=None) -> tuple[Tensor, Tensor, Tensor]:
    """Traversal verification: leaves tested in depth-first order, parents updated on deletion."""
    B, D, N, dev, t, vocab = c.B, c.tree.max_depth, c.N, c.x.device, c.tree, c.vocab
    V = vocab.width
    wo = c.sampling == "without_replacement"
    draw = drawer(c, rng, op, draw)
    eta = draw(STREAM_ACCEPT, N)
    u_draw = draw(STREAM_SAMPLE, N)
    stack = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)  # the current leftmost path
    top = torch.zeros(B, dtype=torch.int64, device=dev)  # its last slot
    few = _held_width(c, rows)  # the slots' rows held by their candidates, where not 0
    mb = torch.zeros(B, D + 1, few or V, device=dev)
    ids = torch.zeros(B, D + 1, few, dtype=torch.int64, device=dev) if few else None
    ms = torch.zeros(B, D + 1, V, device=dev) if wo else None
    a = torch.zeros(B, D + 1, device=dev)
    everyone = torch.arange(B, device=dev)
    stack[:, 0], a[:, 0] = 0, 1.0

    def hold(b: Tensor, j: Tensor, node: Tensor):
        """Slot j of requests b holds the target row at ``node``."""
        cols, mb[b, j] = rows.held(b, node, few)
        if few:
            ids[b, j] = cols

    def held(b: Tensor, j: Tensor) -> Tensor | None:
        """The candidates' ids of slot j of requests b (None: whole rows)."""
        return None if ids is None else ids[b, j]

    hold(everyone, top, stack[:, 0])

    def push(b: Tensor, node: Tensor):
        """Put ``node`` (a child of the node in slot top[b]) in the next slot of requests b."""
        j, x = top[b], c.x[b, node]
        q_x = vocab.value(ms[b, j], x) if wo else c.q[b, node, x] if few else vocab.value(c.q[b, node], x)
        ratio = _ratio(a[b, j] * _value(mb[b, j], held(b, j), x, vocab), q_x)
        top[b] = j + 1
        stack[b, j + 1] = node
        a[b, j + 1] = torch.where(c.usable[b, node], ratio, 0.0)
        hold(b, j + 1, node)

    def descend(b: Tensor):
        """Extend the paths of requests b down first children to a leaf."""
        while b.numel():
            kid = t.first_child[b, stack[b, top[b]]]
            b, kid = b[kid >= 0], kid[kid >= 0]
            if wo:
                ms[b, top[b]] = c.q[b, kid]  # all children of a node share its q
            push(b, kid)

    descend(everyone)
    path = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)
    n = torch.zeros(B, dtype=torch.int64, device=dev)
    y_out = torch.zeros(B, dtype=torch.int64, device=dev)
    walking = everyone
    pos = torch.arange(D + 1, device=dev)
    for _ in range(N + 1):
        if walking.numel() == 0:
            break
        j = top[walking]
        leaf = stack[walking, j]
        accept = (j == 0) | (eta[walking, leaf] < a[walking, j])
        done = walking[accept]
        jd = top[done]
        path[done] = torch.where(pos <= jd[:, None], stack[done], -1)
        n[done] = jd
        y_out[done] = _draw(mb[done, jd], held(done, jd), u_draw[done, stack[done, jd]], vocab)
        # delete the rejected leaves; update their parents (slot j - 1)
        b = walking[~accept]
        walking = b
        if b.numel() == 0:
            break
        leaf, j = stack[b, top[b]], top[b] - 1
        q = ms[b, j] if wo else None if few else c.q[b, leaf]
        q_cols = c.q[b[:, None], leaf[:, None], ids[b, j]] if q is None else _at(q, held(b, j))  # held: no row copied
        w = (a[b, j, None] * mb[b, j] - q_cols).clamp_(min=0.0)
        mass = vocab.mass(w)
        mb[b, j] = torch.where(mass[:, None] > 0, divide_by(w, mass[:, None]), mb[b, j])
        # a = 0 (a node never accepted: its token out of range, or p(x) = 0) stays 0, even where bad
        # values (q < 0) give w mass: else such a node could be accepted once its children are deleted
        s = as_weight(mass)
        a[b, j] = torch.where((mass > 0) & (a[b, j] > 0), s / (s + 1 - a[b, j]), 0.0)
        if wo:
            ms[b, j] = vocab.normalise(vocab.zero_at(q, c.x[b, leaf]))
        top[b] = j
        sibling = t.next_sibling[b, leaf]
        more = sibling >= 0
        push(b[more], sibling[more])
        descend(b[more])
    return path, n, y_out


def expected_target_only(c: TreeInputs, p_edge: Tensor) -> Tensor:
    """Sum over nodes of the probability that the target-only walk reaches them.

    p_edge: float32 ``[B, N]``, the target probability of each node's token at its parent.
    """
    t = c.tree
    same = (t.parents[:, :, None] == t.parents[:, None, :]) & (c.x[:, :, None] == c.x[:, None, :])
    shadowed = (same & c.usable[:, None, :] & (t.sibling_rank[:, None, :] < t.sibling_rank[:, :, None])).any(2)
    edge = torch.where(c.usable & ~shadowed, p_edge, 0.0)
    reach = torch.ones(c.B, c.N, device=edge.device)
    for d in range(1, t.max_depth + 1):
        at_d = t.depth == d
        reach = torch.where(at_d, reach.gather(1, t.parents.clamp(min=0)) * edge, reach)
    return torch.where(t.depth > 0, reach, 0.0).sum(1)


WALKS = {"greedy": walk_draws, "target_only": walk_draws, "rrs": walk_rrs, "traversal": walk_traversal}
