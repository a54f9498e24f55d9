"""Draft token trees: a batch of trees with request-local node indices.

Node 0 of every request is the root (the last committed token). A node's parent always has
a smaller index. A request with fewer nodes than the batch's ``N`` pads with absent nodes,
which may stand anywhere after the root. Siblings are tried in a fixed order: increasing
index for trees built from parents or a mask, link order for first-child/next-sibling.

Constructing a tree validates its structure (root, parent before child, cycles, two
parents, links of absent nodes) and computes its depths: one host sync for device
tensors, so build trees once (or on the CPU and move them with :meth:`TokenTree.to`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..validation import check_readable, check_shape, check_tensor, fail, shape_str


def _first(bad: Tensor) -> tuple[int, int] | None:
    """(request, node) of the first True in a ``[B, N]`` bool tensor, or None."""
    idx = torch.nonzero(bad)
    return (int(idx[0, 0]), int(idx[0, 1])) if idx.numel() else None


def _fail_at(op: str, bad: Tensor, name: str, expected: str, values: Tensor | None = None, what: str = "") -> None:
    """Fail at the first (request, node) where ``bad`` is True.

    The actual value quoted is ``values[b, i]``, or ``what`` formatted with ``b``, ``i`` and ``v``.
    """
    hit = _first(bad)
    if hit is None:
        return
    b, i = hit
    v = values[b, i].item() if values is not None else None
    fail(op, f"{name}[{b}, {i}] (node {i})", expected, what.format(b=b, i=i, v=v) if what else v, request=b)


def _int_nodes(op: str, name: str, t: object) -> Tensor:
    check_tensor(op, name, t, kind="int", ndim=2)
    check_readable(op, name, t)  # read on the host
    if t.shape[1] == 0:
        fail(op, name, "at least one node (the root) per request: shape [B, N] with N >= 1", shape_str(t.shape))
    return t


def _depth_from_parents(parents: Tensor) -> Tensor:
    """Depth ``[B, N]`` (root 0, absent -1) of valid parent arrays (parent < child)."""
    B, N = parents.shape
    depth = torch.full((B, N), -1, dtype=torch.int64)
    depth[:, 0] = 0
    for i in range(1, N):
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, -1)
    return depth


def _links_from_parents(parents: Tensor) -> tuple[Tensor, Tensor]:
    """first_child and next_sibling ``[B, N]`` with siblings in increasing index."""
    B, N = parents.shape
    idx = torch.arange(N).expand(B, N)
    child = (parents >= 0) & (idx > 0)
    key, order = torch.where(child, parents * N + idx, N * N + idx).sort(dim=1)
    parent_of = torch.where(key < N * N, key // N, -1)
    same_next = (parent_of[:, 1:] == parent_of[:, :-1]) & (parent_of[:, :-1] >= 0)
    next_sibling = torch.full((B, N), -1, dtype=torch.int64)
    next_sibling.scatter_(1, order[:, :-1], torch.where(same_next, order[:, 1:], -1))
    prev_parent = torch.nn.functional.pad(parent_of[:, :-1], (1, 0), value=-1)
    first = (parent_of >= 0) & (parent_of != prev_parent)
    first_child = torch.full((B, N + 1), -1, dtype=torch.int64)  # column N collects the non-firsts
    first_child.scatter_(1, torch.where(first, parent_of, N), order)
    return first_child[:, :N].contiguous(), next_sibling


def _sibling_rank(first_child: Tensor, next_sibling: Tensor) -> Tensor:
    """Position of each node among its siblings, in the order they are tried ``[B, N]``
    (root 0, absent -1)."""
    B, N = first_child.shape
    rank = torch.full((B, N), -1, dtype=torch.int64)
    rank[:, 0] = 0
    cur, k = first_child.clone(), 0  # the k-th child of every node
    while bool((cur >= 0).any()):
        b, owner = (cur >= 0).nonzero(as_tuple=True)
        rank[b, cur[b, owner]] = k
        cur = torch.where(cur >= 0, next_sibling.gather(1, cur.clamp(min=0)), -1)
        k += 1
    return rank


class TokenTree:
    """A batch of draft token trees (request-local indices, ``-1`` = none).

    Build with :meth:`from_parents`, :meth:`from_first_child_next_sibling` or
    :meth:`from_mask`. All tensors are int64 ``[B, N]`` on the tree's device:

    - ``parents``: parent of each node; ``-1`` for the root (node 0) and for absent nodes.
    - ``first_child``, ``next_sibling``: the child lists, in the order siblings are tried.
    - ``depth``: root 0, its children 1, ...; ``-1`` for absent nodes.
    - ``sibling_rank``: position among the siblings in the order they are tried (root 0, absent -1).
    - ``num_nodes``: int64 ``[B]``, present nodes per request (root included).
    - ``max_depth``: int, the largest depth in the batch (``D``; paths have ``D + 1`` entries).
    - ``max_children``: int, the largest number of children of a node in the batch.
    """

    def __init__(self, parents: Tensor, first_child: Tensor, next_sibling: Tensor, depth: Tensor, device):
        rank = _sibling_rank(first_child, next_sibling)
        self.parents = parents.to(device)
        self.first_child = first_child.to(device)
        self.next_sibling = next_sibling.to(device)
        self.depth = depth.to(device)
        self.sibling_rank = rank.to(device)
        self.num_nodes = (depth >= 0).sum(1).to(device)
        self.max_depth = int(depth.max()) if depth.numel() else 0
        self.max_children = int(rank.max()) + 1 if rank.numel() else 0

    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    @property
    def size(self) -> int:
        """``N``, node slots per request (present or absent)."""
        return self.parents.shape[1]

    @property
    def device(self) -> torch.device:
        return self.parents.device

    def to(self, device) -> TokenTree:
        """The same tree on ``device``."""
        return TokenTree(self.parents, self.first_child, self.next_sibling, self.depth.cpu(), device)

    def __repr__(self) -> str:
        return f"TokenTree(B={self.batch_size}, N={self.size}, max_depth={self.max_depth}, device={self.device})"

    # -------------------------------------------------------------------------------- builders

    @classmethod
    def from_parents(cls, parents: Tensor) -> TokenTree:
        """Trees from parent pointers.

        parents: integer ``[B, N]``; ``parents[b, 0] = -1`` (the root); for ``i >= 1``
        ``0 <= parents[b, i] < i``, or ``-1`` for an absent (padding) node. Siblings are
        tried in increasing index.
        """
        op = "TokenTree.from_parents"
        # a copy of the tree's own: a caller that writes its buffer for the next step leaves this tree as built
        p = _int_nodes(op, "parents", parents).detach().to("cpu", torch.int64, copy=True)
        B, N = p.shape
        idx = torch.arange(N).expand(B, N)
        _fail_at(op, (idx == 0) & (p != -1), "parents", "-1 (node 0 is the root)", p)
        _fail_at(op, (idx > 0) & ((p < -1) | (p >= idx)), "parents",
                 "a parent index in [-1, i): a parent comes before its child", p)
        absent = p == -1
        absent[:, 0] = False
        parent_absent = (p > 0) & absent.gather(1, p.clamp(min=0))
        _fail_at(op, parent_absent, "parents", "a present parent (parents[b, parent] != -1)", p,
                 what="parent {v}, which is absent")
        first_child, next_sibling = _links_from_parents(p)
        return cls(p, first_child, next_sibling, _depth_from_parents(p), parents.device)

    @classmethod
    def from_first_child_next_sibling(cls, first_child: Tensor, next_sibling: Tensor) -> TokenTree:
        """Trees from child lists (the SGLang / MLC layout, with request-local indices).

        first_child, next_sibling: integer ``[B, N]``, ``-1`` = none. Node 0 is the root (no
        sibling, nobody's child); a node reached from no list is absent and must have no
        links; every present node must have a smaller index than its children. Siblings are
        tried in link order.
        """
        op = "TokenTree.from_first_child_next_sibling"
        # copies of the tree's own (as from_parents)
        fc = _int_nodes(op, "first_child", first_child).detach().to("cpu", torch.int64, copy=True)
        ns = _int_nodes(op, "next_sibling", next_sibling).detach().to("cpu", torch.int64, copy=True)
        check_shape(op, "next_sibling", ns, fc.shape, "[B, N] (as first_child)")
        B, N = fc.shape
        for name, t in (("first_child", fc), ("next_sibling", ns)):
            _fail_at(op, (t < -1) | (t >= N), name, f"a node index in [-1, {N})", t)
        _fail_at(op, torch.arange(N).expand(B, N).eq(0) & (ns != -1), "next_sibling",
                 "-1 (the root has no sibling)", ns)
        # Walk every child list at once: the k-th step visits the k-th child of each node.
        parents = torch.full((B, N), -1, dtype=torch.int64)
        refs = torch.zeros(B, N, dtype=torch.int64)
        rows = torch.arange(B)[:, None].expand(B, N)
        owner = torch.arange(N).expand(B, N)
        cur = fc.clone()
        for _ in range(N):
            on = cur >= 0
            if not bool(on.any()):
                break
            b, c, o = rows[on], cur[on], owner[on]
            refs.index_put_((b, c), torch.ones_like(c), accumulate=True)
            parents[b, c] = o
            cur = torch.where(on, ns.gather(1, cur.clamp(min=0)), -1)
        else:
            if bool((cur >= 0).any()):
                _fail_at(op, cur >= 0, "next_sibling", "sibling lists without cycles",
                         what="a sibling list of node {i} that never ends (cycle)")
        _fail_at(op, refs[:, :1] > 0, "first_child", "no link to node 0 (the root is nobody's child)",
                 what="a link to the root")
        _fail_at(op, refs > 1, "first_child", "one parent per node",
                 what="node {i} reached from two child lists (two parents, or a cycle)")
        unreached = (refs == 0) & (torch.arange(N) > 0)
        _fail_at(op, unreached & ((fc != -1) | (ns != -1)), "first_child",
                 "no links from a node that no child list reaches (an absent node)",
                 what="links from node {i}, which is not in the tree")
        anc = parents.clone()  # pointer doubling: after t steps, the 2**t-th ancestor
        for _ in range(max(1, (N - 1).bit_length()) + 1):
            anc = torch.where(anc >= 0, anc.gather(1, anc.clamp(min=0)), -1)
        _fail_at(op, (refs == 1) & (anc >= 0), "first_child", "child lists without cycles",
                 what="node {i} on a cycle of links")
        _fail_at(op, (refs == 1) & (parents >= torch.arange(N)), "first_child",
                 "a parent with a smaller index than its child", parents, what="node {i} whose parent is {v}")
        return cls(parents, fc, ns, _depth_from_parents(parents), first_child.device)

    @classmethod
    def from_mask(cls, mask: Tensor) -> TokenTree:
        """Trees from an ancestor mask (the tree-attention mask).

        mask: bool ``[B, N, N]``; ``mask[b, i, j]`` = node j is node i or an ancestor of i.
        ``mask[b, i, i]`` is False for an absent node (whose row and column are all False).
        Siblings are tried in increasing index.
        """
        return cls._from_mask(mask, "TokenTree.from_mask", "mask")

    @classmethod
    def _from_mask(cls, mask: Tensor, op: str, name: str) -> TokenTree:
        """:meth:`from_mask`, its errors naming ``op`` and the argument ``name`` (an entry point's own)."""
        check_tensor(op, name, mask, kind="bool", ndim=3)
        check_readable(op, name, mask)
        m = mask.detach().cpu()
        B, N, N2 = m.shape
        if N != N2 or N == 0:
            fail(op, name, "shape [B, N, N] with N >= 1", shape_str(m.shape))
        present = m.diagonal(dim1=1, dim2=2).clone()
        _fail_at(op, ~present[:, :1], name, "True at [b, 0, 0] (node 0 is the root)", what="False")
        depth = m.sum(2) - 1  # ancestors count
        proper = m & ~torch.eye(N, dtype=torch.bool)
        _fail_at(op, proper[:, 0], name, "no ancestor of the root (row 0 only True at column 0)",
                 what="root row with True at column {i}")
        _fail_at(op, (proper.any(2) | proper.any(1)) & ~present, name,
                 "an absent node (mask[b, i, i] False) to have no other True in its row and column",
                 what="node {i} absent but in a row or column")
        root_missing = present & ~m[:, :, 0]
        _fail_at(op, root_missing, name, "the root (column 0) among the ancestors of every node",
                 what="node {i} without the root as an ancestor")
        # The parent is the deepest proper ancestor; the ancestors of i must be its parent's plus i.
        cand = torch.where(proper, depth[:, None, :], -1)
        parents = torch.where(present & (torch.arange(N) > 0), cand.argmax(2), -1)
        expect = m.gather(1, parents.clamp(min=0)[:, :, None].expand(B, N, N)) | torch.eye(N, dtype=torch.bool)
        inconsistent = present & (torch.arange(N) > 0) & (expect != m).any(2)
        _fail_at(op, inconsistent, name, "ancestor sets that form a chain from the root (a tree)",
                 what="row {i}, which is not its parent's row plus node {i}")
        _fail_at(op, parents >= torch.arange(N), name, "a parent with a smaller index than its child",
                 parents, what="node {i} whose parent is {v}")
        first_child, next_sibling = _links_from_parents(parents)
        return cls(parents, first_child, next_sibling, depth.where(present, -1), mask.device)

    # -------------------------------------------------------------------------------- views

    def mask(self) -> Tensor:
        """bool ``[B, N, N]``: ``[b, i, j]`` = node j is node i or an ancestor of i (False rows for absent)."""
        B, N = self.parents.shape
        out = torch.diag_embed(self.depth >= 0)
        cur = self.parents
        rows = torch.arange(N, device=self.device).expand(B, N)
        for _ in range(self.max_depth):
            on = cur >= 0
            out[torch.arange(B, device=self.device)[:, None].expand(B, N)[on], rows[on], cur[on]] = True
            cur = torch.where(on, self.parents.gather(1, cur.clamp(min=0)), -1)
        return out
