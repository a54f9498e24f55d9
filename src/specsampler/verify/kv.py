"""Compaction of KV-cache entries onto the accepted path of a tree verification."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..validation import (
    check_device,
    check_integer,
    check_mode,
    check_no_bad,
    check_shape,
    check_tensor,
    fail,
    values_checkable,
)

Cache = Tensor | Sequence


def _tensors(op: str, cache: Cache) -> list[Tensor]:
    """The tensors of a cache: one tensor, a list of tensors or of per-layer (k, v) pairs, or a
    Hugging Face ``DynamicCache`` (``.layers[i].keys / .values`` in transformers >= 4.56,
    ``.key_cache / .value_cache`` before); uninitialised layers are skipped."""
    if isinstance(cache, Tensor):
        return [cache]
    if isinstance(cache, (list, tuple)):
        return [t for item in cache for t in _tensors(op, item)]
    if hasattr(cache, "layers"):
        kv = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    elif hasattr(cache, "key_cache"):
        kv = [*cache.key_cache, *cache.value_cache]
    else:
        fail(op, "cache", "a tensor, a list of tensors or of (k, v) pairs, or a Hugging Face DynamicCache",
             type(cache).__name__)
    return [t for t in kv if isinstance(t, Tensor) and t.numel()]


@torch.no_grad()
def compact_kv(cache: Cache, cache_lens: Tensor, path: Tensor, num_accepted: Tensor, *, seq_dim: int = 2,
               validate: str = "structure") -> None:
    """Move the KV entries of each request's accepted path to right after its committed cache, in place.

    The tree's node i of request b was written at position ``cache_lens[b] + i``; the entry
    of the j-th node of the accepted path (``path[b, j]``, j = 0 .. ``num_accepted[b]``, the
    root first) moves to ``cache_lens[b] + j``. The new committed length is
    ``cache_lens + num_accepted + 1``; entries past it are left as they are.

    Args:
        cache: a tensor ``[B, H, S, D]`` (the sequence at dim ``seq_dim``), a list of such
            tensors or of per-layer ``(k, v)`` pairs, or a Hugging Face ``DynamicCache``
            (``[B, H, S, D]`` per layer). Modified in place.
        cache_lens: integer ``[B]``: committed positions before the tree.
        path: integer ``[B, D+1]``: accepted node ids from the root, ``-1`` after
            (``TreeResult.path``).
        num_accepted: integer ``[B]`` (``TreeResult.num_accepted``).
        seq_dim: the sequence dimension of every cache tensor (2 for ``[B, H, S, D]``, 1 for
            ``[B, S, H, D]``; negative counts from the end), an int other than the batch dim 0.
        validate: ``"structure"`` or ``"full"`` (positions inside the cache are then checked
            on every device, not only on the CPU).
    """
    op = "compact_kv"
    full = check_mode(op, validate)
    tensors = _tensors(op, cache)
    check_tensor(op, "path", path, kind="int", ndim=2)
    B, J = path.shape
    for name, t in (("cache_lens", cache_lens), ("num_accepted", num_accepted)):
        check_tensor(op, name, t, kind="int", ndim=1)
        check_shape(op, name, t, (B,), "[B]")
        check_device(op, name, t, path.device)
    dim = check_integer(op, "seq_dim", seq_dim)
    for i, t in enumerate(tensors):
        # the sequence dim, counted from either end, is not the batch dim 0: moves never cross requests' rows
        if not (1 <= dim < t.dim() or -t.dim() < dim < 0) or t.shape[0] != B:
            fail(op, f"cache tensor {i}", f"a batch dim of size B = {B} and a sequence dim {seq_dim} other than it",
                 f"shape {list(t.shape)}")
        check_device(op, f"cache tensor {i}", t, path.device)
    j = torch.arange(J, device=path.device)
    valid = (j <= num_accepted[:, None].long()) & (path >= 0)
    src = cache_lens[:, None].long() + path.long().clamp(min=0)
    dst = cache_lens[:, None].long() + j
    if tensors:
        S = min(t.shape[dim] for t in tensors)
        for name, pos in (("cache_lens + path", src), ("cache_lens + j", dst)):
            outside = valid & ((pos < 0) | (pos >= S))
            if values_checkable(pos, full):
                check_no_bad(op, name, outside, pos, f"positions inside the cache (< S = {S}) and not negative")
            valid = valid & ~outside  # where values go unchecked (a device, no sync), such a move is dropped
    b = torch.arange(B, device=path.device)[:, None].expand(B, J)[valid]
    src, dst = src[valid], dst[valid]
    for t in tensors:
        seq_first = t.movedim(dim, 1)  # a view: writes land in t
        seq_first[b, dst] = seq_first[b, src]
