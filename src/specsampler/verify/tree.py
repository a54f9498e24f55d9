"""Tree verification: a tree of drafts per request, walked from the root.

Methods ``greedy``, ``target_only``, ``rrs`` (recursive rejection sampling; drafts i.i.d. or without
replacement) and ``traversal`` (Traversal Verification): conventions and formulas in docs/design.md,
"Tree verification" and "Algorithms"; random counters: "Randomness". Here: the checks, the choice of back
end and the results; the walks: :mod:`specsampler.verify.walks`; plain loop per request:
:mod:`specsampler.verify.reference`; kernel: :mod:`specsampler.kernels.tree`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import runs_kernel, use_triton
from ..params import RowParams, SamplingParams
from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, Philox, check_rng, kernel_randomness
from ..sampling.greedy import greedy_ids
from ..sampling.ops import _process_prepared, logit_inputs
from ..sampling.processing import Processed
from ..tracing import eager_when_traced
from ..validation import (
    check_device,
    check_logits_values,
    check_method,
    check_mode,
    check_probs_values,
    check_readable,
    check_shape,
    check_tensor,
    check_token_values,
    fail,
)
from .token_tree import TokenTree
from .walks import WALKS, TargetRows, TreeInputs, drawer, expected_target_only, walk_held_apart

METHODS = ("greedy", "target_only", "rrs", "traversal")
DRAFT_SAMPLING = ("iid", "without_replacement")
# Up to these many requests, rrs and traversal on the CPU walk each request by its plain loop (a few operations on
# single rows per node tested, its scalars on the host), where the batched walks' gathers and scatters over every
# request cost more. In the generation loop (short rows, every row processed at once): 6-31% less library time at 3
# and 8 requests, 10-19% more at 16. verify_tree on 15 nodes: 1.2-3.5x faster at 1-4 requests over 256 or 32000
# tokens, 0.7x at 8 over 256. Wider rows make the batched walks' passes over every request's rows dearer:
# verify_tree's loops also take up to V // 1024 requests (rrs) or V // 512 (traversal). Measured on 15 nodes: at 16
# requests over 16384 tokens rrs 13 against 14 ms, traversal 69 against 116; at 32 over 32000, 40 against 72 and 136
# against 301.
LOOPED_BATCH, LOOPED_BATCH_PROBS = 8, 4


def _looped(method: str, batch: int, vocab: int) -> bool:
    """Whether :func:`verify_tree` walks ``batch`` requests' rrs or traversal trees over ``vocab`` tokens (dense rows)
    by the plain loops on the CPU."""
    return method in ("rrs", "traversal") and batch <= max(LOOPED_BATCH_PROBS,
                                                          vocab // (512 if method == "traversal" else 1024))


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


def _check_tree(op, target, target_name, draft_tokens, tree, draft_probs, method, draft_sampling, full, logits):
    check_tensor(op, target_name, target, kind="float", ndim=3)
    check_readable(op, target_name, target)
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
    if full:  # rows of absent nodes (and the root's draft row) are padding: not checked
        child = tree.depth > 0
        check_token_values(op, "draft_tokens", torch.where(child, x_raw, 0), V)
        present = (tree.depth >= 0)[..., None]
        if logits:
            check_logits_values(op, target_name, torch.where(present, target.float(), 0.0))
        else:
            check_probs_values(op, target_name, torch.where(present, target.float(), 1.0))
        if q is not None:
            check_probs_values(op, "draft_probs", torch.where(child[..., None], q, 1.0))
    return TreeInputs(B, N, V, method, draft_sampling, tree, x_raw, q)


def _assemble(c: TreeInputs, path: Tensor, n: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A PyTorch walk's accepted path ``[B, D+1]`` (-1 padded), its length and y, followed by what the kernels
    also give: the emitted tokens ``[B, D+1]`` and the last accepted node ``[B]``."""
    pos = torch.arange(path.shape[1], device=path.device)
    drafts = torch.nn.functional.pad(c.x_raw.gather(1, path[:, 1:].clamp(min=0)), (0, 1), value=-1)
    tokens = torch.where(pos < n[:, None], drafts, torch.where(pos == n[:, None], y[:, None], -1))
    last = path.gather(1, n[:, None])[:, 0]
    return path, n, y, tokens, last


