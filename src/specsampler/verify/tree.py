"""Tree verification: a tree of drafts per request, walked from the root.

Methods ``greedy``, ``target_only``, ``rrs`` (recursive rejection sampling; drafts i.i.d. or without
replacement) and ``traversal`` (Traversal Verification): conventions and formulas in docs/design.md,
"Tree verification" and "Algorithms"; random counters: "Randomness". Each step of a walk is one batched
operation over the requests still walking, and only the rows the walk visits are read (from logits:
processed). Plain loop per request: :mod:`specsampler.verify.reference`; kernel:
:mod:`specsampler.kernels.tree`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import use_triton
from ..params import RowParams, SamplingParams
from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, Philox, check_rng, kernel_randomness, uniform
from ..sampling.greedy import greedy_ids
from ..sampling.ops import _process_prepared, logit_inputs
from ..sampling.processing import SCRATCH, Processed, process, row_sum, sample_by_inversion
from ..validation import (
    check_device,
    check_logits_values,
    check_method,
    check_mode,
    check_probs_values,
    check_shape,
    check_tensor,
    check_token_values,
    fail,
)
from .token_tree import TokenTree

METHODS = ("greedy", "target_only", "rrs", "traversal")
DRAFT_SAMPLING = ("iid", "without_replacement")


@dataclass(frozen=True)
class TreeResult:
    """Outcome of a tree verification (``D = tree.max_depth``).

    path: int64 ``[B, D+1]``: node ids of the accepted path from the root (node 0), ``-1`` after.
    tokens: int64 ``[B, D+1]``: the accepted drafts, then exactly one correction or bonus
        token, then ``-1``.
    num_accepted: int64 ``[B]``: accepted drafts (the request emits ``num_accepted + 1``).
    last_node: int64 ``[B]``: the last accepted node (the root when none is accepted).
    expected_accepted: float32 ``[B]`` or None: for deterministic trees (``target_only``), the
        sum over non-root nodes of the probability that the walk reaches them, i.e. of the
        product of target probabilities along their paths (a sibling repeating an earlier
        sibling's token is never reached); ``greedy``: the count itself; None for ``rrs``
        and ``traversal``, and from logits unless asked for.
    """

    path: Tensor
    tokens: Tensor
    num_accepted: Tensor
    last_node: Tensor
    expected_accepted: Tensor | None

    @property
    def num_emitted(self) -> Tensor:
        """int64 ``[B]``: tokens the request advances by (``num_accepted + 1``)."""
        return self.num_accepted + 1


@dataclass(frozen=True)
class _Tree:
    """Validated inputs. x: int64 ``[B, N]`` clamped into ``[0, V)``; usable: non-root present
    nodes whose token is in range (the others are never accepted); q: float32 ``[B, N, V]``."""

    B: int
    N: int
    V: int
    method: str
    sampling: str
    tree: TokenTree
    x: Tensor
    x_raw: Tensor
    usable: Tensor
    q: Tensor | None


class _Rows:
    """The target distribution at (request, node) pairs, read (and processed) on demand."""

    def __init__(self, probs: Tensor | None = None, logits: Tensor | None = None, rp: RowParams | None = None,
                 mask: Tensor | None = None):
        self.probs, self.logits, self.rp, self.mask = probs, logits, rp, mask

    @staticmethod
    def _rows(t: Tensor, flat: Tensor) -> Tensor:
        """Rows ``flat`` (= b * N + node) of ``[B, N, V]``, whole rows copied."""
        return t.reshape(-1, t.shape[-1]).index_select(0, flat)

    def _logits(self, b: Tensor, node: Tensor, flat: Tensor) -> Tensor:
        """The logit rows (``flat`` = b * N + node), gathered into a scratch buffer (processing never
        keeps its input), float32."""
        V = self.logits.shape[-1]
        out = SCRATCH.get("visited logits", (flat.numel(), V), self.logits.dtype, self.logits.device)
        x = torch.index_select(self.logits.reshape(-1, V), 0, flat, out=out).float()
        return x if self.mask is None else x.masked_fill(~self.mask[b, node], float("-inf"))

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


def _check_tree(op, target, target_name, draft_tokens, tree, draft_probs, method, draft_sampling, full, logits):
    check_tensor(op, target_name, target, kind="float", ndim=3)
    B, N, V = target.shape
    if V < 1:
        fail(op, target_name, "a vocabulary dimension V >= 1", list(target.shape))
    dev = target.device
    if not isinstance(tree, TokenTree):
        fail(op, "tree", "a specsampler.TokenTree", type(tree).__name__)
    if (tree.batch_size, tree.size) != (B, N):
        fail(op, "tree", f"B = {B} requests of N = {N} nodes (as {target_name})",
             f"B = {tree.batch_size}, N = {tree.size}")
    if tree.device != dev:
        fail(op, "tree", f"a tree on {dev} (the device of {target_name}; use tree.to(device))",
             f"one on {tree.device}")
    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=2)
    check_shape(op, "draft_tokens", draft_tokens, (B, N), "[B, N]")
    check_device(op, "draft_tokens", draft_tokens, dev)
    method, q = check_method(op, method, METHODS, ("rrs", "traversal"), draft_probs, (B, N, V), "[B, N, V]", dev)
    if draft_sampling not in DRAFT_SAMPLING:
        fail(op, "draft_sampling", f"one of {DRAFT_SAMPLING}", repr(draft_sampling))
    x_raw = draft_tokens.long()
    child = tree.depth > 0
    if full:  # rows of absent nodes (and the root's draft row) are padding: not checked
        check_token_values(op, "draft_tokens", torch.where(child, x_raw, 0), V)
        present = (tree.depth >= 0)[..., None]
        if logits:
            check_logits_values(op, target_name, torch.where(present, target.float(), 0.0))
        else:
            check_probs_values(op, target_name, torch.where(present, target.float(), 1.0))
        if q is not None:
            check_probs_values(op, "draft_probs", torch.where(child[..., None], q, 1.0))
    usable = child & (x_raw >= 0) & (x_raw < V)
    return _Tree(B, N, V, method, draft_sampling, tree, x_raw.clamp(0, V - 1), x_raw, usable, q)


def _finish(c: _Tree, path: Tensor, n: Tensor, y: Tensor, expected: Tensor | None) -> TreeResult:
    """Assemble the result from the accepted path ``[B, D+1]`` (-1 padded), its length and y."""
    pos = torch.arange(path.shape[1], device=path.device)
    drafts = torch.nn.functional.pad(c.x_raw.gather(1, path[:, 1:].clamp(min=0)), (0, 1), value=-1)
    tokens = torch.where(pos < n[:, None], drafts, torch.where(pos == n[:, None], y[:, None], -1))
    last = path.gather(1, n[:, None])[:, 0]
    return TreeResult(path, tokens, n, last, None if expected is None else expected.float())


class _ChildIndex:
    """Finds, for requests at nodes, the first child (sibling order) carrying a token.

    Every usable node's key ``parent * V + token`` is listed per request in sibling-rank order,
    so that a step's lookup is one comparison of the request's keys with ``v * V + y`` and a
    first-match reduction."""

    def __init__(self, c: _Tree):
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


def _walk_start(c: _Tree) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A walk from the root: the path ``[B, D+2]`` (root, then -1; the extra column because
    nobody moves past depth D), accepted counts, emitted tokens, and the walking requests."""
    B, dev = c.B, c.x.device
    path = torch.full((B, c.tree.max_depth + 2), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    zeros = lambda: torch.zeros(B, dtype=torch.int64, device=dev)
    return path, zeros(), zeros(), torch.arange(B, device=dev)


def _drawer(c: _Tree, rng, op: str, draw: Callable[[int, int], Tensor] | None) -> Callable[[int, int], Tensor]:
    """``draw(stream, count)``: the uniforms ``[B, count]`` of a stream, from ``rng`` unless given."""
    return draw or (lambda stream, count: uniform(rng, op, c.B, count, stream, c.x.device))


def _walk_draws(c: _Tree, rows: _Rows, rng, op: str, draw=None) -> tuple[Tensor, Tensor, Tensor]:
    """greedy / target_only: draw at the current node, move to the child carrying the draw."""
    B, D = c.B, c.tree.max_depth
    u = None if c.method == "greedy" else _drawer(c, rng, op, draw)(STREAM_SAMPLE, c.N)
    if u is None and isinstance(rng, Philox):  # greedy draws nothing; a Philox of another batch is still a mistake
        rng.keys(op, B, c.x.device)
    children = _ChildIndex(c)
    path, n, y_out, walking = _walk_start(c)
    for d in range(D + 1):
        at = slice(None) if walking.numel() == B else walking  # everyone: views, not gathers
        v = path[at, d]
        y = rows.argmax(walking, v) if u is None else rows.at(walking, v).sample(u[at].gather(1, v[:, None])[:, 0])
        kid = children.find(at, v, y)
        # the step's outcome for everyone walking; those who move overwrite n and y next step
        path[at, d + 1], n[at], y_out[at] = kid, d, y
        walking = walking[kid >= 0]
        if walking.numel() == 0:
            break
    return path[:, : D + 1], n, y_out


def _walk_rrs(c: _Tree, rows: _Rows, rng, op: str, draw=None) -> tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling down the tree."""
    D, t = c.tree.max_depth, c.tree
    draw = _drawer(c, rng, op, draw)
    u_accept = draw(STREAM_ACCEPT, c.N)
    u_draw = draw(STREAM_SAMPLE, c.N)
    path, n, y_out, walking = _walk_start(c)
    for d in range(D + 1):
        v = path[walking, d]
        r = rows.at(walking, v).dense()  # owned: updated in place below
        kid = t.first_child[walking, v]
        q_shared = c.q[walking, kid.clamp(min=0)] if c.sampling == "without_replacement" else None
        chosen = torch.full_like(kid, -1)
        trying = (kid >= 0).nonzero()[:, 0]
        while trying.numel():
            b, k = walking[trying], kid[trying]
            q = q_shared[trying] if q_shared is not None else c.q[b, k]
            xk = c.x[b, k][:, None]
            ok = c.usable[b, k] & (u_accept[b, k] * q.gather(1, xk)[:, 0] < r[trying, xk[:, 0]])
            chosen[trying[ok]] = k[ok]
            rej, q = trying[~ok], q[~ok]
            residual = (r[rej] - q).clamp_(min=0.0)
            mass = row_sum(residual, keepdim=True)
            r[rej] = torch.where(mass > 0, residual / mass.clamp(min=1e-30), r[rej])
            if q_shared is not None:
                q = q.scatter(1, xk[~ok], 0.0)
                q_shared[rej] = q / row_sum(q, keepdim=True).clamp(min=1e-30)
            kid[rej] = t.next_sibling[walking[rej], kid[rej]]
            trying = rej[kid[rej] >= 0]
        moved = chosen >= 0
        path[walking[moved], d + 1] = chosen[moved]
        stop = (~moved).nonzero()[:, 0]
        bs = walking[stop]
        n[bs], y_out[bs] = d, sample_by_inversion(r[stop], u_draw[bs, v[stop]])
        walking = walking[moved]
        if walking.numel() == 0:
            break
    return path[:, : D + 1], n, y_out


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``min(1, num / den)`` with ``num <= 0 -> 0`` and ``den == 0 < num -> 1``."""
    return torch.where(num > 0, torch.where(num >= den, 1.0, num / den.clamp(min=1e-30)), 0.0)


def _walk_traversal(c: _Tree, rows: _Rows, rng, op: str, draw=None) -> tuple[Tensor, Tensor, Tensor]:
    """Traversal verification: leaves tested in depth-first order, parents updated on deletion."""
    B, D, N, V, dev, t = c.B, c.tree.max_depth, c.N, c.V, c.x.device, c.tree
    wo = c.sampling == "without_replacement"
    draw = _drawer(c, rng, op, draw)
    eta = draw(STREAM_ACCEPT, N)
    u_draw = draw(STREAM_SAMPLE, N)
    stack = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)  # the current leftmost path
    top = torch.zeros(B, dtype=torch.int64, device=dev)  # its last slot
    mb = torch.zeros(B, D + 1, V, device=dev)
    ms = torch.zeros(B, D + 1, V, device=dev) if wo else None
    a = torch.zeros(B, D + 1, device=dev)
    everyone = torch.arange(B, device=dev)
    stack[:, 0], a[:, 0] = 0, 1.0
    mb[:, 0] = rows.at(everyone, stack[:, 0]).dense()

    def push(b: Tensor, node: Tensor):
        """Put ``node`` (a child of the node in slot top[b]) in the next slot of requests b."""
        j, x = top[b], c.x[b, node]
        q_x = ms[b, j, x] if wo else c.q[b, node, x]
        ratio = _ratio(a[b, j] * mb[b, j, x], q_x)
        top[b] = j + 1
        stack[b, j + 1] = node
        a[b, j + 1] = torch.where(c.usable[b, node], ratio, 0.0)
        mb[b, j + 1] = rows.at(b, node).dense()

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
        y_out[done] = sample_by_inversion(mb[done, jd], u_draw[done, stack[done, jd]])
        # delete the rejected leaves; update their parents (slot j - 1)
        b = walking[~accept]
        walking = b
        if b.numel() == 0:
            break
        leaf, j = stack[b, top[b]], top[b] - 1
        q = ms[b, j] if wo else c.q[b, leaf]
        w = (a[b, j, None] * mb[b, j] - q).clamp_(min=0.0)
        mass = row_sum(w)
        mb[b, j] = torch.where(mass[:, None] > 0, w / mass.clamp(min=1e-30)[:, None], mb[b, j])
        # a = 0 (a node never accepted: its token out of range, or p(x) = 0) stays 0, even where bad
        # values (q < 0) give w mass: else such a node could be accepted once its children are deleted
        a[b, j] = torch.where((mass > 0) & (a[b, j] > 0), mass / (mass + 1 - a[b, j]), 0.0)
        if wo:
            q = q.scatter(1, c.x[b, leaf][:, None], 0.0)
            ms[b, j] = q / row_sum(q, keepdim=True).clamp(min=1e-30)
        top[b] = j
        sibling = t.next_sibling[b, leaf]
        more = sibling >= 0
        push(b[more], sibling[more])
        descend(b[more])
    return path, n, y_out


def _expected_target_only(c: _Tree, p_edge: Tensor) -> Tensor:
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


_STREAMS = {"greedy": (), "target_only": (STREAM_SAMPLE,), "rrs": (STREAM_ACCEPT, STREAM_SAMPLE),
            "traversal": (STREAM_ACCEPT, STREAM_SAMPLE)}  # the uniforms each walk draws, in its order


def _walk_kernel(c: _Tree, target: Tensor, rng, op: str, rp: RowParams | None = None,
                 mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The walk of ``c.method`` by its Triton kernel (the same draws as the PyTorch walks), on
    target probabilities, or on logits when the rows' parameters ``rp`` are given."""
    from ..kernels import ops

    streams = _STREAMS[c.method]
    seed, offset, u = kernel_randomness(rng, op, c.B, c.N, streams, c.x.device)
    u_accept = u[0] if STREAM_ACCEPT in streams else None
    u_sample = u[-1] if STREAM_SAMPLE in streams else None
    t = c.tree
    if rp is None:
        return ops.verify_tree(target, c.x_raw, t.first_child, t.next_sibling, c.q, c.method, c.sampling,
                               t.max_depth, seed, offset, u_accept, u_sample)
    return ops.verify_tree_from_logits(target, c.x_raw, t.first_child, t.next_sibling, c.q, c.method, c.sampling,
                                       t.max_depth, rp.temperature, rp.top_k, rp.top_p, rp.min_p, mask, seed, offset,
                                       u_accept, u_sample)


_WALKS = {"greedy": _walk_draws, "target_only": _walk_draws, "rrs": _walk_rrs, "traversal": _walk_traversal}


@torch.no_grad()
def verify_tree(
    target_probs: Tensor,
    draft_tokens: Tensor,
    tree: TokenTree,
    draft_probs: Tensor | None = None,
    *,
    method: str = "auto",
    draft_sampling: str = "iid",
    rng: torch.Generator | Philox | None = None,
    validate: str = "structure",
) -> TreeResult:
    """Verify one draft tree per request against target probabilities.

    Args:
        target_probs: float ``[B, N, V]``: row v = the target distribution after node v.
        draft_tokens: integer ``[B, N]``: node v's token (the root's is unused).
        tree: :class:`TokenTree` with B requests of N nodes, on the same device.
        draft_probs: float ``[B, N, V]``: row c = the distribution node c's token was drawn
            from (row 0 unused); for ``without_replacement`` all siblings hold their parent's
            q (before any removal). Required by ``rrs`` and ``traversal``; None for
            ``target_only``.
        method: ``"greedy"``, ``"target_only"``, ``"rrs"``, ``"traversal"`` or ``"auto"``
            (rrs with draft_probs, else target_only).
        draft_sampling: ``"iid"`` or ``"without_replacement"``: how siblings were drawn
            (rrs, traversal).
        rng: ``None``, a ``torch.Generator`` or :class:`Philox`.
        validate: ``"structure"`` or ``"full"``.
    Returns:
        :class:`TreeResult`; paths valid and tokens in ``[0, V)`` or ``-1``, whatever the values.

    Example:
        >>> import torch, specsampler as ss
        >>> tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]]))  # root; children 1, 2; 3 under 1
        >>> p = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
        >>> res = ss.verify_tree(p, torch.tensor([[0, 1, 2, 2]]), tree, method="target_only", rng=ss.Philox(0))
        >>> res.path.tolist(), res.tokens.tolist()  # the root's draw 2 is node 2's token; node 2 draws 1
        ([[0, 2, -1]], [[2, 1, -1]])
    """
    op = "verify_tree"
    full = check_mode(op, validate)
    check_rng(op, rng)
    c = _check_tree(op, target_probs, "target_probs", draft_tokens, tree, draft_probs, method, draft_sampling,
                    full, False)
    if use_triton(target_probs.device):
        path, n, y = _walk_kernel(c, target_probs, rng, op)
    else:
        path, n, y = _WALKS[c.method](c, _Rows(probs=target_probs), rng, op)
    expected = None
    if c.method == "greedy":
        expected = n.float()
    elif c.method == "target_only":
        parents = tree.parents.clamp(min=0)
        expected = _expected_target_only(c, target_probs[torch.arange(c.B)[:, None], parents, c.x].float())
    return _finish(c, path, n, y, expected)


@torch.no_grad()
def verify_tree_from_logits(
    target_logits: Tensor,
    draft_tokens: Tensor,
    tree: TokenTree,
    params: SamplingParams | None = None,
    *,
    draft_probs: Tensor | None = None,
    method: str = "auto",
    draft_sampling: str = "iid",
    rng: torch.Generator | Philox | None = None,
    vocab_mask: Tensor | None = None,
    validate: str = "structure",
    expected_accepted: bool = False,
) -> TreeResult:
    """Process the target logits per request on the rows the walk visits, then verify.

    As :func:`verify_tree`, with each request's :class:`SamplingParams` (temperature 0 =
    greedy, top-k, top-p, min-p) and ``vocab_mask`` applied to the rows the walk reads only.
    ``greedy`` takes the argmax of the masked logits.

    Args:
        target_logits: float32/bf16/fp16 ``[B, N, V]``.
        draft_tokens, tree, draft_probs, method, draft_sampling, rng, validate: as for
            :func:`verify_tree`.
        params: per-request :class:`SamplingParams` (scalars or ``[B]``).
        vocab_mask: bool, broadcastable to ``[B, N, V]``, True = allowed.
        expected_accepted: also compute ``TreeResult.expected_accepted`` for ``target_only``
            (processes every row that has children).
    Returns:
        :class:`TreeResult`.

    Example:
        >>> import torch, specsampler as ss
        >>> tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]]))
        >>> logits = torch.tensor([[[0.0, 0.0, 9.0], [9.0, 0.0, 0.0], [0.0, 9.0, 0.0], [9.0, 0.0, 0.0]]])
        >>> res = ss.verify_tree_from_logits(logits, torch.tensor([[0, 1, 2, 2]]), tree,
        ...                                  ss.SamplingParams(temperature=0.0))
        >>> res.path.tolist(), res.tokens.tolist(), res.num_accepted.tolist()
        ([[0, 2, -1]], [[2, 1, -1]], [1])
    """
    op = "verify_tree_from_logits"
    full = check_mode(op, validate)
    check_rng(op, rng)
    c = _check_tree(op, target_logits, "target_logits", draft_tokens, tree, draft_probs, method, draft_sampling,
                    full, True)
    rp, mask, _, _ = logit_inputs(op, target_logits, params, vocab_mask, full, live=tree.depth >= 0)
    rows = _Rows(logits=target_logits, rp=rp, mask=mask)
    if use_triton(target_logits.device):
        path, n, y = _walk_kernel(c, target_logits, rng, op, rp, mask)
    else:
        path, n, y = _WALKS[c.method](c, rows, rng, op)
    expected = n.float() if c.method == "greedy" else None
    if expected_accepted and c.method == "target_only":
        pb, pv = (tree.first_child >= 0).nonzero(as_tuple=True)  # each node with children, processed once
        slot = torch.full((c.B, c.N), -1, dtype=torch.int64, device=c.x.device)
        slot[pb, pv] = torch.arange(pb.numel(), device=c.x.device)
        b, node = (tree.depth > 0).nonzero(as_tuple=True)
        p_edge = torch.zeros(c.B, c.N, device=c.x.device)
        p_edge[b, node] = rows.at(pb, pv).select(slot[b, tree.parents[b, node]]).prob(c.x[b, node])
        expected = _expected_target_only(c, p_edge)
    return _finish(c, path, n, y, expected)


# ------------------------------------------------------------------- inputs a caller built (speculative_generate)


class _AllRows(_Rows):
    """Every (request, node) row processed in one pass (``proc``, None for greedy): for small
    problems, where one pass costs less than one per step of a walk. By the processing's batch
    invariance, a row reads the same as when processed with the visited rows alone."""

    def __init__(self, logits: Tensor, proc: Processed | None):
        super().__init__(logits=logits)
        self.proc = proc

    def at(self, b: Tensor, node: Tensor) -> Processed:
        return self.proc.select(self._flat(b, node))

    def argmax(self, b: Tensor, node: Tensor) -> Tensor:
        return greedy_ids(self._rows(self.logits, self._flat(b, node)))


def _verify_tree_prepared(logits: Tensor, drafts: Tensor, tree, draft_probs: Tensor | None, usable: Tensor,
                          method: str, draft_sampling: str, params: SamplingParams | None, rp: RowParams, rng,
                          draw: Callable[[int, int], Tensor], small=None) -> TreeResult:
    """:func:`verify_tree_from_logits` without its checks, for inputs the caller built and knows valid.

    logits: float32 ``[B, N, V]``; drafts: int64 ``[B, N]`` in ``[0, V)``; tree: a
    :class:`TokenTree`, or any object with its ``parents``, ``first_child``, ``next_sibling``,
    ``depth``, ``sibling_rank`` (int64 ``[B, N]``, contiguous) and ``max_depth`` (an int, at
    least the deepest present node's depth); draft_probs: float32 ``[B, N, V]`` (rrs,
    traversal) or None; usable: bool ``[B, N]``, the present non-root nodes; method: a
    resolved method; rp: the parameters of the ``B * N`` rows, and ``small`` their
    :func:`_small_constants` (or None); ``draw(stream, count)``: the uniforms the public op
    would draw from ``rng`` (kernels draw from ``rng`` themselves).
    Every row is processed at once (:class:`_AllRows`). On the CPU, greedy and target-only walks
    draw at every node at once and walk on the host (:func:`_walk_draws_host`), and one request's
    rrs or traversal walk is its plain loop (:func:`_walk_one`). The same tokens as the public op.
    """
    B, N, V = logits.shape
    c = _Tree(B, N, V, method, draft_sampling, tree, drafts, drafts, usable, draft_probs)
    cpu = logits.device.type == "cpu"
    if use_triton(logits.device):
        path, n, y = _walk_kernel(c, logits, rng, "speculative_generate", rp, None)
    else:
        proc = None if method == "greedy" else _process_prepared(logits.view(-1, V), rp, small)
        if cpu and method in ("greedy", "target_only"):
            path, n, y = _walk_draws_host(c, logits, proc, draw)
        elif cpu and B == 1:
            path, n, y = _walk_one(c, proc.dense(), draw)
        else:
            path, n, y = _WALKS[method](c, _AllRows(logits, proc), rng, "speculative_generate", draw)
    return _finish(c, path, n, y, n.float() if method == "greedy" else None)


def _kids(tree, b: int) -> list[list[int]]:
    """Each node's children of request b, in the order siblings are tried."""
    first, following = tree.first_child[b].tolist(), tree.next_sibling[b].tolist()
    kids = []
    for kid in first:
        mine = []
        while kid >= 0:
            mine.append(kid)
            kid = following[kid]
        kids.append(mine)
    return kids


def _paths(c: _Tree, walks: list[tuple[list[int], int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Each request's (accepted nodes from the root, emitted token) as path ``[B, D+1]``, counts, tokens."""
    path = torch.full((c.B, c.tree.max_depth + 1), -1, dtype=torch.int64)
    for b, (nodes, _) in enumerate(walks):
        path[b, : len(nodes)] = torch.tensor(nodes)
    return path, torch.tensor([len(nodes) - 1 for nodes, _ in walks]), torch.tensor([y for _, y in walks])


def _walk_draws_host(c: _Tree, logits: Tensor, proc: Processed | None,
                     draw: Callable[[int, int], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """greedy / target_only: every node's draw at once (a node's draw is its own whether or not the
    walk reaches it: the same numbers as :func:`_walk_draws`), then each request's walk on the host."""
    if c.method == "greedy":
        drawn = greedy_ids(logits)
    else:
        drawn = proc.sample(draw(STREAM_SAMPLE, c.N).reshape(-1)).view(c.B, c.N)
    drawn, tokens, usable = drawn.tolist(), c.x.tolist(), c.usable.tolist()
    walks = []
    for b in range(c.B):
        kids, nodes = _kids(c.tree, b), [0]
        while True:
            y = drawn[b][nodes[-1]]
            nxt = next((k for k in kids[nodes[-1]] if usable[b][k] and tokens[b][k] == y), -1)
            if nxt < 0:
                break
            nodes.append(nxt)
        walks.append((nodes, y))
    return _paths(c, walks)


def _walk_one(c: _Tree, p: Tensor, draw: Callable[[int, int], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """rrs or traversal for one request by its plain loop (:mod:`.reference`, tested equal to the
    batched walks), on its dense target rows ``p`` ``[N, V]``: a request's walk costs a few
    operations on single rows per node where the batched walk's cost tens of gathers and scatters."""
    from . import reference

    u_accept, u_draw = draw(STREAM_ACCEPT, c.N)[0], draw(STREAM_SAMPLE, c.N)[0]  # the batched walks' order
    walk = reference.tree_rrs if c.method == "rrs" else reference.tree_traversal
    return _paths(c, [walk(p, c.q[0], c.x_raw[0].tolist(), _kids(c.tree, 0), u_accept, u_draw,
                           c.sampling == "without_replacement")])
