"""Top-p rows without top-k on shards: the nucleus (the smallest prefix of the (weight desc, id asc) order whose exact
mass reaches ``ceil(top_p * Z)``) found in usually two rounds, then min-p and the normalisation (docs/design.md,
"Vocab-parallel").

- Round 1: the row maximum (needed for exact weights) and, from each rank's weights relative to its own maximum, an
  approximate histogram of mass by quarters of an octave of weight, on bins every rank shares (by ``x * c``): every
  rank then estimates the weight interval where the nucleus ends.
- Round 2: each rank's exact mass (all weights, and those min-p keeps), and a description of the interval: the exact
  mass above it, a histogram of its mass in sub-intervals of the weights' bit patterns (more where round 1 bounds
  the interval's tokens higher: :func:`_sub_bins`), and its distinct weights
  with their counts (up to 32). Where no rank holds more distinct weights there, every rank finds the cut exactly
  (the crossing weight, and how many of the tokens at it are kept, by id); otherwise the sub-interval holding the
  crossing is described the same way in the next round. An estimate that missed (the crossing outside the interval)
  costs rounds over the rest of the range, never a wrong cut.

The weights' float32 bit patterns order as the weights do, so every interval is a range of patterns; weights
below ``2**-32`` have no mass and are never in a nucleus.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ..params import RowParams
from ..sampling.filters import _weights
from ..sampling.masses import divide_by_, masses, top_p_target
from .argmax import argmax_keys, decode
from .draws import local, normalised_bounds
from .rounds import Gathered, Layout, Task
from .rows import Rows, global_top
from .shard import VocabShard

MIN_KEY = 0x2F800000  # the bit pattern of 2**-32: lighter weights have no mass
END_KEY = 0x3F800001  # one past the pattern of 1.0, the largest weight
SUB_BINS = (64, 512)  # sub-intervals described per round: the fewest and the most (most_sub_bins)
_PER_SUB_BIN = 16  # tokens a rank in a sub-interval the description aims at (ENTRIES settle the next one)
ENTRIES = 32  # distinct weights a rank sends per round
APPROX_BINS = 128  # round 1's histogram: 32 octaves below the maximum,
PER_OCTAVE = 4  # in quarters
_MARGIN = 1e-4  # of the row's mass, around the estimated crossing
_LOG2E = math.log2(math.e)


def most_sub_bins(vocab_size: int, world: int) -> int:
    """The most sub-intervals a description divides its interval into (what :mod:`.cost` plans), from the widest
    shard of an even split: a power of two in :data:`SUB_BINS`, about one per 128 ids a rank holds (the interval
    round 1 estimates, a quarter of an octave of weight, holds a few percent of a wide nucleus's tokens)."""
    return _power_of_two(-(-vocab_size // world) // 128, SUB_BINS[1])


def _sub_bins(count: Tensor, most: int) -> int:
    """Sub-intervals for a call's descriptions, from round 1's bound on the tokens a rank holds in each row's
    interval (float64 ``[world, r]``, the same on every rank): the fewest powers of two leaving about
    :data:`_PER_SUB_BIN` of them in a sub-interval (at most ``most``), so that the description after the first
    holds at most :data:`ENTRIES` distinct weights a rank and settles the cut: three rounds, not four, for the nuclei
    of tens of thousands of tokens of a 128256-token vocabulary at world size 2 (``examples/vocab_parallel.py``),
    and no more bytes than 64 sub-intervals where the interval holds few tokens."""
    most_count = float(count.max()) if count.numel() else 0.0
    if not math.isfinite(most_count):  # a row whose interval is not an estimate's
        return most
    return _power_of_two(int(most_count) // _PER_SUB_BIN, most)


def _power_of_two(want: int, most: int) -> int:
    """The least power of two at least ``want``, within ``[SUB_BINS[0], most]``."""
    return min(max(SUB_BINS[0], 1 << max(0, want - 1).bit_length()), most)


def nucleus(x: Tensor, rp: RowParams, shard: VocabShard, reads: tuple[Tensor, Tensor]) -> Task[Rows]:
    """Top-p rows without top-k (x float32 ``[r, shard.size]``, masked at -inf) processed on the shards, with their
    probabilities at ``reads`` ``(row, id)``."""
    row, ids = reads
    r, size = x.shape
    c = torch.full_like(rp.temperature, _LOG2E).div_(rp.temperature)[:, None]  # as filters._weights
    keys = argmax_keys(x, shard)
    local_top = decode(keys)[1] if size else x.new_full((r,), float("-inf"))
    got = yield [keys, x.isnan().any(-1), *_approx_histogram(x, c, local_top)]
    _, top = global_top(got.parts[0], got.parts[1])
    lo, hi, count = _estimated_interval(got, top, c, rp.top_p)
    bins = _sub_bins(count, most_sub_bins(shard.vocab_size, dist.get_world_size(shard.group)))
    w = _weights(x, top[:, None], rp.temperature, True, shared=rp.shared is not None)
    key, m = w.view(torch.int32), masses(w)
    # min-p: the largest weight is 1 where the row has mass (exp2(0) at its maximum)
    thr = rp.min_p * torch.isfinite(top).float()
    owned, col = local(ids, shard)
    key_x, tie_x = _at_reads(key, row, col, owned)
    first = [m.sum(-1), *_over(w, key, m, thr, rp), key_x, tie_x]
    cut = _Cut(r, x.device)
    active = torch.arange(r, device=x.device)
    while active.numel():
        every = active.numel() == r  # then the rows as they are, not copies
        got = yield first + _describe(key if every else key[active], m if every else m[active], lo[active],
                                      hi[active], bins)
        if first:
            total, min_mass, min_count, key_x, tie_x = got.parts[:5]
            target = top_p_target(rp.top_p, total.sum(0))
            key_x, tie_x = key_x.sum(0), tie_x.sum(0)
            first = []
        lo, hi, active = cut.settle(got.parts[-6:], got.layout, active, lo, hi, target, min_mass, min_count, thr)
    # the kept tokens: above the cut, and this rank's share of those at it (the first, by id); min-p where it keeps
    # fewer
    cut_key = cut.key.int()[:, None]  # int32, as the patterns (no int64 copy of the rows)
    keep = key > cut_key
    b, j = (key == cut_key).nonzero(as_tuple=True)  # few: tokens of one weight
    first_of_row = torch.searchsorted(b, b, right=False)
    keep[b, j] = (torch.arange(b.numel(), device=x.device) - first_of_row) < cut.ties[cut.rank][b]
    if bool(cut.min_p.any()):
        keep = torch.where(cut.min_p[:, None], (key >= MIN_KEY) & (w >= thr[:, None]), keep)
    total = cut.mass.sum(0)
    w_x = key_x.int().view(torch.float32)
    kept_x = (key_x > cut.key[row]) | ((key_x == cut.key[row]) & (cut.before_owner(row, ids) + tie_x < cut.n_ties[row]))
    kept_x = torch.where(cut.min_p[row], (key_x >= MIN_KEY) & (w_x >= thr[row]), kept_x)
    lo, hi = normalised_bounds(cut.mass, cut.count, total)
    return Rows(divide_by_(torch.where(keep, w, 0.0), total[:, None]), lo, hi,
                divide_by_(torch.where(kept_x, w_x, 0.0), total[row]), None, None, cut.layout, cut.count)


def _over(w: Tensor, key: Tensor, m: Tensor, thr: Tensor, rp: RowParams) -> list[Tensor]:
    """The mass and count of the weights of positive mass min-p keeps (``w >= thr``), float64 and int64 ``[r]``
    (zeros where no row has min-p: then min-p never keeps fewer than top-p)."""
    if rp.all_equal("min_p", 0):
        return [m.new_zeros(m.shape[0]), key.new_zeros(key.shape[0], dtype=torch.int64)]
    over = (key >= MIN_KEY) & (w >= thr[:, None])
    return [torch.where(over, m, 0.0).sum(-1), over.sum(-1)]


def _at_reads(key: Tensor, row: Tensor, col: Tensor, owned: Tensor) -> tuple[Tensor, Tensor]:
    """At the reads this rank holds (rows ``row``, columns ``col``, int64 ``[n]``), the weight's bit pattern and how
    many ids before it on the shard have the same (int64 ``[n]``, 0 at the others' reads)."""
    key_x, tie_x = torch.zeros_like(row), torch.zeros_like(row)
    mine = owned.nonzero()[:, 0]
    if mine.numel():
        rows, at = key.index_select(0, row[mine]), col[mine]
        key_x[mine] = rows.gather(1, at[:, None])[:, 0].long()
        before = torch.arange(key.shape[1], device=key.device) < at[:, None]
        tie_x[mine] = ((rows == key_x[mine][:, None].int()) & before).sum(-1)
    return key_x, tie_x


def _approx_histogram(x: Tensor, c: Tensor, top: Tensor) -> list[Tensor]:
    """This shard's mass by quarter of an octave of weight, relative to its own maximum ``top`` (float32 ``[r]``):
    float32 ``[r, 128]``, an estimate, on bins every rank shares: ``floor(4 * x * c)`` counted down from that of the
    maximum (int64 ``[r]``); and ``top * c`` (float32 ``[r]``) to rescale it to the global maximum."""
    r = x.shape[0]
    xc, tc = x * c, top * c[:, 0]  # bins every rank computes alike (an estimate: not filters._weights' weights)
    top_bin = torch.floor(tc * PER_OCTAVE)
    below = torch.mul(xc, PER_OCTAVE).floor_()
    # bins below the maximum's; past the last (far below, -inf, NaN) into one more, dropped
    below = torch.sub(top_bin[:, None], below, out=below).clamp_(0, APPROX_BINS).nan_to_num_(nan=APPROX_BINS)
    w = xc.sub_(tc[:, None]).exp2_()
    hist = torch.zeros(r, APPROX_BINS + 1, dtype=torch.float64, device=x.device)
    hist.scatter_add_(1, below.long(), w.double())
    top_bin = torch.where(torch.isfinite(top_bin), top_bin.double(), -2.0**60).long()  # no finite logit: unused
    return [hist[:, :APPROX_BINS].float(), top_bin, tc]


def _estimated_interval(got: Gathered, top: Tensor, c: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The weights' bit patterns ``[lo, hi)`` (int64 ``[r]``) where round 1's histograms put the nucleus's end, and a
    bound on the tokens each rank holds there (float64 ``[world, r]``: a bin's mass over its least weight)."""
    hist, top_bin, tc = got.parts[2:5]  # [world, r, 128], [world, r], [world, r]
    tc_g = (top * c[:, 0]).double()
    bin_g = torch.floor(tc_g * PER_OCTAVE).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).long()
    shift = bin_g[None] - top_bin  # each rank's bins, counted from the global maximum's
    at = torch.arange(APPROX_BINS, device=top.device) - shift[..., None]
    scale = torch.exp2(tc.double() - tc_g[None]).nan_to_num(nan=0.0, posinf=0.0)
    inside = (at >= 0) & (at < APPROX_BINS)
    per_rank = torch.where(inside, hist.double().gather(-1, at.clamp(0, APPROX_BINS - 1)), 0.0) * scale[..., None]
    g = per_rank.sum(0)  # [r, 128] from the maximum's bin down
    z = g.sum(-1)
    target = top_p.double() * z
    through = g.cumsum(-1)
    near = (through - g <= target[:, None] + _MARGIN * z[:, None]) & (through >= target[:, None] - _MARGIN * z[:, None])
    j_lo = near.long().argmax(-1)
    j_hi = APPROX_BINS - 1 - near.flip(-1).long().argmax(-1)
    found = near.any(-1) & torch.isfinite(tc_g)
    # the bins' edges: bin j (counted down from the maximum's) holds the weights in [edge[j + 1], edge[j])
    j = torch.arange(APPROX_BINS + 1, device=top.device)
    edge = torch.exp2((bin_g[:, None] - j + 1).double() / PER_OCTAVE - tc_g[:, None])  # [r, 129]
    hi_w = edge.gather(1, j_lo[:, None])[:, 0] * (1 + 1e-5)
    lo_w = edge.gather(1, j_hi[:, None] + 1)[:, 0] * (1 - 1e-5)
    hi = torch.where(found & (j_lo > 0) & (hi_w < 1), _key(hi_w) + 1, END_KEY)
    lo = torch.where(found & (j_hi < APPROX_BINS - 1), _key(lo_w).clamp(min=MIN_KEY), MIN_KEY)
    bins = j[:-1]
    within = found[:, None] & (bins >= j_lo[:, None]) & (bins <= j_hi[:, None])  # no estimate: unbounded below
    count = torch.where(within, per_rank / edge[:, 1:], 0.0).nan_to_num(nan=0.0, posinf=0.0).sum(-1)
    count = torch.where(found | ~torch.isfinite(tc_g), count, math.inf)  # rows without mass: nothing to describe
    return lo, torch.maximum(hi, lo + 1), count


def _key(w: Tensor) -> Tensor:
    """The float32 bit pattern of weights ``w`` (float64, in [0, 1]), int64."""
    return w.clamp(0.0, 1.0).float().view(torch.int32).long()


def _describe(key: Tensor, m: Tensor, lo: Tensor, hi: Tensor, bins: int) -> list[Tensor]:
    """This shard's view of the interval ``[lo, hi)`` of bit patterns (int64 ``[a]``) of rows ``key`` (int32 ``[a,
    size]``) with masses ``m``: the mass and count above it (``[a]``), its mass in ``bins`` sub-intervals (float64
    ``[a, bins]``), its distinct patterns, largest first (int32 ``[a, ENTRIES]``, -1 past them) with their counts, and
    how many distinct patterns it holds."""
    a = key.shape[0]
    b, col = (key >= lo.int()[:, None]).nonzero(as_tuple=True)  # the interval and above: the nucleus's side, few
    k, mk = key[b, col].long(), m[b, col]
    up = k >= hi[b]
    above_m = torch.zeros(a, dtype=torch.float64, device=key.device).index_add_(0, b[up], mk[up])
    above_n = torch.bincount(b[up], minlength=a)
    inside = ~up & (k >= MIN_KEY)
    b, k, mk = b[inside], k[inside], mk[inside]
    sub = torch.div((k - lo[b]) * bins, (hi - lo)[b], rounding_mode="floor")
    hist = torch.zeros(a, bins, dtype=torch.float64, device=key.device).index_put_((b, sub), mk, accumulate=True)
    uniq, counts = torch.unique(b * END_KEY + (END_KEY - k), sorted=True, return_counts=True)  # row, pattern desc
    ub = torch.div(uniq, END_KEY, rounding_mode="floor")
    n_distinct = torch.bincount(ub, minlength=a)
    rank = torch.arange(uniq.numel(), device=key.device) - (n_distinct.cumsum(0) - n_distinct)[ub]
    keep = rank < ENTRIES
    ent_key = torch.full((a, ENTRIES), -1, dtype=torch.int32, device=key.device)
    ent_count = torch.zeros(a, ENTRIES, dtype=torch.int32, device=key.device)
    ent_key[ub[keep], rank[keep]] = (END_KEY - (uniq - ub * END_KEY))[keep].int()
    ent_count[ub[keep], rank[keep]] = counts[keep].int()
    return [above_m, above_n, hist, ent_key, ent_count, n_distinct]


class _Cut:
    """The cut of each row as the rounds settle it: the crossing pattern ``key`` (``END_KEY``: nothing kept), how many
    tokens at it are kept (``n_ties``, in id order), per rank (``[world, r]``) the ties at it before its shard, its
    kept ties, and its kept mass and count; ``min_p``: min-p keeps fewer (its own masses then)."""

    def __init__(self, r: int, device):
        self.key = torch.full((r,), END_KEY, dtype=torch.int64, device=device)
        self.n_ties = torch.zeros(r, dtype=torch.int64, device=device)
        self.min_p = torch.zeros(r, dtype=torch.bool, device=device)
        self.ties = self.before = self.mass = self.count = None
        self.layout: Layout | None = None
        self.rank = 0

    def before_owner(self, row: Tensor, ids: Tensor) -> Tensor:
        """For reads at ``(row, id)``: the ties at the cut on the shards before the id's."""
        return self.before[self.layout.owner(ids), row]

    def settle(self, parts, layout: Layout, active: Tensor, lo: Tensor, hi: Tensor, target: Tensor,
               min_mass: Tensor, min_count: Tensor, thr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Settle the active rows the round's descriptions (``[world, a, ...]``) decide; narrow the others'
        intervals. Returns the new ``lo``, ``hi`` (all rows) and the rows still active."""
        if self.mass is None:
            world, r = min_mass.shape
            zeros = lambda dt: torch.zeros(world, r, dtype=dt, device=min_mass.device)  # noqa: E731
            self.ties, self.before, self.mass, self.count = zeros(torch.int64), zeros(torch.int64), zeros(
                torch.float64), zeros(torch.int64)
            self.layout, self.rank = layout, layout.rank
        above_m, above_n, hist, ent_key, ent_count, n_distinct = parts
        t = target[active]
        A = above_m.sum(0)
        inside = hist.sum(0).sum(-1)
        empty = t == 0
        higher = ~empty & (t <= A)  # the crossing lies above the interval
        lower = ~empty & (t > A + inside)  # below it
        overflow = (n_distinct > ENTRIES).any(0)
        exact = ~(empty | higher | lower | overflow)
        lo, hi = lo.clone(), hi.clone()
        a_lo, a_hi = lo[active], hi[active]
        # a sub-interval: the one where the mass from the top reaches the target
        bins = hist.shape[-1]
        from_top = hist.sum(0).flip(-1).cumsum(-1)
        s = bins - 1 - (A[:, None] + from_top < t[:, None]).sum(-1).clamp(max=bins - 1)
        width = a_hi - a_lo
        sub_lo = a_lo + torch.div(s * width + bins - 1, bins, rounding_mode="floor")
        sub_hi = a_lo + torch.div((s + 1) * width + bins - 1, bins, rounding_mode="floor")
        new_lo = torch.where(higher, a_hi, torch.where(lower, MIN_KEY, sub_lo))
        new_hi = torch.where(higher, END_KEY, torch.where(lower, a_lo, sub_hi))
        lo[active], hi[active] = new_lo, new_hi
        if bool(exact.any()):
            self._exact(active[exact], t[exact], above_m[:, exact], above_n[:, exact], ent_key[:, exact],
                        ent_count[:, exact], layout, min_mass, min_count, thr)
        return lo, hi, active[~(exact | empty)]

    def _exact(self, rows, t, above_m, above_n, ent_key, ent_count, layout, min_mass, min_count, thr) -> None:
        """The cut of rows whose crossing interval every rank described whole."""
        world, a, E = ent_key.shape
        key = ent_key.long()
        w = key.clamp(min=0).int().view(torch.float32)
        level = masses(w) * ent_count * (key >= 0)  # [world, a, E]
        flat_k, flat_m = key.permute(1, 0, 2).reshape(a, -1), level.permute(1, 0, 2).reshape(a, -1)
        higher = (flat_k[:, None, :] > flat_k[:, :, None]).double()  # [a, e, e']
        same = (flat_k[:, None, :] == flat_k[:, :, None]).double()
        before = above_m.sum(0)[:, None] + (higher * flat_m[:, None, :]).sum(-1)  # the mass above each level
        at_level = (same * flat_m[:, None, :]).sum(-1)
        crosses = (flat_k >= 0) & (before < t[:, None]) & (t[:, None] <= before + at_level)
        k = torch.where(crosses, flat_k, -1).amax(-1)
        gap = torch.where(crosses, before, -1.0).amax(-1)
        unit = masses(k.int().view(torch.float32)).long()
        n_ties = torch.div((t - gap).long() + unit - 1, unit, rounding_mode="floor")
        at_k = ((key == k[None, :, None]) * ent_count).sum(-1)  # [world, a]
        ties_before = layout.before(at_k)
        kept_ties = (n_ties[None] - ties_before).clamp(min=0).minimum(at_k)
        higher_in = (key > k[None, :, None]) & (key >= 0)
        mass = above_m + (level * higher_in).sum(-1) + kept_ties * unit[None]
        count = above_n + (ent_count * higher_in).sum(-1) + kept_ties
        min_p = thr[rows] > k.int().view(torch.float32)
        self.key[rows], self.n_ties[rows], self.min_p[rows] = k, n_ties, min_p
        self.ties[:, rows], self.before[:, rows] = kept_ties, ties_before
        self.mass[:, rows] = torch.where(min_p[None], min_mass[:, rows], mass)
        self.count[:, rows] = torch.where(min_p[None], min_count[:, rows], count)
