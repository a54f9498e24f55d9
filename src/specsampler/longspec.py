"""LongSpec's tree-verification entry points (sail-sg/LongSpec's ``tree_verification`` and
``verify_stochastic``), the greedy one as documented and the stochastic one made lossless (docs/design.md,
"Upstream entry points (MLC-LLM, LongSpec)").

LongSpec's conventions: ``input_ids[b, i]`` is the token of tree node i (node 0 the root,
the last committed token); ``tree_mask[b, i, j]`` is nonzero when node j is node i or one of
its ancestors; ``output_ids[b, i]`` is the target's argmax after node i; in
:func:`verify_stochastic`, row i of ``p_llm`` / ``p_ssm`` holds the target / draft logits
*after* node i, i.e. for node i's children.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .params import SamplingParams
from .rng import Philox, check_rng
from .validation import (
    as_integer,
    check_device,
    check_logits_values,
    check_mode,
    check_no_bad,
    check_shape,
    check_tensor,
    check_token_values,
    fail,
    values_checkable,
)
from .verify.kv import Cache, compact_kv
from .verify.token_tree import TokenTree
from .verify.tree import verify_tree_from_logits


def _tree(op: str, tree_mask: Tensor) -> TokenTree:
    check_tensor(op, "tree_mask", tree_mask, kind="float" if tree_mask.dtype.is_floating_point else
                 ("bool" if tree_mask.dtype == torch.bool else "int"), ndim=3)
    return TokenTree._from_mask(tree_mask != 0, op, "tree_mask")


@torch.no_grad()
def tree_verification(input_ids: Tensor, output_ids: Tensor, tree_mask: Tensor, cache_lens: Tensor,
                      non_leaf_len: int | Tensor, *, kv_cache: Cache | None = None,
                      seq_dim: int = 1, validate: str = "structure") -> tuple[Tensor, Tensor, Tensor]:
    """Greedy tree verification with LongSpec's semantics.

    A node is verified when the target's output at its parent equals its token; the walk
    ends at the verified node of largest index whose ancestors are all verified (with
    duplicate sibling tokens this is the later sibling, unlike :func:`verify_tree`'s first).

    Args:
        input_ids: integer ``[B, N]``: node tokens. output_ids: integer ``[B, N]``: target
            argmax after each node. tree_mask: ``[B, N, N]`` (any dtype, nonzero = ancestor or
            self). cache_lens: integer ``[B]``. non_leaf_len: int, or integer tensor ``[]`` or ``[B]``,
            the number of non-leaf nodes (they come first).
        kv_cache: optional cache to compact onto the accepted path (see :func:`compact_kv`;
            LongSpec's caches are ``[B, S, H, D]``, hence ``seq_dim=1``).
        validate: ``"structure"`` or ``"full"`` (cache_lens >= 0 and, with ``kv_cache``, positions inside
            the cache: :func:`compact_kv`).
    Returns:
        ``acc_ids`` int64 ``[B, D+1]``: the target's outputs along the accepted path (the
        accepted drafts then the bonus token), ``-1`` after; ``acc_num`` int64 ``[B]``: nodes
        on the path, the root counted; ``double_input`` int32 ``[B]``: 1 where the last
        accepted node index is ``>= non_leaf_len``. (LongSpec's own ``acc_ids`` is ``acc_num.max()`` wide, so unpadded
        for one request: a caller writing it into a token buffer takes ``acc_ids[:, :acc_num.max()]`` and, for a
        batch, the ``-1`` padding out.)
    """
    op = "longspec.tree_verification"
    tree = _tree(op, tree_mask)
    B, N = tree.batch_size, tree.size
    for name, t in (("input_ids", input_ids), ("output_ids", output_ids)):
        check_tensor(op, name, t, kind="int", ndim=2)
        check_shape(op, name, t, (B, N), "[B, N] (as tree_mask)")
    check_tensor(op, "cache_lens", cache_lens, kind="int", ndim=1)
    check_shape(op, "cache_lens", cache_lens, (B,), "[B]")
    full = check_mode(op, validate)
    if isinstance(non_leaf_len, Tensor):
        check_tensor(op, "non_leaf_len", non_leaf_len, kind="int", ndim=(0, 1))
        if non_leaf_len.dim():
            check_shape(op, "non_leaf_len", non_leaf_len, (B,), "[B]")
        check_device(op, "non_leaf_len", non_leaf_len, input_ids.device)
    else:
        n = as_integer(non_leaf_len)
        if n is None:
            fail(op, "non_leaf_len", "an int or an integer tensor [] or [B]", type(non_leaf_len).__name__)
        non_leaf_len = n
    if values_checkable(cache_lens, full):
        check_no_bad(op, "cache_lens", cache_lens < 0, cache_lens, "lengths >= 0")
    mask = tree.mask()
    out = output_ids.long()
    ok = out.gather(1, tree.parents.clamp(min=0)) == input_ids.long()
    ok[:, 0] = True
    verified = ~(mask & ~ok[:, None, :]).any(2) & (tree.depth >= 0)
    last = torch.where(verified, torch.arange(N, device=out.device), -1).amax(1)
    on_path = mask[torch.arange(B, device=out.device), last]
    acc_num = on_path.sum(1)
    order = torch.where(on_path, torch.arange(N, device=out.device), N).sort(1).values[:, : tree.max_depth + 1]
    acc_ids = torch.where(order < N, out.gather(1, order.clamp(max=N - 1)), -1)
    if kv_cache is not None:
        compact_kv(kv_cache, cache_lens, torch.where(order < N, order, -1), acc_num - 1, seq_dim=seq_dim,
                   validate=validate)
    return acc_ids, acc_num, (last >= non_leaf_len).int()


@torch.no_grad()
def verify_stochastic(input_ids: Tensor, tree_mask: Tensor, p_llm: Tensor, p_ssm: Tensor, temperature: float, *,
                      draft_sampling: str = "deterministic", rng: torch.Generator | Philox | None = None,
                      validate: str = "structure") -> tuple[Tensor, Tensor]:
    """LongSpec's stochastic tree verification, made lossless.

    LongSpec's original indexes the target's vocabulary by node index, tries children in a
    random order against the parent's draft row and renormalises without regard to how the
    children were drafted. Here the tokens are the nodes' token ids and the rule matches the
    drafting: ``"deterministic"`` children (top-k / beam) are verified target-only;
    ``"iid"`` and ``"without_replacement"`` children by recursive rejection sampling with the
    draft distribution ``softmax(p_ssm[parent] / T)`` they were drawn from. Only the target
    rows on the walk are processed; an empty residual never crashes; ``rng`` makes it
    reproducible per request.

    Args:
        input_ids: integer ``[B, N]``: node tokens (node 0 the root). tree_mask: ``[B, N, N]``.
        p_llm, p_ssm: float ``[B, N, V]``: target and draft logits after each node.
        temperature: float > 0.
    Returns:
        ``acc_ids`` int64 ``[B, D+2]``: the root's token, the accepted drafts and the new
        token, ``-1`` after; ``acc_num`` int64 ``[B]``: their number (the root counted). (LongSpec's own pads with 0
        to ``acc_num.max()``: a caller writing into a token buffer takes ``acc_ids[:, :acc_num.max()]`` and the
        ``-1`` padding out.)
    """
    op = "longspec.verify_stochastic"
    check_rng(op, rng)
    tree = _tree(op, tree_mask)
    B, N = tree.batch_size, tree.size
    check_tensor(op, "input_ids", input_ids, kind="int", ndim=2)
    check_shape(op, "input_ids", input_ids, (B, N), "[B, N] (as tree_mask)")
    for name, t in (("p_llm", p_llm), ("p_ssm", p_ssm)):
        check_tensor(op, name, t, kind="float", ndim=3)
        check_shape(op, name, t, (B, N, p_llm.shape[-1]), "[B, N, V]")
    want = "a finite number > 0 (greedy verification is tree_verification)"
    if isinstance(temperature, Tensor) and temperature.dim() == 0 and temperature.dtype != torch.bool:
        temperature = temperature.item()  # a 0-d tensor, as LongSpec divides by
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        fail(op, "temperature", want, repr(temperature))
    if draft_sampling not in ("deterministic", "iid", "without_replacement"):
        fail(op, "draft_sampling", "one of ('deterministic', 'iid', 'without_replacement')", repr(draft_sampling))
    if check_mode(op, validate):  # the rows the op reads, named as given (the op below reads derived tensors)
        present = (tree.depth >= 0).to(p_llm.device)
        drafted = present & (tree.parents >= 0).to(p_llm.device)
        check_logits_values(op, "p_llm", p_llm.masked_fill(~present[..., None], 0.0))
        check_token_values(op, "input_ids", input_ids.masked_fill(~drafted, 0), p_llm.shape[-1])
        if draft_sampling != "deterministic":  # each drafted node's parent's draft row
            read = torch.zeros_like(drafted).scatter_(1, tree.parents.clamp(min=0).to(p_llm.device), drafted)
            check_logits_values(op, "p_ssm", p_ssm.masked_fill(~read[..., None], 0.0))
    params = SamplingParams(temperature=float(temperature))
    if draft_sampling == "deterministic":
        res = verify_tree_from_logits(p_llm, input_ids, tree, params, method="target_only", rng=rng,
                                      validate=validate)
    else:
        parent_rows = p_ssm[torch.arange(B, device=p_ssm.device)[:, None], tree.parents.clamp(min=0)]
        q = torch.softmax(parent_rows.float() / temperature, -1)
        res = verify_tree_from_logits(p_llm, input_ids, tree, params, draft_probs=q, method="rrs",
                                      draft_sampling=draft_sampling, rng=rng, validate=validate)
    acc_ids = torch.cat([input_ids[:, :1].long(), res.tokens], 1)
    return acc_ids, res.num_accepted + 2
