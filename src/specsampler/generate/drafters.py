"""Drafters: a draft model growing a chain or a tree of tokens (:class:`ModelDrafter`, level after level of
a :class:`TreeLayout`, its draws those of :func:`specsampler.sample` on the same stream), and prompt lookup
(n-gram) proposals that need no model. How each drafts: docs/design.md, "Speculative generation".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import use_triton
from ..params import RowParams, SamplingParams
from ..rng import STREAM_SAMPLE
from ..sampling.masses import sample_processed
from ..sampling.ops import _process_prepared, _small_constants, sample
from ..sampling.processing import Processed, sample_by_inversion
from .cache import ModelCache
from .draws import Call, Draws
from .layout import TreeLayout


class RowsOf:
    """A :class:`SamplingParams`' per-row parameters for ``M`` rows per request, built (and
    validated) once per M, with the constants of the short-row processing where it applies."""

    def __init__(self, params: SamplingParams, batch: int, device: torch.device, op: str):
        self.params, self.batch, self.device, self.op = params, batch, device, op
        self._rows: dict[tuple[int, int], tuple[RowParams, tuple | None]] = {}

    def __call__(self, per_request: int, vocab: int = 0) -> tuple[RowParams, tuple | None]:
        """The rows' parameters, and their :func:`_small_constants` over ``vocab`` tokens (or None)."""
        out = self._rows.get((per_request, vocab))
        if out is None:
            rp = self.params.rows(self.op, self.batch, per_request, self.device, False)
            out = self._rows[(per_request, vocab)] = rp, _small_constants(rp, vocab) if vocab else None
        return out

    def process(self, logits: Tensor) -> Processed:
        """The processed distributions of ``logits`` ``[B, M, V]``, rows ``[B * M, V]``."""
        B, M, V = logits.shape
        return _process_prepared(logits.reshape(-1, V), *self(M, V))


