"""Row processing on vocabulary shards in few rounds: :func:`process` gives each rank its columns of the processed
distributions, equal value for value to :func:`specsampler.sampling.processing.process` on the whole rows, with the
probabilities at some global ids on every rank.

Every decision rests on quantities the split does not change: the row maximum (an order key, :mod:`.argmax`),
elementwise weights ``exp2((x - m) * c)`` computed as on one device, exact fixed-point masses
(:mod:`specsampler.sampling.masses`). Rows of each kind run side by side, sharing rounds (docs/design.md,
"Vocab-parallel"):
- greedy and top-k rows (1 round): each rank's best candidates, gathered; the one-device filters then run on them,
  replicated on every rank;
- temperature and min-p rows (2 rounds): the maximum; then each rank's exact mass (and count) of the kept weights;
- top-p rows without top-k (:mod:`.nucleus`, usually 2 or 3 rounds).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..params import RowParams
from ..sampling.distributions import Part, _take
from ..sampling.filters import _bounded_part, _weights, keep_at_least_
from ..sampling.greedy import nan_as_minus_inf
from ..sampling.masses import divide_by_, masses
from ..sampling.processing import _kinds, _rows_of
from ..sampling.topk import ordered_prefix
from .argmax import argmax_keys
from .draws import draw, mass_and_count, normalised_bounds, owned_values
from .nucleus import nucleus
from .rounds import Task, together
from .rows import Rows, global_top
from .shard import VocabShard


def process(x: Tensor, rp: RowParams, shard: VocabShard, reads: tuple[Tensor, Tensor] | None = None,
            min_candidates: int = 0) -> Task[Rows]:
    """:func:`specsampler.sampling.processing.process` of logits rows on shards.

    x: float32 ``[R, shard.size]``, masked tokens at -inf; rp: the rows' parameters (the same on every rank); reads:
    ``(row, id)`` int64 ``[n]`` each, global ids whose processed probabilities every rank learns; min_candidates: as
    for the one-device op (the top-N log-probabilities).
    """
    R, size = x.shape
    dev = x.device
    row, ids = reads if reads is not None else (torch.zeros(0, dtype=torch.int64, device=dev),) * 2
    on_host = rp.shared if rp.shared is not None else rp  # every row's parameters as numbers, when shared
    greedy, bounded, top_p, plain = _kinds(on_host.temperature, on_host.top_k, on_host.top_p, shard.vocab_size, True)
    groups, tasks = [], []
    for fn, kind in ((_bounded, bounded), (nucleus, top_p), (_plain, plain)):
        some, rows = _rows_of(kind, R)
        if not some:
            continue
        extra = (_take(torch.as_tensor(greedy, device=dev).expand(R), rows), min_candidates) if fn is _bounded else ()
        if rows is None:  # every row (the usual case): as they are
            groups.append((torch.arange(R, device=dev), torch.ones(row.shape, dtype=torch.bool, device=dev)))
            tasks.append(fn(x, rp, shard, (row, ids), *extra))
            continue
        at = torch.full((R,), -1, dtype=torch.int64, device=dev)
        at[rows] = torch.arange(rows.numel(), device=dev)
        mine = at[row] >= 0  # the reads in these rows
        groups.append((rows, mine))
        tasks.append(fn(x.index_select(0, rows), rp.take(rows), shard, (at[row[mine]], ids[mine]), *extra))
    results = yield from together(*tasks)
    if len(results) == 1 and groups[0][0].numel() == R:  # rows of one kind (the usual case): as they are
        return results[0] if results[0].part is None else replace(results[0], part_rows=groups[0][0])
    world = results[0].lo.shape[0] if results else 1
    out = Rows(torch.zeros(R, size, device=dev), *(torch.zeros(world, R, dtype=torch.float64, device=dev),) * 2,
               torch.zeros(row.shape, device=dev), None, torch.zeros(0, dtype=torch.int64, device=dev),
               results[0].layout if results else None, torch.zeros(world, R, dtype=torch.int64, device=dev))
    out.hi = out.hi.clone()
    for res, (rows, mine) in zip(results, groups):
        out.probs[rows], out.lo[:, rows], out.hi[:, rows], out.read[mine] = res.probs, res.lo, res.hi, res.read
        out.count[:, rows] = res.count
        if res.part is not None:
            out.part, out.part_rows = res.part, rows
    return out


def fewest_rounds(rp: RowParams, V: int) -> int:
    """The fewest rounds :func:`process` takes on rows ``rp`` over ``V`` tokens, whatever their values: 1 where every
    row is a greedy or top-k row, else 2 (temperature and min-p rows take 2, top-p rows 2 or more)."""
    on_host = rp.shared if rp.shared is not None else rp
    bounded = _kinds(on_host.temperature, on_host.top_k, on_host.top_p, V, True)[1]
    return 1 if bool(torch.as_tensor(bounded).all()) else 2


def _plain(x: Tensor, rp: RowParams, shard: VocabShard, reads) -> Task[Rows]:
    """Rows with neither top-k nor top-p: the maximum, then the exact mass of the weights min-p keeps."""
    row, ids = reads
    got = yield [argmax_keys(x, shard), x.isnan().any(-1)]
    _, top = global_top(*got.parts)
    w = _weights(x, top[:, None], rp.temperature, True, shared=rp.shared is not None)
    # the largest weight is 1 where the row has mass (exp2(0) at its maximum), on whichever rank holds it
    keep_at_least_(w, rp.min_p[:, None] * torch.isfinite(top).float()[:, None])
    got = yield [*mass_and_count(w), owned_values(w, row, ids, shard)]
    mass, count, at = got.parts
    total = mass.sum(0)
    lo, hi = normalised_bounds(mass, count, total)
    return Rows(divide_by_(w, total[:, None]), lo, hi, divide_by_(at.sum(0), total[row]), None, None, got.layout,
                count)


def _bounded(x: Tensor, rp: RowParams, shard: VocabShard, reads, greedy: Tensor, min_candidates: int) -> Task[Rows]:
    """Greedy and top-k rows: every rank's best candidates, gathered; then the one-device filters on them."""
    row, ids = reads
    V = shard.vocab_size
    C = min(V, max(min_candidates, int(torch.where(greedy, 1, rp.top_k).max())))
    if bool(greedy.any()):  # the greedy choice never takes a NaN (two passes over the shard: only for greedy rows)
        x = torch.where(greedy[:, None], nan_as_minus_inf(x), x)
    vals, cand = local_best(x, C, shard, float("-inf"))
    got = yield [vals, cand]
    allv, alli = merged(*got.parts)
    part = _bounded_part(None, allv, rp, greedy, True, min_candidates, columns=alli)
    r = x.shape[0]
    probs = torch.zeros_like(x)
    owned = (part.ids >= shard.start) & (part.ids < shard.end)
    b, j = owned.nonzero(as_tuple=True)
    probs[b, part.ids[b, j] - shard.start] = part.probs[b, j]
    # each rank's exact mass, from the replicated candidates
    rank_of = got.layout.owner(part.ids)  # [r, C]
    world = got.layout.starts.numel()
    mass = torch.zeros(world, r, dtype=torch.float64, device=x.device)
    at = (rank_of.flatten(), torch.arange(r, device=x.device).repeat_interleave(part.ids.shape[1]))
    mass.index_put_(at, masses(part.probs).flatten(), accumulate=True)
    count = torch.zeros(world, r, dtype=torch.int64, device=x.device).index_put_(
        at, (part.probs != 0).flatten().long(), accumulate=True)
    read = Part(None, part.ids.index_select(0, row), part.probs.index_select(0, row)).prob(ids)
    return Rows(probs, mass, mass, read, part, None, got.layout, count)


