"""Static draft-tree layouts: the structure of a tree shape ``(c_1, .., c_D)`` (children per node at each
depth, nodes in level order), prepared once per shape and device instead of once per step; the links of a
step that drafts without replacement derived from it. docs/design.md, "Speculative generation".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TreeLinks:
    """One step's draft trees in the form the verifiers read (the fields of :class:`TokenTree`):
    int64 ``[B, N]`` contiguous ``parents``, ``first_child``, ``next_sibling``, ``depth``,
    ``sibling_rank`` (``-1`` for absent nodes), ``max_depth`` (the layout's depth) and ``usable``
    (bool ``[B, N]``: the present non-root nodes)."""

    parents: Tensor
    first_child: Tensor
    next_sibling: Tensor
    depth: Tensor
    sibling_rank: Tensor
    max_depth: int
    usable: Tensor


class TreeLayout:
    """The layout of the branching factors ``branching``: the root 0, its ``c_1`` children, their ``c_2``
    children each, and so on, each node's children together (a chain is ``(1,) * K``)."""

    def __init__(self, branching: tuple[int, ...]):
        self.branching = branching
        self.depth = len(branching)
        levels, start, width = [range(0, 1)], 1, 1
        for c in branching:
            width *= c
            levels.append(range(start, start + width))
            start += width
        self.levels = levels
        self.size = start
        parents, first_child, next_sibling, rank, depth = [-1], [-1] * start, [-1], [0], [0]
        for d, c in enumerate(branching, 1):
            for k in levels[d]:
                i = k - levels[d].start
                parent = levels[d - 1].start + i // c
                parents.append(parent)
                rank.append(i % c)
                depth.append(d)
                next_sibling.append(k + 1 if i % c < c - 1 else -1)
                if i % c == 0:
                    first_child[parent] = k
        self._lists = dict(parents=parents, first_child=first_child, next_sibling=next_sibling, depth=depth,
                           sibling_rank=rank)
        self._cache: dict = {}

    def _memo(self, key, make):
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = make()
        return value

    def tensor(self, name: str, device: torch.device) -> Tensor:
        """int64 ``[N]``: the layout's ``parents``, ``first_child``, ``next_sibling``, ``depth`` or ``sibling_rank``."""
        return self._memo((name, device), lambda: torch.tensor(self._lists[name], dtype=torch.int64, device=device))

    def visible(self, device: torch.device) -> Tensor:
        """bool ``[N, N]``: node j is node i or one of its ancestors."""
        def make() -> Tensor:
            vis = torch.eye(self.size, dtype=torch.bool)
            for i, p in enumerate(self._lists["parents"]):
                if p >= 0:
                    vis[i] |= vis[p]
            return vis.to(device)

        return self._memo(("visible", device), make)

    def bias(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[N, N]`` of ``dtype``: the additive attention mask among the nodes (0 where
        :meth:`visible`, the dtype's minimum elsewhere)."""
        hidden = torch.finfo(dtype).min
        return self._memo(("bias", device, dtype), lambda: torch.zeros(self.size, self.size, dtype=dtype, device=device)
                          .masked_fill_(~self.visible(device), hidden))

    def level_bias(self, d: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[|level d|, level d's end]``: :meth:`bias` of level d's nodes over the nodes up to them."""
        lv = self.levels[d]
        return self._memo(("level", d, device, dtype), lambda: self.bias(device, dtype)[lv.start:lv.stop, :lv.stop]
                          .contiguous())

    def links(self, batch: int, device: torch.device, present: Tensor | None = None) -> TreeLinks:
        """The trees of a step: the whole layout for every request, or (``present``: bool
        ``[B, N]``, each parent's present children a prefix of its children and absent nodes'
        descendants absent) the layout without the absent nodes."""
        if present is None:
            def make() -> TreeLinks:
                t = {name: self.tensor(name, device).expand(batch, -1).contiguous() for name in self._lists}
                return TreeLinks(**t, max_depth=self.depth, usable=t["depth"] > 0)

            return self._memo(("links", batch, device), make)
        fc, ns = self.tensor("first_child", device), self.tensor("next_sibling", device)
        linked = lambda to: torch.where(present.gather(1, to.clamp(min=0).expand(batch, -1)) & (to >= 0), to, -1)  # noqa: E731
        absent = lambda name: torch.where(present, self.tensor(name, device), -1)  # noqa: E731
        depth = absent("depth")
        return TreeLinks(absent("parents"), linked(fc), linked(ns), depth, absent("sibling_rank"), self.depth,
                         depth > 0)


@functools.lru_cache(maxsize=64)
def tree_layout(branching: tuple[int, ...]) -> TreeLayout:
    """The (cached) layout of a shape."""
    return TreeLayout(branching)
