"""Chain and tree verification on vocabulary shards in few rounds: every row the walk may need is processed in the
same rounds, every value a decision reads rides in a round already taken, and each sequence of renormalisations
(a node's residuals, one per rejected child) advances one step per round for all nodes at once, ahead of the walk
(docs/design.md, "Vocab-parallel"). The formulas and random numbers are the one-device walks'
(:mod:`specsampler.verify.chain`, :mod:`specsampler.verify.walks`), and so are the arithmetic and the results.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..params import RowParams
from ..sampling.distributions import Part
from ..sampling.masses import as_weight, divide_by, has_mass, nonnegative_rows, row_mass
from ..verify.chain import (
    ChainInputs,
    ChainResult,
    _block_expected,
    _leading_run,
    _result,
    accepts,
    block_a,
    block_h,
    block_tau,
    expected_of,
    token_accepted,
)
from ..verify.walks import TreeInputs, _ratio, walk_draws
from . import cost
from .draws import draw, exact_masses, local, mass_and_count, normalised_bounds, owned_values, read
from .process import fewest_rounds, process, sample
from .rounds import Layout, Task, together
from .rows import Rows
from .shard import VocabShard


def verify_chain(c: ChainInputs, x: Tensor, rp: RowParams, shard: VocabShard, u_draw: Tensor,
                 u_accept: Tensor | None, link: cost.Link) -> Task[ChainResult]:
    """Sampled chain verification (``token``, ``block``, ``target_only``) of logits ``x`` float32 ``[B * (K+1),
    shard.size]`` with the rows' parameters ``rp``; u_draw, u_accept: float32 ``[B, K+1]``, the streams' uniforms;
    ``link``: the model that decides which rows are gathered whole (:func:`gathered_width`)."""
    B, K = c.B, c.K
    dev = x.device
    batch = torch.arange(B, device=dev)
    drafts = c.x.reshape(-1)
    at_draft = (batch[:, None] * (K + 1) + torch.arange(K, device=dev)).reshape(-1)  # the rows of positions < K
    steps = [process(x, rp, shard, (at_draft, drafts))]
    if c.q is not None:
        live = torch.arange(K, device=dev) < c.num_drafts[:, None]
        steps += [read([c.q.flatten(0, 1)], torch.arange(B * K, device=dev), drafts, shard), _bad(c.q, live)]
    target, *q_read = yield from together(*steps)
    p_x = target.read.view(B, K)
    if c.method == "target_only":
        draws = (yield from sample(target, u_draw.reshape(-1), 0, shard))[0].view(B, K + 1)
        n = _leading_run((draws[:, :K] == c.x) & (p_x > 0) & c.usable)  # as the one-device op: no draft of p 0
        return _result(c, n, draws.gather(1, n[:, None])[:, 0], lambda: expected_of(c, p_x, None))
    q_x, bad = q_read[0][0].view(B, K), q_read[1]
    got = yield from _held_chain(c, target, p_x, q_x, bad, u_draw, u_accept, shard, link)  # rows held, or gathered
    if got is not None:
        return got
    p = target.probs.view(B, K + 1, -1)
    if c.method == "token":
        n = token_accepted(c, u_accept[:, 1:], p_x, q_x)
        stop = batch * (K + 1) + n
        w, lo, hi = p.flatten(0, 1)[stop], target.lo[:, stop], target.hi[:, stop]
        rejected = n < c.num_drafts
        if K and bool(rejected.any()):  # the residual max(p - q, 0) where a draft was rejected
            q = c.q.flatten(0, 1)[batch * K + n.clamp(max=K - 1)]
            # (a request that accepted every draft reads no q: its q row lies past its drafts, padding)
            residual = (w - q.masked_fill(~rejected[:, None], 0.0)).clamp_(min=0.0)
            mass = yield from exact_masses(residual)
            use = rejected & (mass.sum(0) > 0)  # a residual without mass: draw from p itself
            w = torch.where(use[:, None], residual, w)
            lo, hi = torch.where(use[None], mass, lo), torch.where(use[None], mass, hi)
        y, _ = yield from draw(w, u_draw.gather(1, n[:, None])[:, 0], lo, hi, target.layout, shard)
        return _result(c, n, y, lambda: expected_of(c, p_x, q_x))
    # block
    a = block_a(c.usable, p_x, q_x)
    w = (a[:, :K, None] * p[:, :K] - c.q).clamp_(min=0.0).flatten(0, 1)
    mass = (yield from exact_masses(w)) if K else w.new_zeros(target.lo.shape[0], 0, dtype=torch.float64)
    h = block_h(c, a, as_weight(mass.sum(0)).view(B, K))
    tau = block_tau(h, u_accept)
    bonus = batch * (K + 1) + tau
    stop, lo, hi = p.flatten(0, 1)[bonus], target.lo[:, bonus], target.hi[:, bonus]
    if K:  # the residual w_tau where tau < num_drafts and it has mass
        at = batch * K + tau.clamp(max=K - 1)
        residual = (tau < c.num_drafts) & (mass.sum(0)[at] > 0)
        stop = torch.where(residual[:, None], w[at], stop)
        lo, hi = (torch.where(residual[None], mass[:, at], t) for t in (lo, hi))
    y, _ = yield from draw(stop, u_draw.gather(1, tau[:, None])[:, 0], lo, hi, target.layout, shard)
    return _result(c, tau, y, lambda: _block_expected(h))


def _held_chain(c: ChainInputs, target, p_x: Tensor, q_x: Tensor, bad: bool, u_draw: Tensor, u_accept: Tensor,
                shard: VocabShard, link: cost.Link) -> Task[ChainResult | None]:
    """``token`` and ``block`` where every rank holds the rows the residuals and the draw read whole, or can in one
    round (:func:`_entries`: top-k rows; rows of few nonzero probabilities, or more where ``link`` makes that round
    cheaper than the two of the residual's masses and the draw): a residual ``max(a p - q, 0)`` is 0
    outside a row's entries, so that round reads the draft rows the residuals need there (``token``: the stop rows',
    none where every draft was accepted; ``block``: every position's) and the rest runs on every rank alone, the
    one-device arithmetic over the entries. None where a row is wider or, where q is read, ``bad`` (some rank's q
    holds a value below 0 or NaN): then the shard path."""
    B, K, dev = c.B, c.K, p_x.device
    batch = torch.arange(B, device=dev)
    q = c.q.flatten(0, 1)
    if c.method == "token":
        n = token_accepted(c, u_accept[:, 1:], p_x, q_x)
        rejected = n < c.num_drafts
        some = K and bool(rejected.any())  # the residual max(p - q, 0) where a draft was rejected
        # on the shards' columns: the residual's masses (where some draft was rejected), then the draw
        width = gathered_width(link, shard, target, B, B if some else 0, 2 if some else 1)
        stop, q_rows, q_of = batch * (K + 1) + n, batch * K + n.clamp(max=K - 1), batch
        if not some:
            q_rows, q_of = batch[:0], batch[:0]
        W = _entries_width(target, stop, q_rows, bad, width)
        got = None if W is None else (yield from _entries(target, stop, q, q_rows, q_of, shard, W))
        if got is None:
            return None
        w, ids, q_stop = got
        if some:
            residual = (w - q_stop.masked_fill(~rejected[:, None], 0.0)).clamp_(min=0.0)  # (past the drafts: padding)
            w = torch.where((rejected & has_mass(residual))[:, None], residual, w)  # none: draw from p itself
        return _result(c, n, _held_draw(w, ids, u_draw.gather(1, n[:, None])[:, 0]), lambda: expected_of(c, p_x, q_x))
    if not K:
        return None
    drafted = (batch[:, None] * (K + 1) + torch.arange(K, device=dev)).reshape(-1)
    width = gathered_width(link, shard, target, B * (K + 1), B * K, 2)  # on the shards: residuals' masses, draw
    every, q_rows = torch.arange(B * (K + 1), device=dev), torch.arange(B * K, device=dev)
    W = _entries_width(target, every, q_rows, bad, width)
    got = None if W is None else (yield from _entries(target, every, q, q_rows, drafted, shard, W))
    if got is None:
        return None
    probs, every_ids, q = got
    a = block_a(c.usable, p_x, q_x)
    w = (a[:, :K].reshape(-1, 1) * probs[drafted] - q).clamp_(min=0.0)
    mass = row_mass(w)
    h = block_h(c, a, as_weight(mass).view(B, K))
    tau = block_tau(h, u_accept)
    bonus = batch * (K + 1) + tau
    at = batch * K + tau.clamp(max=K - 1)
    residual = ((tau < c.num_drafts) & (mass[at] > 0))[:, None]  # the residual w_tau, else the bonus row p_tau
    stop = torch.where(residual, w[at], probs[bonus])
    ids = torch.where(residual, every_ids[drafted[at]], every_ids[bonus])  # rows indexed once: ids may be expanded
    return _result(c, tau, _held_draw(stop, ids, u_draw.gather(1, tau[:, None])[:, 0]), lambda: _block_expected(h))


def verify_tree(c: TreeInputs, x: Tensor, rp: RowParams, shard: VocabShard, u_draw: Tensor,
                u_accept: Tensor | None, link: cost.Link) -> Task[tuple[Tensor, Tensor, Tensor]]:
    """Sampled tree verification (``target_only``, ``rrs``, ``traversal``) of logits ``x`` float32 ``[B * N,
    shard.size]`` (rows of absent nodes unread); u_draw, u_accept: float32 ``[B, N]``; ``link``: as for
    :func:`verify_chain`. Returns the walk's path ``[B, D+1]``, accepted counts and emitted tokens, as
    :data:`specsampler.verify.walks.WALKS`."""
    t = c.tree
    present = (t.depth >= 0).reshape(-1).nonzero()[:, 0]
    row_of = torch.full((c.B * c.N,), -1, dtype=torch.int64, device=x.device)
    row_of[present] = torch.arange(present.numel(), device=x.device)
    nodes = _Nodes(c, row_of.view(c.B, c.N))
    if c.method == "target_only":  # a draw at every node, then the walk along them
        target = yield from process(x[present], rp.take(present), shard)
        drawn, drawn_p = (yield from sample(target, u_draw.reshape(-1)[present], 0, shard))[:2]
        y = torch.zeros(c.B * c.N, dtype=torch.int64, device=x.device)
        p_y = torch.zeros(c.B * c.N, device=x.device)
        y[present], p_y[present] = drawn, drawn_p
        return walk_draws(c, _Drawn(y.view(c.B, c.N), p_y.view(c.B, c.N)), None, "", lambda stream, count: u_draw)
    # the target at every node, read at its first child's token; every child's draft probability at its token
    child = (t.depth > 0).nonzero(as_tuple=True)
    kid = t.first_child[nodes.b, nodes.v]
    rp = rp.take(present)
    # without replacement, the shared q's renormalisations in the processing's rounds (as many as it surely takes)
    shared = _SharedQ(c, nodes, shard) if c.sampling == "without_replacement" and nodes.b.numel() else None
    target, (q_x,), bad, *_ = yield from together(
        process(x[present], rp, shard, (nodes.row(nodes.b, nodes.v), c.x[nodes.b, kid])),
        read([c.q.flatten(0, 1)], child[0] * c.N + child[1], c.x[child], shard), _bad(c.q, t.depth > 0),
        *([shared.advance(fewest_rounds(rp, shard.vocab_size))] if shared is not None else []))
    q_at = torch.zeros(c.B, c.N, device=x.device)
    q_at[child] = q_x
    walk = _rrs if c.method == "rrs" else _traversal
    compact = None
    if c.sampling == "iid" or shared is not None:  # the walk on every rank alone where the rows are held, or can be
        held = yield from _candidates(c, nodes, target, bad, shared, shard, link)
        if held is not None:
            target, compact = held
    return (yield from walk(c, nodes, target, q_at, shard, u_draw, u_accept, compact, shared))


class _Compact:
    """The walk on every rank alone, where every rank holds each row whole (:func:`_entries`): a row's residuals are
    0 outside its entries (``max(r - q, 0)`` with ``r`` 0 there and ``q >= 0``), so with the children's q at their
    parent's entries no residual needs a round, nor the draw.

    ids: int64 ``[s, C]``, the entries (increasing ids) of each node with children (``nodes``' slots). i.i.d.: q
    float32 ``[s, max_children, C]``, each child's q there (0 past the last child). Without replacement: q ``[s, C]``,
    the children's shared q there after each node's removals so far, and ``shared`` (:class:`_SharedQ`), the masses
    each removal renormalises by (a round for each one not yet known)."""

    def __init__(self, ids: Tensor, q: Tensor, shared: _SharedQ | None = None):
        self.ids, self.q, self.shared = ids, q, shared

    def value(self, w: Tensor, act: Tensor, x: Tensor) -> Tensor:
        """float32 ``[a]``: rows ``w`` ``[a, C]`` over the entries of nodes ``act`` at global ids ``x`` ``[a]`` (0
        where absent, or -1)."""
        return Part(None, self.ids[act], w).prob(x)

    def q_of(self, act: Tensor, k: Tensor | int) -> Tensor:
        """float32 ``[a, C]``: the q nodes ``act`` test their ``k``-th child with (i.i.d.: its own; without
        replacement: the shared q after ``k`` removals, ``k`` being each node's removals so far)."""
        return self.q[act] if self.shared is not None else self.q[act, k]

    def remove(self, act: Tensor, k: Tensor, x: Tensor) -> Task[Tensor]:
        """Without replacement: remove the ``k``-th child (int64 ``[a]``, at global ids ``x``) from the shared q of
        nodes ``act`` at their entries (zeroed there, renormalised by the mass :class:`_SharedQ` gives, as the shard
        path does over whole rows: the same values); returns that mass, float64 ``[a]``."""
        mass = yield from self.shared.mass_after(act, k)
        q = self.q[act]
        self.q[act] = divide_by(torch.where(self.ids[act] == x[:, None], 0.0, q), mass[:, None])
        return mass


class _SharedQ:
    """Without replacement: the q a node's children share, after each child is removed (zeroed at its token, then
    renormalised by its exact mass over every rank), as the one-device walk computes it. The sequence depends on
    the drafts alone, not on the walk, so its first rounds ride in the processing's (:meth:`advance`).

    mass: float64 ``[s, max_children]``, the mass after removing each node's ``k``-th child, known for ``k <
    known``; q: this rank's columns of the shared q after the known removals; first: before any (a walk on the
    shards' columns starts from it and updates it in place, this sequence being done with it). :meth:`gather` knows
    them all in one round, where the link makes that cheaper than a round for each."""

    def __init__(self, c, nodes: _Nodes, shard: VocabShard):
        kids = nodes.kids
        self.x = torch.where(kids >= 0, c.x[nodes.b[:, None], kids.clamp(min=0)], -1)  # each child's token
        self.first = self.q = c.q[nodes.b, kids[:, 0]]  # advance() makes new tensors: first stays as it is
        self.mass = torch.zeros(kids.shape, dtype=torch.float64, device=kids.device)
        self.known, self.shard = 0, shard

    def advance(self, steps: int) -> Task[None]:
        """The next ``steps`` masses, one a round (none past the second-to-last child: the last's is never read)."""
        for _ in range(min(steps, self.x.shape[1] - 1 - self.known)):
            zeroed = _zero_at(self.q, self.x[:, self.known], self.shard)
            got = yield [row_mass(zeroed)]
            mass = got.parts[0].sum(0)
            self.mass[:, self.known] = mass
            self.q = divide_by(zeroed, mass[:, None])
            self.known += 1

    def gather(self, layout: Layout) -> Task[None]:
        """Every mass not yet known in one round: every rank's columns of the shared q after the known removals, so
        that every rank holds its rows whole and takes the later removals alone (exact sums: the masses the rounds
        would give, and the values)."""
        got = yield [_padded(self.q, layout.widest)]
        q = layout.whole(got.parts[0])
        every = VocabShard(0, q.shape[1], self.shard.vocab_size)
        for k in range(self.known, self.x.shape[1] - 1):
            zeroed = _zero_at(q, self.x[:, k], every)
            self.mass[:, k] = row_mass(zeroed)
            q = divide_by(zeroed, self.mass[:, k, None])
        self.q, self.known = q[:, self.shard.start:self.shard.end], self.x.shape[1] - 1

    def mass_after(self, act: Tensor, k: Tensor) -> Task[Tensor]:
        """float64 ``[a]``: the masses after nodes ``act`` remove their ``k``-th children (int64 ``[a]``), with the
        rounds not yet taken; 0 for a last child (never read)."""
        need = k[k < self.x.shape[1] - 1]
        if need.numel():
            yield from self.advance(int(need.max()) + 1 - self.known)
        return torch.where(k < self.x.shape[1] - 1, self.mass[act, k.clamp(max=self.x.shape[1] - 1)], 0.0)


def _candidates(c, nodes: _Nodes, target: Rows, bad: bool, shared: _SharedQ | None, shard: VocabShard,
                link: cost.Link) -> Task[tuple[Rows, _Compact] | None]:
    """The rows as every rank holds them whole, and :class:`_Compact` for the walk: every present row, and at each
    parent's entries each child's q (i.i.d.) or the children's shared q (without replacement: ``shared``)
    (:func:`_entries`, rows as wide as ``link`` makes cheaper than the walk's rounds on the shards' columns;
    ``bad``: whether some rank's q of a child holds a value below 0 or NaN); or None."""
    b, kids = nodes.b, nodes.kids
    R = target.probs.shape[0]
    held = _all_held(target, R)
    if not b.numel() and not held:  # no node has children: the draw is the only round, as on the shards
        return None
    rows, every = nodes.row(b, nodes.v), torch.arange(R, device=b.device)
    if shared is None:
        at = (kids >= 0).nonzero(as_tuple=True)  # every child: (its parent's slot, its sibling rank)
        q_rows, q_of = b[at[0]] * c.N + kids[at], rows[at[0]]
    else:
        q_rows, q_of = b * c.N + kids[:, 0], rows
    # held, the shared q's masses not known yet, a round each; or every one from its rows gathered whole beside
    later = 0 if shared is None else max(kids.shape[1] - 1 - shared.known, 0)
    world = dist.get_world_size(shard.group)
    whole_q = later > 0 and cost.columns_cheaper(link, world, b.numel(), target.layout.widest, later)
    # on the shards' columns: every residual round, then the draw
    width = gathered_width(link, shard, target, R, q_rows.numel(), cost.walk_rounds(c.method, c.tree) + 1,
                           0 if whole_q else later)
    W = _entries_width(target, every, q_rows, bad, width)
    if W is None:
        return None
    got, *_ = yield from together(_entries(target, every, c.q.flatten(0, 1), q_rows, q_of, shard, W),
                                  *([shared.gather(target.layout)] if whole_q else []))
    if got is None:
        return None
    probs, ids, q_at = got
    if shared is None:
        q = torch.zeros(*kids.shape, ids.shape[1], device=ids.device)
        q[at] = q_at
    else:
        q = q_at
    if not held:
        target = replace(target, part=Part(None, ids, probs), part_rows=every)
    return target, _Compact(ids[rows], q, shared)


HELD_WIDTH = 64  # rows of at most this many nonzero probabilities a rank are gathered whatever the link: < 1 KiB


def gathered_width(link: cost.Link, shard: VocabShard, target: Rows, rows: int, q_rows: int, instead: int,
                   later: int = 0) -> float:
    """The most nonzero probabilities a rank may hold of a row for :func:`_entries` to gather them: at least
    :data:`HELD_WIDTH`, and more where ``link`` makes that round (``rows`` rows of ``target``, ``q_rows`` draft rows)
    and the ``later`` rounds the walk then still takes no slower than the ``instead`` rounds of the walk on the
    shards' columns (:func:`.cost.entries_width`). The same on every rank."""
    return max(HELD_WIDTH, cost.entries_width(link, dist.get_world_size(shard.group), rows, q_rows, instead, later,
                                              target.layout.widest))


def _entries(target: Rows, rows: Tensor, q: Tensor, q_rows: Tensor, q_of: Tensor, shard: VocabShard,
             W: int) -> Task[tuple[Tensor, Tensor, Tensor] | None]:
    """The processed rows ``rows`` (int64 ``[n]``) as every rank then holds them whole: probabilities float32 ``[n,
    C]`` and ids int64 ``[n, C]`` (increasing, padded with id 0 at probability 0); and the draft rows ``q_rows``
    (int64 ``[a]``) of ``q`` ``[R, size]`` at the ids of ``rows[q_of]``, float32 ``[a, C]``. ``W``: what
    :func:`_entries_width` says of these rows.

    Top-k (or greedy) rows: every rank holds them already; one round reads the q values (:func:`_q_at`; none where
    none is asked for). Other rows, every rank holding at most ``W`` nonzero probabilities of each: one round
    gathers their nonzero entries from every rank, with the q values there (the rank holding an entry holds its q),
    or their whole columns where those weigh no more (:func:`_columns`). Entries of no mass count: a residual's
    renormalisation can give them mass. None where a rank held more than ``target.count`` said (never: the flag
    sent falls back)."""
    if _all_held(target, target.probs.shape[0]):
        probs, ids = _held(target, rows)
        if not q_rows.numel():
            return probs, ids, probs.new_zeros(0, ids.shape[1])
        return probs, ids, (yield from _q_at(q, q_rows, ids[q_of], shard))
    dev, n = rows.device, rows.numel()
    sub = target.probs.index_select(0, rows)
    q_sel = q.index_select(0, q_rows)
    if target.layout.widest * (n + q_rows.numel()) <= W * (2 * n + q_rows.numel()):  # no more bytes: no ids
        return (yield from _columns(sub, q_sel, target.layout))
    nz = sub != 0
    count = nz.sum(-1)
    b, col = nz.nonzero(as_tuple=True)  # in id order within a row
    j = torch.arange(b.numel(), device=dev) - (count.cumsum(0) - count)[b]
    fits = j < W  # always: target.count bounds the nonzero entries (were it ever not, the flag sent falls back)
    b, col, j = b[fits], col[fits], j[fits]
    ids = torch.full((n, W), -1, dtype=torch.int32, device=dev)
    ids[b, j] = (col + shard.start).int()
    probs = torch.zeros(n, W, device=dev)
    probs[b, j] = sub[b, col]
    values = torch.zeros(q_rows.numel(), W, device=dev)
    if shard.size:
        values = torch.where(ids[q_of] >= 0, q_sel.gather(1, (ids[q_of].long() - shard.start).clamp(min=0)), 0.0)
    got = yield [ids, probs, values, (~fits.all()).to(dtype=torch.uint8)[None]]
    if bool(got.parts[3].any()):
        return None
    # a rank's entries of a row are in id order at the front; the ranks' ids ranges are disjoint: each rank's go
    # after those of the ranks holding lower ids (in whatever order the ranks hold their shards)
    real = got.parts[0] >= 0  # [world, n, W]
    count = real.sum(-1)
    C = max(int(count.sum(0).max()), 1)  # the most entries of a row
    at = got.layout.before(count)[..., None] + torch.arange(W, device=dev)  # each entry's place in its row
    r, i, j = real.nonzero(as_tuple=True)
    ids = torch.zeros(n, C, dtype=torch.int64, device=dev)
    ids[i, at[r, i, j]] = got.parts[0][r, i, j].long()
    probs = torch.zeros(n, C, device=dev)
    probs[i, at[r, i, j]] = got.parts[1][r, i, j]
    r, i, j = real[:, q_of].nonzero(as_tuple=True)
    values = torch.zeros(q_rows.numel(), C, device=dev)
    values[i, at[:, q_of][r, i, j]] = got.parts[2][r, i, j]
    return probs, ids, values


def _entries_width(target: Rows, rows: Tensor, q_rows: Tensor, bad: bool, width: float) -> int | None:
    """Whether :func:`_entries` holds the rows ``rows`` (every rank decides alike, before any round), as its ``W``:
    0 for top-k rows, else the most nonzero probabilities a rank holds of one of them (``target.count``), where at
    most ``width`` (and some: else the shard path is as short); None where not, or where q values are asked for and
    ``bad`` (:func:`_bad`: a q below 0 or NaN on some rank, whose ``max(a p - q, 0)`` would have mass outside the
    entries)."""
    if bad and q_rows.numel():
        return None
    if _all_held(target, target.probs.shape[0]):
        return 0
    W = int(target.count[:, rows].max()) if rows.numel() else 0
    return W if 0 < W <= width else None


def _columns(probs: Tensor, q: Tensor, layout: Layout) -> Task[tuple[Tensor, Tensor, Tensor]]:
    """:func:`_entries` by whole columns, where they weigh no more than the entries: rows ``probs`` ``[n, size]`` and
    draft rows ``q`` ``[a, size]`` of every rank side by side in id order, with ids ``0..V-1``."""
    got = yield [_padded(probs, layout.widest), _padded(q, layout.widest)]
    whole = [layout.whole(part) for part in got.parts]
    ids = torch.arange(whole[0].shape[1], device=probs.device).expand_as(whole[0])
    return whole[0], ids, whole[1]


def _padded(t: Tensor, widest: int) -> Tensor:
    """A rank's columns ``[r, size]`` padded with zeros to the widest shard's, as every rank sends them."""
    return torch.nn.functional.pad(t, (0, widest - t.shape[1]))


def _q_at(q: Tensor, rows: Tensor, ids: Tensor, shard: VocabShard) -> Task[Tensor]:
    """Draft rows ``rows`` int64 ``[n]`` of ``q`` ``[R, size]`` at global ids ``[n, C]``, on every rank, in one
    round (float32 ``[n, C]``)."""
    got = yield [owned_values(q, rows[:, None].expand_as(ids).reshape(-1), ids.reshape(-1), shard)]
    return got.parts[0].sum(0).view(ids.shape)


def _bad(q: Tensor, live: Tensor) -> Task[bool]:
    """Whether any rank's draft rows ``q`` ``[..., size]`` where ``live`` (bool ``[...]``: the rows of drafts; padding
    is never read) hold a value below 0 or NaN (their ``max(a p - q, 0)`` has mass outside a row's entries:
    :func:`_entries` does not apply), in the round it rides in."""
    got = yield [(~(nonnegative_rows(q) | ~live).all()).to(dtype=torch.uint8)[None]]
    return bool(got.parts[0].any())


def _held_draw(w: Tensor, ids: Tensor, u: Tensor) -> Tensor:
    """The one-device draw over whole rows, from rows ``w`` ``[n, C]`` over candidates ``ids`` (increasing; 0
    elsewhere): the candidates' draw (:meth:`Part.sample`: inversion in id order over exact masses, which the zeros
    between candidates do not change), and 0 for a row without mass, as over the whole row. Global ids int64
    ``[n]``."""
    return torch.where(has_mass(w), Part(None, ids, w).sample(u), 0)


class _Drawn:
    """The walk's view of the target rows when their draws are known: ``at(b, v).sample(u)`` is the draw
    ``y`` ``[B, N]`` at ``(b, v)``, ``.prob`` its target probability (``p_y`` float32 ``[B, N]``)."""

    def __init__(self, y: Tensor, p_y: Tensor):
        self.y, self.p_y = y, p_y

    def at(self, b: Tensor, node: Tensor):
        return _Fixed(self.y[b, node], self.p_y[b, node])


class _Fixed:
    def __init__(self, y: Tensor, p_y: Tensor):
        self.y, self.p_y = y, p_y

    def sample(self, u: Tensor) -> Tensor:
        return self.y

    def prob(self, y: Tensor) -> Tensor:
        return self.p_y


class _Nodes:
    """The nodes with children (``b``, ``v`` int64 ``[s]``: the states walks update), their children in sibling order
    (``kids`` ``[s, max_children]``, -1 past the last), and each present node's processed row."""

    def __init__(self, c: TreeInputs, row_of: Tensor):
        t = c.tree
        self.row_of = row_of
        self.b, self.v = (t.first_child >= 0).nonzero(as_tuple=True)
        kid = t.first_child[self.b, self.v]
        kids = []
        for _ in range(max(t.max_children, 1)):
            kids.append(kid)
            kid = torch.where(kid >= 0, t.next_sibling[self.b, kid.clamp(min=0)], -1)
        self.kids = torch.stack(kids, 1)
        self.slot = torch.full_like(row_of, -1)
        self.slot[self.b, self.v] = torch.arange(self.b.numel(), device=row_of.device)

    def row(self, b: Tensor, v: Tensor) -> Tensor:
        return self.row_of[b, v]


def _residual_round(w: Tensor, zeroed: Tensor | None, at: list[Tensor], shard: VocabShard) -> Task[list[Tensor]]:
    """One round of a sequence of renormalisations: every rank's exact mass and count of rows ``w`` ``[a, size]``
    (``[world, a]``), the total mass of ``zeroed`` rows (``[a]``, or None), and the values of ``(rows, ids)`` pairs
    ``at`` (each ``[a, size]`` rows then ``ids`` ``[a]`` global, -1 for none) on every rank."""
    ids = at[-1]
    row = torch.arange(ids.numel(), device=w.device)
    values = [owned_values(r, row, ids.clamp(min=0), shard) * (ids >= 0) for r in at[:-1]]
    sent = mass_and_count(w) + ([] if zeroed is None else [row_mass(zeroed)]) + values
    got = yield sent
    out = got.parts[:2] + [p.sum(0) for p in got.parts[2:]]
    return out


def _rrs(c, nodes: _Nodes, target, q_at: Tensor, shard, u_draw, u_accept, compact: _Compact | None,
         shared: _SharedQ | None) -> Task[tuple[Tensor, Tensor, Tensor]]:
    """Recursive rejection sampling: each node's residuals (one per rejected child, in sibling order) advance one
    a round for every node at once, the value each child is tested against riding in the round before (with
    ``compact``, on every rank alone; ``shared``: the shared q without replacement); then the walk, and one
    draw."""
    B, N, dev = c.B, c.N, q_at.device
    wo = c.sampling == "without_replacement"
    b, kids = nodes.b, nodes.kids
    # each node's current residual, updated in place: over its candidates with ``compact``, else its shard's columns
    r = _held(target, nodes.row(b, nodes.v))[0] if compact is not None else target.probs[nodes.row(b, nodes.v)]
    lo, hi = target.lo[:, nodes.row(b, nodes.v)], target.hi[:, nodes.row(b, nodes.v)]
    q_state = shared.first if shared is not None and compact is None else None  # without replacement: the shared q
    test_r = torch.zeros(B, N, device=dev)  # what each child is tested against: r and q at its token
    test_r[b, kids[:, 0]] = target.read
    test_q = q_at.clone()
    tests = lambda: c.usable & accepts(u_accept, test_q, test_r)  # noqa: E731  (each child's, once its values are set)
    for k in range(kids.shape[1]):
        if _rrs_settled(c, nodes, tests(), k):
            break  # no request's walk reads a later residual: the rounds end here, on every rank alike
        act = (kids[:, k] >= 0).nonzero()[:, 0]
        if not act.numel():  # no node has children
            break
        ba, ck = b[act], kids[act, k]
        nxt = kids[act, k + 1] if k + 1 < kids.shape[1] else torch.full_like(ck, -1)
        x_k, x_n = c.x[ba, ck], torch.where(nxt >= 0, c.x[ba, nxt.clamp(min=0)], -1)
        if compact is not None:
            q = compact.q_of(act, k)
            residual = (r[act] - q).clamp_(min=0.0)
            total = row_mass(residual)
            r_n, q_n = (compact.value(t, act, x_n) for t in (r[act], q))
            if wo:  # a round where the mass after this removal is not known yet
                q_mass = yield from compact.remove(act, torch.full_like(act, k), x_k)
        else:
            q = q_state[act] if wo else c.q[ba, ck]
            residual = (r[act] - q).clamp_(min=0.0)
            zeroed = _zero_at(q, x_k, shard) if wo else None
            mass, count, *rest = yield from _residual_round(residual, zeroed, [r[act], q, x_n], shard)
            q_mass, r_n, q_n = rest if wo else (None, *rest)
            total = mass.sum(0)
            _renormalised_bounds(lo, hi, act, mass, count, total)
        r[act] = torch.where(total[:, None] > 0, divide_by(residual, total[:, None]), r[act])
        if wo and compact is None:
            q_state[act] = divide_by(zeroed, q_mass[:, None])
        more = nxt >= 0
        test_r[ba[more], nxt[more]] = torch.where(total > 0, divide_by((r_n - q_n).clamp(min=0.0), total), r_n)[more]
        if wo:
            test_q[ba[more], nxt[more]] = divide_by(torch.where(x_n == x_k, 0.0, q_n), q_mass)[more]
    path, n, stop = _walk_down(c, tests())
    y = _draw_held(stop, nodes, target, r, compact, u_draw) if compact is not None else (
        yield from _draw_at(stop, nodes, target, r, lo, hi, u_draw, shard))
    return path, n, y


def _all_held(target, R: int) -> bool:
    """Whether every one of the ``R`` processed rows is a top-k (or greedy) row, its candidates on every rank."""
    return target.part is not None and target.part.ids is not None and target.part_rows.numel() == R


def _held(target, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The processed rows ``rows`` at their candidates, as every rank holds them (:attr:`.rows.Rows.part`, which holds
    every row): probabilities float32 ``[n, C]`` and ids int64 ``[n, C]``."""
    at = torch.empty_like(target.part_rows)
    at[target.part_rows] = torch.arange(target.part_rows.numel(), device=at.device)
    at = at[rows]
    return target.part.probs[at], target.part.ids[at]


def _rrs_settled(c, nodes: _Nodes, ok: Tensor, k: int) -> bool:
    """Whether every request's rrs walk is known before the residual round ``k`` (0-based), from ``ok`` (bool ``[B,
    N]``, each child's test, read only for children of sibling rank <= k, the ones tested so far): down from the root,
    each node's first accepted child is among its tested ones, until a leaf or a node whose children were all tested
    and rejected and whose last residual is computed (at most ``k`` children). Every rank holds the same tests, so
    every rank decides alike."""
    B, kids = c.B, nodes.kids
    if not kids.shape[0]:  # no node has children: every walk ends at its root
        return True
    width = kids.shape[1]
    batch, rank = torch.arange(B, device=ok.device), torch.arange(width, device=ok.device)
    at = torch.zeros(B, dtype=torch.int64, device=ok.device)
    going = torch.ones(B, dtype=torch.bool, device=ok.device)
    settled = torch.ones_like(going)
    for _ in range(c.tree.max_depth + 1):
        slot = nodes.slot[batch, at]
        inner = going & (slot >= 0)
        row = kids[slot.clamp(min=0)]
        tested = (row >= 0) & (rank <= k)
        first = torch.where(tested & ok[batch[:, None], row.clamp(min=0)], rank, width).amin(-1)
        found = first < width
        settled &= ~inner | found | ((row >= 0).sum(-1) <= k)
        going = inner & found
        at = torch.where(going, row.gather(1, first.clamp(max=width - 1)[:, None])[:, 0], at)
    return bool(settled.all())


def _draw_held(node: Tensor, nodes: _Nodes, target, residual: Tensor, compact: _Compact, u_draw: Tensor) -> Tensor:
    """:func:`_draw_at` on every rank alone, from residuals over candidates (``residual`` ``[s, C]``, ``compact``):
    :func:`_held_draw`. Global ids ``[B]``."""
    batch = torch.arange(node.numel(), device=node.device)
    slot, row = nodes.slot[batch, node], nodes.row(batch, node)
    w, ids = _held(target, row)
    if residual.shape[0]:  # else no node has children: every draw is at a leaf
        inner, at = slot >= 0, slot.clamp(min=0)
        w = torch.where(inner[:, None], residual[at], w)
        ids = torch.where(inner[:, None], compact.ids[at], ids)
    return _held_draw(w, ids, u_draw[batch, node])


def _draw_at(node: Tensor, nodes: _Nodes, target, residual: Tensor, lo: Tensor, hi: Tensor, u_draw: Tensor,
             shard: VocabShard) -> Task[Tensor]:
    """The walk's one draw, at each request's ``node`` int64 ``[B]``: from the node's last residual (``residual``
    ``[s, size]`` with its bounds ``lo``, ``hi`` ``[world, s]``, one per node with children, in ``nodes``' slots) or,
    at a leaf, from its processed row; at the node's uniform in ``u_draw`` ``[B, N]``. Global ids ``[B]``."""
    batch = torch.arange(node.numel(), device=node.device)
    slot, row = nodes.slot[batch, node], nodes.row(batch, node)
    w, w_lo, w_hi = target.probs[row], target.lo[:, row], target.hi[:, row]
    if residual.shape[0]:  # else no node has children: every draw is at a leaf
        inner, at = slot >= 0, slot.clamp(min=0)
        w = torch.where(inner[:, None], residual[at], w)
        w_lo = torch.where(inner[None], lo[:, at], w_lo)
        w_hi = torch.where(inner[None], hi[:, at], w_hi)
    y, _ = yield from draw(w, u_draw[batch, node], w_lo, w_hi, target.layout, shard)
    return y


def _renormalised_bounds(lo: Tensor, hi: Tensor, act: Tensor, mass: Tensor, count: Tensor, total: Tensor) -> None:
    """Set, in place, the draw bounds ``lo``, ``hi`` of the nodes ``act`` whose residual has mass (``total > 0``)
    to those of the residual normalised (:func:`~.draws.normalised_bounds`); the others keep theirs."""
    new_lo, new_hi = normalised_bounds(mass, count, total)
    lo[:, act] = torch.where(total[None] > 0, new_lo, lo[:, act])
    hi[:, act] = torch.where(total[None] > 0, new_hi, hi[:, act])


def _zero_at(w: Tensor, ids: Tensor, shard: VocabShard) -> Tensor:
    """``w`` ``[a, size]`` with 0 at global ids ``[a]`` this rank holds (a new tensor)."""
    owned, col = local(ids, shard)
    if not shard.size:
        return w.clone()
    return w.scatter(1, col[:, None], torch.where(owned[:, None], 0.0, w.gather(1, col[:, None])))


def _walk_down(c, ok: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From the root, to the first child (sibling order) whose test passed (``ok`` bool ``[B, N]``), until none
    does: the path ``[B, D+1]``, its length and the node where it stops."""
    t = c.tree
    B, N, D, dev = c.B, c.N, t.max_depth, ok.device
    big = N + 1
    rank = torch.where(ok & (t.depth > 0), t.sibling_rank, big)
    best = torch.full((B, N), big, dtype=torch.int64, device=dev).scatter_reduce_(
        1, t.parents.clamp(min=0), rank, "amin")
    chosen = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    first = (rank < big) & (rank == best.gather(1, t.parents.clamp(min=0)))
    bb, cc = first.nonzero(as_tuple=True)
    chosen[bb, t.parents[bb, cc]] = cc
    path = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    at = torch.zeros(B, dtype=torch.int64, device=dev)
    n = torch.zeros(B, dtype=torch.int64, device=dev)
    batch = torch.arange(B, device=dev)
    for d in range(D):
        nxt = chosen[batch, at]
        moved = nxt >= 0
        path[moved, d + 1] = nxt[moved]
        at = torch.where(moved, nxt, at)
        n += moved.long()
    return path, n, at


def _traversal(c, nodes: _Nodes, target, q_at: Tensor, shard, u_draw, u_accept, compact: _Compact | None,
               shared: _SharedQ | None) -> Task[tuple[Tensor, Tensor, Tensor]]:
    """Traversal verification: a node's state after each deletion of a child (``Mb``, ``a``, and without replacement
    ``Ms``) depends on the tree alone, not on the draws; so every node's states advance one a round, all nodes at
    once, each child pushed (its ``a``) as soon as its parent's state before it is known. Then the first node in
    post-order whose test passes (the order the one-device walk tests them in) is accepted, and one draw.
    ``compact``, ``shared``: as for :func:`_rrs`."""
    t, B, N, dev = c.tree, c.B, c.N, q_at.device
    wo = c.sampling == "without_replacement"
    b, v, kids = nodes.b, nodes.v, nodes.kids
    rows = nodes.row(b, v)
    # each node's Mb, updated in place: over its entries with ``compact``, else its shard's columns
    mb = _held(target, rows)[0] if compact is not None else target.probs[rows]
    lo, hi = target.lo[:, rows], target.hi[:, rows]
    ms = shared.first if shared is not None and compact is None else None  # all children of a node share its q
    a = torch.zeros(B, N, device=dev)
    done = torch.full((B, N), -1, dtype=torch.int64, device=dev)  # children deleted so far; -1: not pushed
    a[:, 0], done[:, 0] = 1.0, 0
    mb_x = torch.zeros(B, N, device=dev)  # what each child's push reads: Mb and Ms (q) of its parent at its token
    mb_x[b, kids[:, 0]] = target.read
    q_x = q_at.clone()

    def descend(bb: Tensor, cc: Tensor) -> None:
        """Push children ``cc`` of requests ``bb``, then down their first children to a leaf."""
        while cc.numel():
            ratio = _ratio(a[bb, t.parents[bb, cc]] * mb_x[bb, cc], q_x[bb, cc])
            a[bb, cc] = torch.where(c.usable[bb, cc], ratio, 0.0)
            done[bb, cc] = 0
            kid = t.first_child[bb, cc]
            bb, cc = bb[kid >= 0], kid[kid >= 0]

    first = t.first_child[:, 0]
    descend(torch.arange(B, device=dev)[first >= 0], first[first >= 0])
    m = (kids >= 0).sum(1)
    post = _post_order(t)
    children = torch.zeros_like(done)
    children[b, v] = m
    passed = lambda: (t.depth == 0) | ((t.depth > 0) & (u_accept < a))  # noqa: E731  (the root always passes)
    while True:
        # a node's test is final once every child of it is deleted (a leaf's once pushed)
        if _traversal_settled(t, post, done == children, passed()):
            break  # no request's walk reads a later state: the rounds end here, on every rank alike
        j = done[b, v]
        act = ((j >= 0) & (j < m)).nonzero()[:, 0]
        if not act.numel():
            break
        ba, va, j = b[act], v[act], j[act]
        ck = kids[act, j]
        nxt = torch.where(j + 1 < kids.shape[1], kids[act, (j + 1).clamp(max=kids.shape[1] - 1)], -1)
        x_k, x_n = c.x[ba, ck], torch.where(nxt >= 0, c.x[ba, nxt.clamp(min=0)], -1)
        a_u = a[ba, va]
        if compact is not None:
            q = compact.q_of(act, j)
            w = (a_u[:, None] * mb[act] - q).clamp_(min=0.0)
            total = row_mass(w)
            w_n, mb_n = (compact.value(t, act, x_n) for t in (w, mb[act]))
            if wo:  # a round where the mass after this deletion is not known yet
                ms_n = compact.value(q, act, x_n)
                q_mass = yield from compact.remove(act, j, x_k)
        else:
            q = ms[act] if wo else c.q[ba, ck]
            w = (a_u[:, None] * mb[act] - q).clamp_(min=0.0)
            zeroed = _zero_at(q, x_k, shard) if wo else None
            mass, count, *rest = yield from _residual_round(w, zeroed, [w, mb[act]] + ([q] if wo else []) + [x_n],
                                                            shard)
            q_mass, w_n, mb_n, ms_n = rest if wo else (None, *rest, None)
            total = mass.sum(0)
            _renormalised_bounds(lo, hi, act, mass, count, total)
        s = as_weight(total)
        mb[act] = torch.where(total[:, None] > 0, divide_by(w, total[:, None]), mb[act])
        # a = 0 (a node never accepted) stays 0, even where bad values (q < 0) give w mass
        a[ba, va] = torch.where((total > 0) & (a_u > 0), s / (s + 1 - a_u), 0.0)
        done[ba, va] = j + 1
        if wo and compact is None:
            ms[act] = divide_by(zeroed, q_mass[:, None])
        more = nxt >= 0
        mb_x[ba[more], nxt[more]] = torch.where(total > 0, divide_by(w_n, total), mb_n)[more]
        if wo:
            q_x[ba[more], nxt[more]] = divide_by(torch.where(x_n == x_k, 0.0, ms_n), q_mass)[more]
        descend(ba[more], nxt[more])
    leaf = torch.where(passed(), post, N * N).argmin(-1)  # the first node in post-order whose test passes
    y = _draw_held(leaf, nodes, target, mb, compact, u_draw) if compact is not None else (
        yield from _draw_at(leaf, nodes, target, mb, lo, hi, u_draw, shard))
    batch = torch.arange(B, device=dev)
    n = t.depth[batch, leaf]
    path = torch.full((B, t.max_depth + 1), -1, dtype=torch.int64, device=dev)
    node = leaf
    for i in range(t.max_depth + 1):
        at = n - i
        path[at >= 0, at.clamp(min=0)[at >= 0]] = node[at >= 0]
        node = t.parents[batch, node.clamp(min=0)]
    return path, n, y


def _traversal_settled(t, post: Tensor, final: Tensor, passed: Tensor) -> bool:
    """Whether every request's traversal is known: the first node in post-order (``post``) whose test is ``final``
    and ``passed`` (bool ``[B, N]``) has no present node before it whose test is not yet final. Every rank holds the
    same states, so every rank decides alike."""
    N = post.shape[1]
    first = torch.where(final & passed, post, N * N).amin(-1, keepdim=True)
    return not bool(((t.depth >= 0) & ~final & (post < first)).any())


def _post_order(t) -> Tensor:
    """int64 ``[B, N]``: each present node's place in post-order (children in sibling order, then the node): the
    subtree sizes of its earlier siblings and of its ancestors' earlier siblings, plus its own subtree's less one."""
    B, N = t.parents.shape
    present = t.depth >= 0
    parent = t.parents.clamp(min=0)
    size = present.long()
    for d in range(t.max_depth, 0, -1):
        size.scatter_add_(1, parent, torch.where(t.depth == d, size, 0))
    earlier = torch.zeros_like(size)  # the subtree sizes of the earlier siblings
    kid, acc = t.first_child, torch.zeros_like(size)
    batch = torch.arange(B, device=size.device)[:, None].expand(B, N)
    for _ in range(max(t.max_children, 1)):
        has = kid >= 0
        earlier[batch[has], kid[has]] = acc[has]
        acc = acc + torch.where(has, size.gather(1, kid.clamp(min=0)), 0)
        kid = torch.where(has, t.next_sibling.gather(1, kid.clamp(min=0)), -1)
    before = earlier.clone()
    for d in range(1, t.max_depth + 1):
        before = torch.where(t.depth == d, earlier + before.gather(1, parent), before)
    return before + size - 1
