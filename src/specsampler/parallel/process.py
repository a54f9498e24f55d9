"""Row processing on vocabulary shards: :func:`process_shard` gives each rank its columns of the processed
distributions, equal value for value to :func:`specsampler.sampling.processing.process` on the whole rows.

Every decision rests on quantities the split does not change: the row maximum and greedy choice (one
``all_reduce`` of order keys, :mod:`.argmax`), elementwise weights ``exp2(x * c - m * c)`` computed as on one
device, exact fixed-point masses (:mod:`specsampler.sampling.masses`). By row kind (docs/design.md, "Vocab-parallel"):
- greedy: one-hot at the greedy choice;
- top-k: each rank's k best (logit desc, id asc), gathered and merged on every rank (``O(k)`` per row), then cut
  and normalised as on one device, replicated;
- top-p alone: the cut's weight found digit by digit in the weights' bit patterns, 6 bits a round (one
  ``all_reduce`` of ``[r, PIVOTS]`` masses each), then the ties at the cut by id (one ``all_gather`` of tie
  counts);
- neither: dense; min-p against the largest weight (one ``all_reduce``); the normalisation by the exact mass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..params import RowParams
from ..sampling.filters import _candidate_weights, _cut_candidates, _part_in_id_order, _take_params, _weights
from ..sampling.masses import divide_by, masses, top_p_target
from ..sampling.processing import _kinds
from ..sampling.rounding import in_vector_body
from ..sampling.topk import ordered_prefix
from .argmax import argmax_keys, decode
from .vocab import ShardVocab

PIVOTS = 63  # pivots per round of the top-p search: a digit of 6 bits of the weights' patterns per round
_SHIFTS = (25, 19, 13, 7, 1, 0)  # the digits of a 31-bit pattern, highest first (the last one a bit)


class ShardProcessed:
    """Processed distributions of ``R`` rows, this rank's columns: the interface of
    :class:`specsampler.sampling.distributions.Processed` that the walks use, over a :class:`ShardVocab`.

    probs: float32 ``[R, shard.size]``; vocab: the shard; fallback: int64 ``[R]``, the draw of a row without
    mass (0; for a row held as candidates on one device, as top-k rows are, its lowest candidate id)."""

    def __init__(self, probs: Tensor, vocab: ShardVocab, fallback: Tensor):
        self.probs, self.vocab, self.fallback = probs, vocab, fallback
        self.num_rows = probs.shape[0]

    def dense(self) -> Tensor:
        return self.probs

    def select(self, rows: Tensor) -> ShardProcessed:
        return ShardProcessed(self.probs.index_select(0, rows), self.vocab, self.fallback.index_select(0, rows))

    def sample(self, u: Tensor) -> Tensor:
        return self.vocab.draw(self.probs, u, self.fallback)

    def prob(self, tokens: Tensor) -> Tensor:
        return self.vocab.value(self.probs, tokens)

    def top(self, n: int) -> tuple[Tensor, Tensor]:
        """The ``n`` most likely tokens per row (prob desc, id asc): ids int64 ``[R, n]`` (-1 past the support)
        and log-probabilities, as :meth:`Processed.top` gives them: each rank's ``n`` best, gathered, merged."""
        probs, ids = _merge(self.vocab, *_local_best(self.probs, n, self.vocab, 0.0), n)
        return torch.where(probs > 0, ids, -1), in_vector_body(torch.log, probs)


def _local_best(scores: Tensor, n: int, vocab: ShardVocab, pad_value: float) -> tuple[Tensor, Tensor]:
    """This shard's ``n`` best (score desc, NaN first; id asc) per row, padded with ``pad_value`` at ids past
    ``V``: float32 ``[R, n]`` and global ids int64 ``[R, n]``."""
    R, size = scores.shape
    k = min(n, size)
    if k:
        vals, pos = ordered_prefix(scores, k)
    else:
        vals, pos = scores.new_zeros(R, 0), torch.zeros(R, 0, dtype=torch.int64, device=scores.device)
    pad = n - k
    ids = pos.to(scores.device) + vocab.shard.start
    if pad:
        vals = torch.nn.functional.pad(vals, (0, pad), value=pad_value)
        extra = vocab.vocab_size + torch.arange(pad, device=scores.device).expand(R, pad)
        ids = torch.cat([ids, extra], 1)
    return vals, ids