def _result(walked: tuple[Tensor, ...], expected: Tensor | None) -> TreeResult:
    """The result from :func:`_assemble`'s (or a kernel's) five outputs."""
    path, n, _, tokens, last = walked
    return TreeResult(path, tokens, n, last, None if expected is None else expected.float())


def _finish(c: TreeInputs, path: Tensor, n: Tensor, y: Tensor, expected: Tensor | None) -> TreeResult:
    """The result of a PyTorch walk's path, its length and y."""
    return _result(_assemble(c, path, n, y), expected)


_STREAMS = {"greedy": (), "target_only": (STREAM_SAMPLE,), "rrs": (STREAM_ACCEPT, STREAM_SAMPLE),
            "traversal": (STREAM_ACCEPT, STREAM_SAMPLE)}  # the uniforms each walk draws, in its order


def _walk_kernel(c: TreeInputs, target: Tensor, rng, op: str, rp: RowParams | None = None,
                 mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The walk of ``c.method`` by its Triton kernel (the same draws as the PyTorch walks), on
    target probabilities, or on logits when the rows' parameters ``rp`` are given: :func:`_assemble`'s outputs."""
    from ..kernels import ops

    streams = _STREAMS[c.method]
    seed, offset, u = kernel_randomness(rng, op, c.B, c.N, streams, c.x_raw.device)
    u_accept = u[0] if STREAM_ACCEPT in streams else None
    u_sample = u[-1] if STREAM_SAMPLE in streams else None
    t = c.tree
    if rp is None:
        return ops.verify_tree(target, c.x_raw, t.first_child, t.next_sibling, c.q, c.method, c.sampling,
                               t.max_depth, seed, offset, u_accept, u_sample)
    return ops.verify_tree_from_logits(target, c.x_raw, t.first_child, t.next_sibling, c.q, c.method, c.sampling,
                                       t.max_depth, rp.temperature, rp.top_k, rp.top_p, rp.min_p, mask, seed, offset,
                                       u_accept, u_sample)




@eager_when_traced(runs_kernel)
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

    On the CPU, rrs and traversal of up to ``LOOPED_BATCH_PROBS`` requests (more over wide rows: :func:`_looped`)
    walk each request by its plain loop (:mod:`.reference`), cheaper there than the batched walk: the same paths
    and tokens, whatever the values.

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
        walked = _walk_kernel(c, target_probs, rng, op)
    elif target_probs.device.type == "cpu" and _looped(c.method, c.B, c.V):
        walked = _walk_each(c, target_probs.float(), drawer(c, rng, op, None))
    else:
        walked = _assemble(c, *WALKS[c.method](c, TargetRows(probs=target_probs), rng, op))
    expected = None
    if c.method == "greedy":
        expected = walked[1].float()
    elif c.method == "target_only":
        parents = tree.parents.clamp(min=0)
        expected = expected_target_only(c, target_probs[torch.arange(c.B)[:, None], parents, c.x].float())
    return _result(walked, expected)


@eager_when_traced(runs_kernel)
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
    rp, mask, _, _ = logit_inputs(op, target_logits, params, vocab_mask, full, live=tree.depth >= 0 if full else None)
    rows = TargetRows(logits=target_logits, rp=rp, mask=mask)
    if use_triton(target_logits.device):
        walked = _walk_kernel(c, target_logits, rng, op, rp, mask)
    elif c.method in ("rrs", "traversal"):  # top-k requests held by their candidates, even beside others
        walked = _assemble(c, *walk_held_apart(WALKS[c.method], c, rows, rng, op))
    else:
        walked = _assemble(c, *WALKS[c.method](c, rows, rng, op))
    expected = walked[1].float() if c.method == "greedy" else None
    if expected_accepted and c.method == "target_only":
        pb, pv = (tree.first_child >= 0).nonzero(as_tuple=True)  # each node with children, processed once
        slot = torch.full((c.B, c.N), -1, dtype=torch.int64, device=c.x.device)
        slot[pb, pv] = torch.arange(pb.numel(), device=c.x.device)
        b, node = (tree.depth > 0).nonzero(as_tuple=True)
        p_edge = torch.zeros(c.B, c.N, device=c.x.device)
        p_edge[b, node] = rows.at(pb, pv).select(slot[b, tree.parents[b, node]]).prob(c.x[b, node])
        expected = expected_target_only(c, p_edge)
    return _result(walked, expected)


# ------------------------------------------------------------------- inputs a caller built (speculative_generate)


class _AllRows(TargetRows):
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
    draw at every node at once and walk on the host (:func:`_walk_draws_host`), and the rrs or
    traversal walks of a few requests are their plain loops (:func:`_walk_each`). The same tokens as
    the public op.
    """
    B, N, V = logits.shape
    c = TreeInputs(B, N, V, method, draft_sampling, tree, drafts, draft_probs, given_usable=usable)
    cpu = logits.device.type == "cpu"
    if use_triton(logits.device):
        walked = _walk_kernel(c, logits, rng, "speculative_generate", rp, None)
    else:
        proc = None if method == "greedy" else _process_prepared(logits.view(-1, V), rp, small)
        if cpu and method in ("greedy", "target_only"):
            walked = _walk_draws_host(c, logits, proc, draw)
        # not _looped's wider rule: beyond LOOPED_BATCH, the batched walks hold top-k rows by their candidates, which
        # the loops would make dense
        elif cpu and method in ("rrs", "traversal") and B <= LOOPED_BATCH:
            walked = _walk_each(c, proc.dense().view(B, N, V), draw)
        else:
            walked = _assemble(c, *WALKS[method](c, _AllRows(logits, proc), rng, "speculative_generate", draw))
    return _result(walked, walked[1].float() if method == "greedy" else None)


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


def _paths(c: TreeInputs, walks: list[tuple[list[int], int]]) -> tuple[Tensor, ...]:
    """:func:`_assemble`'s five outputs from each request's walk on the host, (accepted nodes from the root,
    emitted token): built from lists, without a tensor operation per output."""
    width, x = c.tree.max_depth + 1, c.x_raw.tolist()
    path, tokens = [], []
    for b, (nodes, y) in enumerate(walks):
        pad = [-1] * (width - len(nodes))
        path.append(nodes + pad)
        tokens.append([x[b][v] for v in nodes[1:]] + [y] + pad)

    def ints(rows: list, *shape: int) -> Tensor:  # int64 of its shape with no request too (not float32 [0])
        return torch.tensor(rows, dtype=torch.int64).view(-1, *shape)

    return (ints(path, width), ints([len(nodes) - 1 for nodes, _ in walks]), ints([y for _, y in walks]),
            ints(tokens, width), ints([nodes[-1] for nodes, _ in walks]))


def _walk_draws_host(c: TreeInputs, logits: Tensor, proc: Processed | None,
                     draw: Callable[[int, int], Tensor]) -> tuple[Tensor, ...]:
    """greedy / target_only: every node's draw at once (a node's draw is its own whether or not the
    walk reaches it: the same numbers as :func:`walk_draws`), then each request's walk on the host
    (:func:`_assemble`'s outputs)."""
    usable = c.usable
    if c.method == "greedy":
        drawn = greedy_ids(logits)
    else:
        flat = proc.sample(draw(STREAM_SAMPLE, c.N).reshape(-1))
        drawn = flat.view(c.B, c.N)
        # a row without mass draws 0, of target probability 0: no child of that node is accepted
        has_mass = (proc.prob(flat) > 0).view(c.B, c.N)
        usable = usable & has_mass.gather(1, c.tree.parents.clamp(min=0))
    drawn, tokens, usable = drawn.tolist(), c.x.tolist(), usable.tolist()
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


def _walk_each(c: TreeInputs, p: Tensor, draw: Callable[[int, int], Tensor]) -> tuple[Tensor, ...]:
    """rrs or traversal for each request by its plain loop (:mod:`.reference`, tested equal to the
    batched walks), on the dense target rows ``p`` float32 ``[B, N, V]``: a request's walk costs a few
    operations on single rows per node where the batched walk's cost tens of gathers and scatters
    (:func:`_assemble`'s outputs)."""
    from . import reference

    u_accept, u_draw = draw(STREAM_ACCEPT, c.N).tolist(), draw(STREAM_SAMPLE, c.N).tolist()
    walk = reference.tree_rrs if c.method == "rrs" else reference.tree_traversal
    wo = c.sampling == "without_replacement"
    return _paths(c, [walk(p[b], c.q[b], x, _kids(c.tree, b), u_accept[b], u_draw[b], wo)
                      for b, x in enumerate(c.x_raw.tolist())])