def local_best(scores: Tensor, n: int, shard: VocabShard, pad_value: float) -> tuple[Tensor, Tensor]:
    """This shard's ``n`` best (score desc, NaN first; id asc) per row, padded with ``pad_value`` at ids past
    ``V``: float32 ``[R, n]`` and global ids int64 ``[R, n]``."""
    R, size = scores.shape
    k = min(n, size)
    if k:
        vals, pos = ordered_prefix(scores, k)
    else:
        vals, pos = scores.new_zeros(R, 0), torch.zeros(R, 0, dtype=torch.int64, device=scores.device)
    ids = pos.to(scores.device) + shard.start
    if n > k:
        vals = torch.nn.functional.pad(vals, (0, n - k), value=pad_value)
        extra = shard.vocab_size + torch.arange(n - k, device=scores.device).expand(R, n - k)
        ids = torch.cat([ids, extra], 1)
    return vals, ids


def merged(vals: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Every rank's candidates (``[world, r, n]`` values and global ids) as rows ``[r, world * n]`` in global id order,
    so that :func:`ordered_prefix` of them breaks ties by id as on the whole rows."""
    allv, alli = (t.permute(1, 0, 2).flatten(1) for t in (vals, ids))
    by_id = alli.argsort(dim=-1)
    return allv.gather(1, by_id), alli.gather(1, by_id)


def sample(rows: Rows, u: Tensor, num_logprobs: int, shard: VocabShard) -> Task[tuple[Tensor, ...]]:
    """One draw per row by inversion of ``u`` float32 ``[R]``, as :meth:`Processed.sample`, with the tokens'
    probabilities and (``num_logprobs``) each row's most likely tokens: ids int64 ``[R, n]`` (-1 past the support) and
    probabilities float32. Greedy and top-k rows locally (replicated); the others in one round (two where a draw's
    window falls short), the most likely tokens gathered in the first."""
    R = u.shape[0]
    dev = u.device
    tokens = torch.zeros(R, dtype=torch.int64, device=dev)
    probs = torch.zeros(R, device=dev)
    top_ids = torch.full((R, num_logprobs), -1, dtype=torch.int64, device=dev)
    top_probs = torch.zeros(R, num_logprobs, device=dev)
    held = torch.zeros(R, dtype=torch.bool, device=dev)
    if rows.part is not None:
        b = rows.part_rows
        held[b] = True
        tokens[b] = rows.part.sample(u[b])
        probs[b] = rows.part.prob(tokens[b])
        if num_logprobs:
            top_probs[b], top_ids[b] = rows.part.top_probs(num_logprobs)
    b = (~held).nonzero()[:, 0]
    if b.numel():
        w = rows.probs.index_select(0, b)
        tasks = [draw(w, u[b], rows.lo[:, b], rows.hi[:, b], rows.layout, shard)]
        if num_logprobs:
            tasks.append(_gathered_best(w, num_logprobs, shard))
        got = yield from together(*tasks)
        tokens[b], probs[b] = got[0]
        if num_logprobs:
            top_probs[b], top_ids[b] = got[1]
    return tokens, probs, torch.where(top_probs > 0, top_ids, -1), top_probs


def _gathered_best(w: Tensor, n: int, shard: VocabShard) -> Task[tuple[Tensor, Tensor]]:
    """The ``n`` largest of rows held as shards (value desc, id asc): every rank's ``n`` best, merged. One round."""
    got = yield list(local_best(w, n, shard, 0.0))
    allv, alli = merged(*got.parts)
    best, pos = ordered_prefix(allv, n)
    return best, alli.gather(1, pos)
