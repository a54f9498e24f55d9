"""Processed distributions held compactly (:class:`Processed`, in :class:`Part` s: candidate tokens in id
order, or dense rows), their probabilities and most likely tokens, and categorical draws by inversion over
exact masses (:mod:`.masses`): the token is the first id, in id order, whose cumulative mass exceeds
``floor(u * Z)`` (docs/design.md, "Randomness: Philox streams and counters")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .masses import invert_few_on_cpu, sample_by_inversion, sample_processed
from .rounding import in_vector_body
from .topk import ordered_prefix


@dataclass(frozen=True)
class Part:
    """Some rows of a :class:`Processed`, held one way.

    rows: int64 ``[r]``, which of the ``R`` rows these are, or ``None`` for all of them.
    ids: int64 ``[r, C]``: each row's candidate tokens in increasing id order, padded with
        id 0 at probability 0 (a row without mass: every id the token it draws, 0 or a greedy row's argmax);
        or ``None`` when the rows are dense.
    probs: float32 ``[r, C]`` aligned with ``ids``, or ``[r, V]``: normalised, 0 outside the
        kept set (a row whose kept set has no mass, e.g. all masked, is all 0).
    positive: every row has mass, no value outside [0, 1] (:func:`.masses.sample_processed` draws them).
    """

    rows: Tensor | None
    ids: Tensor | None
    probs: Tensor
    positive: bool = False

    def dense(self, vocab_size: int) -> Tensor:
        if self.ids is None:
            return self.probs
        out = torch.zeros(self.probs.shape[0], vocab_size, dtype=torch.float32, device=self.probs.device)
        return out.scatter_add_(1, self.ids, self.probs)

    def sample(self, u: Tensor) -> Tensor:
        if self.ids is not None and self.ids.shape[1] == 1:  # one candidate: it is the draw
            return self.ids[:, 0]
        few = self.ids is not None and self.probs.device.type == "cpu" and self.probs.shape[1] < 1024
        draw = sample_processed if self.positive else invert_few_on_cpu if few else sample_by_inversion
        idx = draw(self.probs, u)
        return idx if self.ids is None else self.ids.gather(1, idx[:, None])[:, 0]

    def prob(self, tokens: Tensor) -> Tensor:
        if self.ids is None:
            return self.probs.gather(1, tokens[:, None])[:, 0]
        return torch.where(self.ids == tokens[:, None], self.probs, 0.0).sum(-1)

    def top(self, n: int) -> tuple[Tensor, Tensor]:
        probs, ids = self.top_probs(n)
        return torch.where(probs > 0, ids, -1), in_vector_body(torch.log, probs)

    def top_probs(self, n: int) -> tuple[Tensor, Tensor]:
        """The ``n`` most likely tokens of each row (probability desc, id asc): probabilities float32 ``[r, n]`` and
        ids int64, padded with probability 0 and id -1 past the candidates."""
        probs, pos = ordered_prefix(self.probs, n)
        ids = pos if self.ids is None else self.ids.gather(1, pos)
        if probs.shape[1] < n:  # fewer candidates than asked: pad
            pad = n - probs.shape[1]
            probs = torch.nn.functional.pad(probs, (0, pad))
            ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
        return probs, ids


@dataclass(frozen=True)
class Processed:
    """The processed distributions of ``R`` rows over a vocabulary of ``V`` tokens, in parts."""

    parts: tuple[Part, ...]
    num_rows: int
    vocab_size: int

    def _per_row(self, fn, *row_args: Tensor) -> tuple[Tensor, ...]:
        """Run ``fn(part, *args of its rows)`` on every part and assemble its outputs ``[R, ...]``."""
        if len(self.parts) == 1 and self.parts[0].rows is None:
            out = fn(self.parts[0], *row_args)
            return out if isinstance(out, tuple) else (out,)
        outs = None
        for part in self.parts:
            res = fn(part, *(a[part.rows] for a in row_args))
            res = res if isinstance(res, tuple) else (res,)
            if outs is None:
                outs = tuple(r.new_empty((self.num_rows, *r.shape[1:])) for r in res)
            for o, r in zip(outs, res):
                o[part.rows] = r
        return outs

    @staticmethod
    def from_dense(probs: Tensor, positive: bool = False) -> Processed:
        """Distributions given as they are: float32 ``[R, V]`` (not copied); ``positive``: as :class:`Part`."""
        return Processed((Part(None, None, probs, positive),), probs.shape[0], probs.shape[1])

    @property
    def positive(self) -> bool:
        """Every row has mass, no value outside [0, 1] (:class:`Part`)."""
        return all(part.positive for part in self.parts)

    def select(self, rows: Tensor) -> Processed:
        """The distributions of ``rows`` (int64 ``[n]``, any order, repeats allowed), copied."""
        parts = []
        if len(self.parts) == 1 and self.parts[0].rows is None:
            part = self.parts[0]
            parts.append(Part(None, _take(part.ids, rows) if part.ids is not None else None, _take(part.probs, rows),
                              part.positive))
        else:
            part_of = torch.empty(self.num_rows, dtype=torch.int64, device=rows.device)
            local = torch.empty_like(part_of)
            for k, part in enumerate(self.parts):
                part_of[part.rows] = k
                local[part.rows] = torch.arange(part.rows.numel(), device=rows.device)
            for k, part in enumerate(self.parts):
                sel = (part_of[rows] == k).nonzero()[:, 0]
                if sel.numel():
                    loc = local[rows[sel]]
                    ids = _take(part.ids, loc) if part.ids is not None else None
                    parts.append(Part(sel, ids, _take(part.probs, loc)))
            if not parts:  # no rows selected
                parts.append(Part(None, None, self.parts[0].probs.new_zeros(0, self.vocab_size)))
        return Processed(tuple(parts), rows.numel(), self.vocab_size)

    def candidates(self, width: int) -> tuple[Tensor, Tensor]:
        """Rows whose every part holds candidates (``ids``), as ids int64 ``[R, width]`` in increasing order and
        probabilities float32 ``[R, width]``, padded with id 0 at probability 0 (``width``: at least any part's)."""
        if not self.num_rows:
            return (torch.zeros(0, width, dtype=torch.int64, device=self.parts[0].probs.device),
                    torch.zeros(0, width, device=self.parts[0].probs.device))
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
        return self._per_row(lambda part: (pad(part.ids), pad(part.probs)))

    def dense(self) -> Tensor:
        """float32 ``[R, V]``."""
        return self._per_row(lambda part: part.dense(self.vocab_size))[0]

    def sample(self, u: Tensor) -> Tensor:
        """One token per row by inversion of ``u`` float32 ``[R]``; int64 ``[R]``, always in ``[0, V)``."""
        return self._per_row(Part.sample, u)[0]

    def prob(self, tokens: Tensor) -> Tensor:
        """Probability of ``tokens`` int64 ``[R]`` (in ``[0, V)``); float32 ``[R]``."""
        return self._per_row(Part.prob, tokens)[0]

    def top(self, n: int) -> tuple[Tensor, Tensor]:
        """The ``n`` most likely tokens per row: ids int64 ``[R, n]`` (-1 past the support), logprobs."""
        return self._per_row(lambda part: part.top(n))


def _take(t: Tensor, rows: Tensor | None) -> Tensor:
    """Rows of ``t`` (dim 0) at int64 ``rows`` (whole rows copied: ``index_select``), or ``t`` for None."""
    return t if rows is None else t.index_select(0, rows)