def _merge(vocab: ShardVocab, vals: Tensor, ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Every rank's ``n`` best (one ``all_gather`` of values and ids), merged: the ``n`` best of the whole rows
    in (value desc, NaN first, id asc) order."""
    both = vocab.all_gather(torch.stack([vals.double(), ids.double()]))  # [world, 2, R, n]; ids < 2**53: exact
    allv = both[:, 0].permute(1, 0, 2).flatten(1).float()
    alli = both[:, 1].permute(1, 0, 2).flatten(1).long()
    by_id = alli.argsort(dim=-1)  # lower ids first: ordered_prefix breaks ties by position
    allv, alli = allv.gather(1, by_id), alli.gather(1, by_id)
    best, pos = ordered_prefix(allv, n)
    return best, alli.gather(1, pos.to(alli.device))


def process_shard(x: Tensor, rp: RowParams, vocab: ShardVocab) -> ShardProcessed:
    """:func:`specsampler.sampling.processing.process` of logits rows on shards.

    x: float32 ``[R, shard.size]``, masked tokens at -inf; rp: the rows' parameters (the same on every rank).
    """
    R, size = x.shape
    V, dev = vocab.vocab_size, x.device
    probs = torch.zeros(R, size, device=dev)
    # one round: the greedy choice and maximum of each row, and whether it holds a NaN (then, as on one device,
    # a sampled row has no mass)
    keys = torch.stack([argmax_keys(x, vocab.shard), x.isnan().any(-1).long()], -1)
    keys = vocab.all_reduce(keys, dist.ReduceOp.MAX)
    best, top = decode(keys[:, 0])
    finite = torch.isfinite(top)
    greedy, bounded, nucleus, plain = _kinds(rp.temperature, rp.top_k, rp.top_p, V, True)
    top = torch.where(finite & (keys[:, 1] == 0), top, float("-inf"))[:, None]
    # greedy rows: one-hot at the choice where the row has mass (its maximum finite, NaN aside)
    owned = (best >= vocab.shard.start) & (best < vocab.shard.end) & greedy & finite
    rows = owned.nonzero()[:, 0]
    probs[rows, best[rows] - vocab.shard.start] = 1.0
    fallback = torch.where(greedy, best, 0)
    for kind, fn in ((bounded & ~greedy, _top_k_rows), (nucleus, _nucleus_rows), (plain, _plain_rows)):
        rows = kind.nonzero()[:, 0]
        if rows.numel():
            probs[rows], fallback[rows] = fn(x.index_select(0, rows), top[rows], _take_params(rp, rows), vocab)
    return ShardProcessed(probs, vocab, fallback)


def _top_k_rows(x: Tensor, top: Tensor, rp: RowParams, vocab: ShardVocab) -> tuple[Tensor, Tensor]:
    """Top-k rows: the k best of the whole rows on every rank, then as on one device (replicated)."""
    k = int(rp.top_k.max())
    vals, ids = _merge(vocab, *_local_best(x, k, vocab, float("-inf")), k)
    w = _candidate_weights(vals, rp.temperature, True)
    w = torch.where(torch.arange(k, device=x.device) < rp.top_k[:, None], w, 0.0)
    part = _part_in_id_order(None, ids, _cut_candidates(w, ids, rp))
    out = torch.zeros_like(x)
    col = part.ids - vocab.shard.start
    mine = (col >= 0) & (col < vocab.shard.size)
    r, j = mine.nonzero(as_tuple=True)
    out[r, col[r, j]] = part.probs[r, j]
    return out, part.ids[:, 0]


def _normalised(w: Tensor, rp: RowParams, vocab: ShardVocab, m: Tensor | None = None) -> Tensor:
    """min-p against the row's largest weight (one ``all_reduce``), then divided by the exact mass (from the
    weights' masses ``m`` where the caller has them)."""
    if not rp.all_equal("min_p", 0):
        w_max = vocab.all_reduce(w.amax(-1, keepdim=True) if w.shape[1] else w.new_zeros(w.shape[0], 1),
                                 dist.ReduceOp.MAX)
        w = w * (w >= rp.min_p[:, None] * w_max)
    if m is None:
        return vocab.normalise(w)
    return divide_by(w, vocab.all_reduce(torch.where(w > 0, m, 0.0).sum(-1, keepdim=True)))


def _plain_rows(x: Tensor, top: Tensor, rp: RowParams, vocab: ShardVocab) -> tuple[Tensor, Tensor]:
    fallback = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    return _normalised(_weights(x, top, rp.temperature, True), rp, vocab), fallback


def _nucleus_rows(x: Tensor, top: Tensor, rp: RowParams, vocab: ShardVocab) -> tuple[Tensor, Tensor]:
    """Top-p rows without top-k: the smallest prefix of the (weight desc, id asc) order whose exact mass
    reaches ``ceil(top_p * Z)``, found by a search over the weights' bit patterns (monotone in the weight)."""
    w = _weights(x, top, rp.temperature, True)
    m = masses(w)
    z = vocab.all_reduce(m.sum(-1))
    target = top_p_target(rp.top_p, z)
    key = w.view(torch.int32)  # weights >= 0: their bit patterns order as they do
    r = x.shape[0]
    # the cut's key: the largest with at least the target above it, found digit by digit (6 bits a round, from
    # the top of the 31-bit patterns): lo holds it so far (mass above lo >= target), mass_hi is the mass above
    # the next value of the current digit
    lo = torch.zeros(r, dtype=torch.int32, device=x.device)
    mass_hi = torch.zeros(r, dtype=torch.float64, device=x.device)
    row, k, mk = None, key, m  # the first round reads the rows whole; then the tokens in lo's range, flat
    for shift in _SHIFTS:
        digit = ((k if row is None else k - lo[row]) >> shift).long()
        hist = torch.zeros(r, PIVOTS + 1, dtype=torch.float64, device=x.device)
        if row is None:
            hist.scatter_add_(1, digit, mk)
        else:
            hist.index_put_((row, digit), mk, accumulate=True)
        # the mass at or above lo + (j << shift), j = 1..63
        above = vocab.all_reduce(hist.flip(-1).cumsum(-1).flip(-1)[:, 1:]) + mass_hi[:, None]
        d = (above >= target[:, None]).sum(-1)  # a prefix of the j (the mass falls with the key): the digit
        mass_hi = torch.where(d < PIVOTS, above.gather(1, d.clamp(max=PIVOTS - 1)[:, None])[:, 0], mass_hi)
        if row is None:
            row = torch.arange(r, device=x.device)[:, None].expand_as(k)
        inside = digit == d[row]
        row, k, mk = row[inside], k[inside], mk[inside]
        lo += (d << shift).to(torch.int32)
    # the tokens above the cut's key are kept; of those at it (equal weights, equal masses), the first in id order
    # while the mass before them is below the target
    tie_mass = masses(lo.view(torch.float32)).long()  # exact integers: int64 for the division
    gap = (target - mass_hi).long()
    n_ties = torch.where(tie_mass > 0, (gap + tie_mass - 1) // tie_mass.clamp(min=1), 0)
    ties = key == lo[:, None]
    counts = vocab.all_gather(torch.stack([ties.sum(-1), torch.full_like(lo, vocab.shard.start)]))  # [world, 2, r]
    before = torch.where(counts[:, 1] < vocab.shard.start, counts[:, 0], 0).sum(0)
    tie_rank = ties.long().cumsum(-1)  # 1 for the first tie of this shard
    keep = (key > lo[:, None]) | (ties & (tie_rank <= (n_ties - before)[:, None]))
    keep &= (z > 0)[:, None]
    return _normalised(torch.where(keep, w, 0.0), rp, vocab, m), torch.zeros_like(z, dtype=torch.int64)
