"""Row operations across shards, each one round (or part of one): exact masses, values at global ids, and draws by
inversion located in the round that gathers the shards' masses (docs/design.md, "Vocab-parallel").

A draw inverts ``t = floor(u * Z)`` over the exact masses of a row in id order (as
:func:`specsampler.sampling.masses.sample_by_inversion` does on one device): the owner of ``t`` is the rank whose
masses before it (in id order) and its own enclose ``t``. A rank does not know the other ranks' masses before the
round, but bounds on them: every rank's exact mass where an earlier round gave it (residuals), or, for a row
normalised by an exact mass (``p = w / Z``), the bounds :func:`normalised_bounds` proves from the weights' masses.
So each rank sends, with its exact mass, the few tokens of its shard the draw can land on given those bounds (the
*window*); after the round every rank knows ``t``, its owner, and, from the owner's window, the token. A window
too narrow for the bounds (more than :data:`WINDOW` tokens) costs one more round, where the owner sends its token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..sampling.masses import MASS_BITS, draw_target, invert, masses, row_mass
from .rounds import Layout, Task
from .shard import VocabShard

WINDOW = 8  # tokens a rank sends per draw


def normalised_bounds(mass: Tensor, count: Tensor, total: Tensor) -> tuple[Tensor, Tensor]:
    """Bounds on each rank's exact mass of ``w / weight(total)`` (float32 division, :func:`divide_by`): float64
    ``[world, n]`` (lo, hi) from each rank's mass of ``w`` (float64 ``[world, n]``) and count of ``w > 0`` (``[world,
    n]``), ``total`` float64 ``[n]`` (their sum).

    Each quotient is within ``2**-24`` of ``w / z`` (``z``: the total as a float32 weight) and each mass within 1 of
    ``w * 2**32``, so a rank's mass lies in ``[(M / z)(1 - 2**-24) - n, ((M + n) / z)(1 + 2**-24)]``; a few units
    of slack cover float64's own rounding. Rows without mass divide to 0.
    """
    z = (total / 2.0**MASS_BITS).float().double()  # the float32 weight the division uses
    n = count.double()
    lo = (mass / z * (1 - 2.0**-24) - n - 2).clamp(min=0)
    hi = (mass + n) / z * (1 + 2.0**-24) + 2
    empty = (total == 0)[None]
    return torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)


def mass_and_count(w: Tensor) -> list[Tensor]:
    """This rank's exact mass of rows ``w`` float32 ``[n, size]`` and count of ``w > 0``, float64 and int64 ``[n]``:
    what a round gathers for :func:`normalised_bounds`."""
    return [row_mass(w), (w > 0).sum(-1)]


def exact_masses(w: Tensor) -> Task[Tensor]:
    """Every rank's exact mass of rows ``w`` float32 ``[n, size]``: float64 ``[world, n]``. One round."""
    got = yield [row_mass(w)]
    return got.parts[0]


def local(ids: Tensor, shard: VocabShard) -> tuple[Tensor, Tensor]:
    """Whether this rank holds each global id (int64 ``[...]``), and its column (0 where not)."""
    col = ids - shard.start
    owned = (col >= 0) & (col < shard.size)
    return owned, torch.where(owned, col, 0)


def owned_values(rows: Tensor, row: Tensor, ids: Tensor, shard: VocabShard) -> Tensor:
    """``rows[row[i], ids[i]]`` where this rank holds ``ids[i]``, else 0 (what a rank sends so that the sum over the
    ranks is the value, exactly): rows ``[R, size]``, row and ids int64 ``[n]``."""
    owned, col = local(ids, shard)
    if not shard.size:
        return rows.new_zeros(ids.shape)
    return torch.where(owned, rows[row, col], 0)


def read(rows: list[Tensor], row: Tensor, ids: Tensor, shard: VocabShard) -> Task[list[Tensor]]:
    """The values of each of ``rows`` (``[R, size]`` each) at ``(row[i], ids[i])`` (global ids), on every rank:
    ``[n]`` each. One round."""
    got = yield [owned_values(t, row, ids, shard) for t in rows]
    return [g.sum(0) for g in got.parts]