def draw_rows(weights: Tensor, batch: int, call: Call, kernels: bool, positive: bool = False) -> Tensor:
    """One token per row of ``weights`` float32 ``[B * M, V]`` (request-major): the draws of
    :func:`specsampler.sample` on ``call``'s random stream (by its kernel where ``kernels``); ``positive``: every
    row has mass and no value outside [0, 1] (:func:`sample_processed`, fewer ops). int64 ``[B * M]``."""
    if kernels:
        return sample(weights.view(batch, -1, weights.shape[-1]), call.rng).view(-1)
    u = call.uniform(STREAM_SAMPLE, weights.shape[0] // batch).reshape(-1)
    return (sample_processed if positive else sample_by_inversion)(weights, u)


def draft_plan(layout: TreeLayout, how: str) -> tuple[Draws, ...]:
    """The random calls of one draft: per level, none (deterministic), one draw per node (iid),
    or one call per child rank with one draw per parent (without replacement)."""
    plan = []
    for d, c in enumerate(layout.branching, 1):
        if how == "iid":
            plan.append(((STREAM_SAMPLE, len(layout.levels[d])),))
        elif how == "without_replacement":
            plan += [((STREAM_SAMPLE, len(layout.levels[d - 1])),)] * c
    return tuple(plan)


@dataclass
class Draft:
    """A step's drafts. tokens: int64 ``[B, N]`` (node 0 the root); present: bool ``[B, N]``
    or None when every node is; q_parent: float32 ``[B, N, V]``, the distribution each node
    was drawn from (node 0: the root's own), or None when not kept; root_slot: the root's slot
    in the draft's cache."""

    tokens: Tensor
    present: Tensor | None
    q_parent: Tensor | None
    root_slot: int


class ModelDrafter:
    """A draft model proposing the layout's tree after the root: each node's children drawn from the draft's
    processed distribution at the node, one draft forward per level (docs/design.md, "Speculative generation").

    ``how``: ``iid``, ``without_replacement`` or ``deterministic``; ``keep_q``: also return the
    draft distributions (the sampled verification methods need them).
    """

    def __init__(self, state: ModelCache, layout: TreeLayout, rows: RowsOf, how: str, keep_q: bool):
        self.state, self.layout, self.rows, self.how, self.keep_q = state, layout, rows, how, keep_q
        self.vocab = 0  # the draft's vocabulary size, known after its first call
        self.kernels = use_triton(state.bias.device)
        self._alone = torch.zeros(1, 1, dtype=state.dtype, device=state.bias.device)  # a lone root's own bias

    def _probs(self, logits: Tensor) -> tuple[Tensor, bool]:
        """float32 ``[B, n, V]``: the processed distributions of ``logits`` ``[B, n, V]``; and whether every row has
        mass and no value outside [0, 1] (:attr:`Processed.positive`)."""
        proc = self.rows.process(logits)
        return proc.dense().view(logits.shape), proc.positive

    def _children(self, q: Tensor, positive: bool, c: int, calls: list[Call]) -> tuple[Tensor, Tensor | None, Tensor]:
        """``c`` children of each of the ``P`` parents of ``q`` float32 ``[B, P, V]`` (``positive``: as
        :meth:`_probs` says): tokens int64
        ``[B, P * c]`` (each parent's children together), whether each exists (bool, or None: all),
        and each child's parent row ``[B, P * c, V]``."""
        B, P, V = q.shape
        rows = q.repeat_interleave(c, 1) if c > 1 else q
        if self.how == "deterministic":
            if c <= V:
                return q.topk(c, -1).indices.reshape(B, -1), None, rows
            # more children than tokens: the V tokens are each parent's first V children, the last c - V are left
            # out (absent, as drafting without replacement leaves out the children of a used-up support)
            top = torch.zeros(B, P, c, dtype=torch.long, device=q.device)
            top[..., :V] = q.topk(V, -1).indices
            have = (torch.arange(c, device=q.device) < V).expand(B, P, c)
            return top.reshape(B, -1), have.reshape(B, -1), rows
        if self.how == "iid":
            return draw_rows(rows.reshape(-1, V), B, calls.pop(0), self.kernels, positive).view(B, -1), None, rows
        # without replacement: each draw removes its token from the parent's row; the first draws from q itself (as
        # every draw of a rank's own children, with the fewer ops of rows that all have mass where they do)
        x = draw_rows(q.reshape(-1, V), B, calls.pop(0), self.kernels, positive).view(B, P)
        has = None if positive else q.sum(-1) > 0  # None: every row has mass, every first child exists
        if c == 1:
            return x, has, rows
        left, xs, have = q.clone(), [x], [torch.ones_like(x, dtype=torch.bool) if has is None else has]
        for _ in range(c - 1):
            left.scatter_(-1, x[..., None], 0.0)
            have.append(left.sum(-1) > 0)
            x = draw_rows(left.view(-1, V), B, calls.pop(0), self.kernels).view(B, P)
            xs.append(x)
        return torch.stack(xs, 2).reshape(B, -1), torch.stack(have, 2).reshape(B, -1), rows

    def propose(self, pending: Tensor, pending_on: Tensor, P: int, pos_root: Tensor, calls: list[Call]) -> Draft:
        """Grow one tree per request after the root.

        pending: int64 ``[B, 2]``, the committed tokens the draft has not seen, the root last;
        ``pending_on`` bool ``[B, 2]`` says which exist (the root always does); ``P``: 2 when
        some request has two, else 1. pos_root: int64 ``[B]``, the root's position. ``calls``:
        this draft's random calls (:func:`draft_plan`), consumed in order.
        """
        state, layout = self.state, self.layout
        B, dev = pending.shape[0], pending.device
        toks, on = pending[:, 2 - P:], pending_on[:, 2 - P:]
        root_slot = state.slots + P - 1
        if P == 1:
            logits = state.forward(toks, pos_root[:, None], self._alone)
        else:  # the token before the root, where present, is committed and seen by the root
            positions = (pos_root[:, None] - 1 + torch.arange(2, device=dev)).clamp(min=0)
            own = torch.zeros(B, 2, 2, dtype=state.dtype, device=dev)
            own[:, 0, 1] = state.hidden
            own[:, 1, 0] = state.visible(on[:, 0])
            committed = torch.stack([on[:, 0], torch.zeros_like(on[:, 0])], 1)
            logits = state.forward(toks, positions, own, committed=committed)
        q, positive = self._probs(logits[:, -1:])
        self.vocab = q.shape[-1]
        tokens, present, q_rows = [pending[:, 1:]], None, [q]
        for d, c in enumerate(layout.branching, 1):
            x, have, parent_rows = self._children(q, positive, c, calls)
            tokens.append(x)
            q_rows.append(parent_rows)
            if have is not None or present is not None:
                present = self._present(present, have, d, B, dev)
            if d == layout.depth:
                break
            n = x.shape[1]
            bias = layout.level_bias(d, dev, state.dtype)
            q, positive = self._probs(state.forward(x, (pos_root + d)[:, None].expand(B, n), bias, prefix=root_slot))
        q_parent = torch.cat(q_rows, 1) if self.keep_q else None
        return Draft(torch.cat(tokens, 1), present, q_parent, root_slot)

    def _present(self, present: Tensor | None, have: Tensor | None, d: int, B: int, dev) -> Tensor:
        """Extend ``present`` (bool ``[B, nodes before level d]``) by level d: a child exists where
        drawn (``have``) under a present parent."""
        if present is None:
            present = torch.ones(B, self.layout.levels[d].start, dtype=torch.bool, device=dev)
        c = self.layout.branching[d - 1]
        parents = present[:, self.layout.levels[d - 1].start:].repeat_interleave(c, 1)
        return torch.cat([present, parents if have is None else parents & have], 1)


class NgramDrafter:
    """Prompt lookup: per request, the continuation of the latest earlier occurrence of the
    context's last n tokens, n from ``max_n`` down to ``min_n``; at most ``k`` tokens.

    ``contexts``: each request's tokens so far (its prompt). The occurrences of every n-gram are
    indexed as the context grows (the latest start of each), so that a proposal costs a few
    dictionary lookups; an occurrence counts once a token follows it.
    """

    def __init__(self, contexts: list[list[int]], k: int, min_n: int, max_n: int):
        self.contexts, self.k, self.sizes = contexts, k, range(max_n, min_n - 1, -1)
        self._latest = [{n: {} for n in self.sizes} for _ in contexts]
        self._indexed = [{n: 0 for n in self.sizes} for _ in contexts]

    def extend(self, b: int, tokens: list[int]) -> None:
        """Append request b's new tokens to its context."""
        self.contexts[b].extend(tokens)

    def propose(self, b: int) -> list[int]:
        """Request b's proposal (empty when its last n tokens occurred nowhere earlier, for every n)."""
        ctx = self.contexts[b]
        L = len(ctx)
        for n in self.sizes:
            latest, start = self._latest[b][n], self._indexed[b][n]
            for p in range(start, L - n):  # n-grams followed by a token: starts p <= L - n - 1
                latest[tuple(ctx[p: p + n])] = p
            self._indexed[b][n] = max(start, L - n)
            if n < L:
                p = latest.get(tuple(ctx[L - n:]))
                if p is not None:
                    return ctx[p + n: p + n + self.k]
        return []