def draw(w: Tensor, u: Tensor, lo: Tensor, hi: Tensor, layout: Layout,
         shard: VocabShard) -> Task[tuple[Tensor, Tensor]]:
    """Draws by inversion over rows held as shards, located in one round (two where a window falls short).

    w: float32 ``[n, size]`` weights in [0, 1]; u: float32 ``[n]``; lo, hi: float64 ``[world, n]``, bounds on each
    rank's exact mass of its rows (this rank's own is computed here). Returns the global ids int64 ``[n]``
    (:func:`specsampler.sampling.masses.sample_by_inversion` of the whole rows: token 0 for a row without mass) and
    ``w`` at them, float32 ``[n]``, on every rank.
    """
    n, size = w.shape
    m = masses(w)
    cum = m.cumsum(-1)
    own = cum[:, -1] if size else w.new_zeros(n, dtype=torch.float64)
    lo, hi = lo.clone(), hi.clone()
    lo[layout.rank], hi[layout.rank] = own, own
    # where t = floor(u * Z) can fall in this shard, given the bounds, in its own prefix sums
    t_lo = draw_target(u, lo.sum(0)) - layout.before(hi)[layout.rank]
    t_hi = draw_target(u, hi.sum(0)) - layout.before(lo)[layout.rank]
    ids, end, val = _window(w, m, cum, t_lo, t_hi, shard)
    got = yield [own, ids, end, val]
    mass, ids, end, val = got.parts  # [world, n], [world, n, WINDOW] ...
    total = mass.sum(0)
    t = draw_target(u, total)
    before = got.layout.before(mass)
    inside = (before <= t) & (t < before + mass)  # one rank where the row has mass
    owner = inside.long().argmax(0)
    pick = lambda x: x[owner, torch.arange(n, device=w.device)]  # noqa: E731
    t_own = t - pick(before)
    ids, end, val = pick(ids), pick(end), pick(val)
    start = end - masses(val)
    hit = (ids >= 0) & (start <= t_own[:, None]) & (t_own[:, None] < end)
    found = hit.any(-1) | (total == 0)
    token = torch.where(hit, ids, 0).amax(-1)
    value = torch.where(hit, val, 0.0).amax(-1)
    if not bool(found.all()):  # a window too narrow: the owners send their tokens
        rows = (~found).nonzero()[:, 0]
        mine = owner[rows] == layout.rank
        at = invert(cum[rows], t_own[rows]) if size else torch.zeros_like(rows)
        sent_ids = torch.where(mine, shard.start + at, 0)
        sent_val = torch.where(mine, w[rows, at] if size else w.new_zeros(rows.shape), 0.0)
        got = yield [sent_ids, sent_val]
        token[rows], value[rows] = got.parts[0].sum(0), got.parts[1].sum(0)
    return token, value


def _window(w: Tensor, m: Tensor, cum: Tensor, t_lo: Tensor, t_hi: Tensor,
            shard: VocabShard) -> tuple[Tensor, Tensor, Tensor]:
    """The :data:`WINDOW` columns of positive mass from the first whose prefix sum exceeds ``t_lo`` (those past
    ``t_hi`` padded): global ids int64 ``[n, WINDOW]`` (-1 for none), their inclusive prefix sums float64 and
    weights float32."""
    n, size = w.shape
    none = (torch.full((n, WINDOW), -1, dtype=torch.int64, device=w.device),
            w.new_zeros(n, WINDOW, dtype=torch.float64), w.new_zeros(n, WINDOW))
    if not size:
        return none
    first = torch.searchsorted(cum, t_lo.clamp(min=-1)[:, None].contiguous(), right=True)  # [n, 1]
    positive = (m > 0).long().cumsum(-1)  # the count of positive columns up to each
    before = torch.where(first > 0, positive.gather(1, (first - 1).clamp(min=0)), 0)
    want = before + 1 + torch.arange(WINDOW, device=w.device)  # the next positive columns, 1-based
    col = torch.searchsorted(positive, want.contiguous(), right=False)  # the first column with that count
    valid = col < size
    col = col.clamp(max=size - 1)
    end = cum.gather(1, col)
    valid &= (end - m.gather(1, col)) <= t_hi[:, None]
    return (torch.where(valid, shard.start + col, -1), torch.where(valid, end, 0.0),
            torch.where(valid, w.gather(1, col), 0.0))
