"""SGLang's ``sgl_kernel`` sampling and tree-verification entry points on specsampler.

    import specsampler.compat.sglang as sgl_kernel

The same names, signatures (``retrive_*`` or ``retrieve_*`` keywords), in-place writes, dtype checks and
messages as sgl_kernel, on CPU and CUDA tensors; ``specsampler.compat.sglang.sampling`` is
``sgl_kernel.sampling``. The op each function maps to, the caller's coins and where the tree functions
differ: docs/design.md, "Drop-in compatibility per peer", ``compat.sglang``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import TokenTree, verify_tree
from ...validation import ValidationError, first_request, values_checkable
from .sampling import (
    draw_with_coins,
    min_p_sampling_from_probs,
    top_k_renorm_prob,
    top_k_renorm_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_prob,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)

__all__ = [
    "KernelCheckError",
    "min_p_sampling_from_probs",
    "top_k_renorm_prob",
    "top_k_renorm_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_prob",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
    "tree_speculative_sampling_target_only",
    "tree_speculative_sampling_target_only_rejmask",
    "verify_tree_greedy",
    "verify_tree_greedy_cpu",
]


class KernelCheckError(ValidationError, RuntimeError):
    """A check the peer's C++ op makes: a ``RuntimeError`` there, a ``ValueError`` here as well."""


_DTYPE_NAMES = {torch.int32: "int (torch.int32)", torch.int64: "long (torch.int64)",
                torch.float32: "float (torch.float32)"}


def check(op: str, ok: bool, name: str, expected: str, actual: object) -> None:
    """Raise :class:`KernelCheckError` in specsampler's format unless ``ok``."""
    if not ok:
        raise KernelCheckError(f"{op}: {name}: expected {expected}, got {actual}")


def check_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    """sgl_kernel's dtype check and message."""
    if t.dtype != dtype:
        raise KernelCheckError(f"Expected '{name}' to be of type {_DTYPE_NAMES[dtype]}.")


def check_dims(op: str, named: dict[str, tuple[Tensor | None, tuple]], device: torch.device) -> None:
    """Each tensor (None: skipped) on ``device`` with the shape given (an int: that size, None: any)."""
    for name, (t, shape) in named.items():
        if t is None:
            continue
        check(op, isinstance(t, Tensor), name, "a torch.Tensor", type(t).__name__)
        check(op, t.device == device, name, f"a tensor on {device}", f"one on {t.device}")
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
        check(op, ok, name, f"shape {want}", list(t.shape))


def local_ids(tokens: Tensor) -> Tensor:
    """Each token's index of first occurrence in its row: ``[B, M]`` ids -> int64 ``[B, M]`` in ``[0, M)``.

    A request's few token ids renamed into a vocabulary of size M, so that a one-hot row over it
    stands for "the target's choice is this token" without a row of the real vocabulary.
    """
    return (tokens[:, :, None] == tokens[:, None, :]).to(torch.int8).argmax(-1)


def _links(op: str, given: tuple, aliases: tuple) -> list[Tensor]:
    """``retrive_*`` or their ``retrieve_*`` spellings (one of each pair)."""
    out = []
    for (name, value), (alias, other) in zip(given, aliases):
        if value is not None and other is not None:
            raise TypeError(f"{op}() got both '{name}' and '{alias}'")
        if value is None and other is None:
            raise TypeError(f"{op}() missing required argument: '{name}'")
        out.append(value if value is not None else other)
    return out


def _required(op: str, **named: object) -> None:
    for name, value in named.items():
        if value is None:
            raise TypeError(f"{op}() missing required argument: '{name}'")


def _tree(op: str, next_token: Tensor, next_sibling: Tensor) -> TokenTree:
    try:
        tree = TokenTree.from_first_child_next_sibling(*_read_links(next_token, next_sibling))
        return tree.to(next_token.device)
    except ValidationError as e:
        raise KernelCheckError(f"{op}: retrive_next_token / retrive_next_sibling: not a tree: {e}") from e


def _read_links(next_token: Tensor, next_sibling: Tensor) -> tuple[Tensor, Tensor]:
    """The links sgl_kernel reads, as it walks from the root: each reached node's first child and each reached
    child's next sibling (never the root's); the links of nodes it never reaches (stale entries, padding) read as -1.
    int64 ``[B, N]`` on the CPU (the tree is built there); links that are not integer ``[B, N]`` of one shape are
    returned as given (the tree's checks name them)."""
    if not (isinstance(next_token, Tensor) and isinstance(next_sibling, Tensor) and next_token.dim() == 2
            and next_token.shape == next_sibling.shape and not next_token.dtype.is_floating_point
            and not next_sibling.dtype.is_floating_point and next_token.dtype != torch.bool):
        return next_token, next_sibling
    fc, ns = (t.detach().to("cpu", torch.int64, copy=True) for t in (next_token, next_sibling))  # ns is written
    B, N = fc.shape
    ns[:, :1] = -1
    reach = torch.zeros(B, N, dtype=torch.bool)
    reach[:, :1] = True
    rows = torch.arange(B)[:, None].expand(B, N)
    for _ in range(N):
        more = reach.clone()
        for links in (fc, ns):
            to = torch.where(reach, links, -1)
            on = (to >= 0) & (to < N)
            more[rows[on], to[on]] = True
        if torch.equal(more, reach):
            break
        reach = more
    return torch.where(reach, fc, -1), torch.where(reach, ns, -1)


def _check_slots(op: str, index: Tensor, tree: TokenTree, size: int, row: int | None = None) -> None:
    """``retrive_index``'s slots of the present nodes, checked on CPU tensors: inside ``[0, size)`` and, with ``row``,
    request b's inside its own row ``[b * row, (b + 1) * row)`` of a ``[B, row]`` tensor read there (no request
    reads another's row). Unchecked (device tensors), writes drop slots outside ``predicts`` and
    ``verify_tree_greedy`` keeps each request in its row. Slots that requests share are the caller's layout (SGLang's
    own tests give every request ``arange(N)``): each computes its outputs from its own rows, and a shared slot keeps
    the last write (:func:`_write_walk`)."""
    if not values_checkable(index, False):
        return
    B, N = index.shape
    slots, present = index.long(), tree.depth >= 0
    req = torch.arange(B)[:, None]
    lo = torch.zeros_like(slots) if row is None else (req * row).expand(B, N)
    hi = torch.full_like(slots, size) if row is None else ((req + 1) * row).clamp(max=size).expand(B, N)
    bad = present & ((slots < lo) | (slots >= hi))
    b = first_request(bad)
    if b is not None:
        where = f"[{int(lo[b, 0])}, {int(hi[b, 0])})"
        check(op, False, "retrive_index", f"slots in {where} (request {b}'s)", f"{int(slots[bad][0])} (request {b})")


def _write_walk(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, index: Tensor, path: Tensor,
                n: Tensor, values: Tensor) -> None:
    """sgl_kernel's outputs of a walk, written in place at the slots it writes and nowhere else.

    path: int64 ``[B, L]`` node ids from the root, n: accepted counts ``[B]`` (< L), values: int64
    ``[B, L]``, the token written at the predicts slot of path node k (k <= n). ``accept_index[b, k]``
    = the node's ``retrive_index`` for k <= n; ``predicts[retrive_index[path[k]]] = values[k]``.
    """
    L = path.shape[1]
    within = torch.arange(L, device=path.device) <= n[:, None]
    slots = index.long().gather(1, path.clamp(min=0))
    accept_index[:, :L] = torch.where(within, slots.to(accept_index.dtype), accept_index[:, :L])
    writes = within & (slots >= 0) & (slots < predicts.numel())  # a slot outside predicts is not written
    flat, vals = slots[writes], values[writes]
    # a slot written more than once (requests sharing slots) keeps the last write in request order, then path order:
    # what one thread per request, in turn, leaves (index_put_ leaves repeated indices to chance)
    at = torch.arange(flat.numel(), device=flat.device)
    last = torch.full((predicts.numel(),), -1, dtype=torch.int64, device=flat.device).scatter_reduce_(0, flat, at,
                                                                                                      "amax")
    keep = last[flat] == at
    predicts.index_put_((flat[keep],), vals[keep].to(predicts.dtype))
    accept_token_num.copy_(n.to(accept_token_num.dtype))


def _edge_probs(target_probs: Tensor, x: Tensor, tree: TokenTree) -> Tensor:
    """float32 ``[B, N]``: each node's token's probability in its parent's row of ``target_probs`` ``[B, N, V]``
    (``x``: the tokens, clamped into ``[0, V)``)."""
    B, N, V = target_probs.shape
    rows = torch.arange(B, device=x.device)[:, None] * N + tree.parents.clamp(min=0)
    return target_probs.reshape(-1, V)[rows.reshape(-1), x.reshape(-1)].view(B, N).float()


def _coin_choices(p_edge: Tensor, tree: TokenTree, coins: Tensor, threshold_single: Tensor,
                  threshold_acc: Tensor) -> tuple[Tensor, Tensor]:
    """SGLang's acceptance rule at every node at once: the child it moves to, and how many children it tests.

    At node v with coin ``u = coins[b, v]`` the children c are tested in sibling order with
    ``acc += p_v(x_c)``, and the first with ``p_v(x_c) > 0`` and either ``u < acc / threshold_acc`` or
    ``p_v(x_c) >= threshold_single`` is accepted (float32, sgl_kernel's order of operations). p_edge: float32
    ``[B, N]``, ``p_v(x_c)`` of each node c (0 for the root and for tokens outside the vocabulary). Returns the
    chosen child int64 ``[B, N]`` (-1: none) and the children tested ``[B, N]``.
    """
    choice = torch.full(p_edge.shape, -1, dtype=torch.int64, device=p_edge.device)
    tested = torch.zeros_like(choice)
    acc = torch.zeros_like(p_edge)
    kid = tree.first_child.clone()  # the k-th child of every node
    for _ in range(tree.max_children):
        live = (kid >= 0) & (choice < 0)
        c = kid.clamp(min=0)
        p = p_edge.gather(1, c)
        acc = torch.where(live, acc + p, acc)
        ok = live & (p > 0) & ((coins < acc / threshold_acc) | (p >= threshold_single))
        choice = torch.where(ok, kid, choice)
        tested += live
        kid = torch.where(live, tree.next_sibling.gather(1, c), -1)
    return choice, tested


@torch.no_grad()
def tree_speculative_sampling_target_only(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    retrive_index: Tensor | None = None,
    retrive_next_token: Tensor | None = None,
    retrive_next_sibling: Tensor | None = None,
    uniform_samples: Tensor | None = None,
    uniform_samples_for_final_sampling: Tensor | None = None,
    target_probs: Tensor | None = None,
    draft_probs: Tensor | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
    *,
    retrieve_index: Tensor | None = None,
    retrieve_next_token: Tensor | None = None,
    retrieve_next_sibling: Tensor | None = None,
) -> None:
    """Verify a draft tree per request with SGLang's target-only rule on the caller's coins, in place.

    Args (B requests, N draft nodes each, S = ``accept_index.shape[1]`` accept slots, V tokens):
        predicts: int32 ``[P]``, **written**: at the ``retrive_index`` slot of each accepted path
            node, the token accepted after it; at the last accepted node's slot, the correction
            (or bonus) token. Other slots keep their values.
        accept_index: int32 ``[B, S]``, **written** at ``[b, 0..n_b]``: the ``retrive_index`` of the
            root and of the ``n_b`` accepted nodes. Other entries keep their values.
        accept_token_num: int32 ``[B]``, **written**: ``n_b``, accepted drafts (at most S - 1).
        candidates: int64 ``[B, N]``, node tokens (the root's unused).
        retrive_index: int64 ``[B, N]``, each node's slot in ``predicts`` (also ``retrieve_index``).
        retrive_next_token, retrive_next_sibling: int64 ``[B, N]``, first child and next sibling
            (request-local, -1 = none; also ``retrieve_*``). Siblings are tested in link order.
        uniform_samples: float32 ``[B, N]``, the coin of each node (used when the walk is there).
        uniform_samples_for_final_sampling: float32 ``[B]``, the coin of the correction draw.
        target_probs: float32 ``[B, N, V]``, row v: the target distribution after node v.
        draft_probs: float32 ``[B, N, V]`` or None (all zeros). **Written**: at every node the walk
            leaves or stops at, ``draft_probs[b, v, x_c] = target_probs[b, v, x_c]`` for each child c
            it rejected (sgl_kernel's write-back). The correction is drawn from
            ``max(target_probs[b, s] - draft_probs[b, s], 0)`` at the stop node s (from the target row
            itself after S - 1 acceptances).
        threshold_single, threshold_acc: in [0, 1]. At node v with coin u, children c in sibling order
            accumulate ``acc += p_v(x_c)``; the first with ``p_v(x_c) > 0`` and either
            ``u < acc / max(threshold_acc, 1e-9)`` or ``p_v(x_c) >= threshold_single`` is accepted (float32,
            sgl_kernel's comparisons). Where the correction's row has no mass left (the rejected children
            took it all), the correction is the last child rejected there with ``p_v(x_c) > 0`` (else V - 1).
        deterministic: ignored (every path here is deterministic).

    Lossless only at the default thresholds 1.0 with ``draft_probs`` zero (or None), distinct sibling
    tokens and coins in [0, 1): the walk is then target-only tree verification (the child accepted at
    v is a draw from p_v by inversion in sibling order; the correction a draw from p_v without the
    rejected tokens), distributed exactly as ``specsampler.verify_tree(method="target_only")``.
    **Lossy modes** (SGLang's): ``threshold_acc < 1`` accepts with probability ``p / threshold_acc``
    and ``threshold_single < 1`` accepts any child with ``p >= threshold_single``; the emitted tokens
    are then off the target distribution. As in sgl_kernel, a child of probability 0 is never accepted, whatever
    the thresholds and the coin, and a repeated sibling token counts twice.
    """
    op = "tree_speculative_sampling_target_only"
    if isinstance(draft_probs, (int, float)):  # sgl_kernel's newer signature has no draft_probs: called positionally
        draft_probs, threshold_single, threshold_acc = None, draft_probs, threshold_single
    index, next_token, next_sibling = _links(
        op, (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
             ("retrive_next_sibling", retrive_next_sibling)),
        (("retrieve_index", retrieve_index), ("retrieve_next_token", retrieve_next_token),
         ("retrieve_next_sibling", retrieve_next_sibling)))
    _required(op, uniform_samples=uniform_samples,
              uniform_samples_for_final_sampling=uniform_samples_for_final_sampling, target_probs=target_probs)
    check(op, isinstance(target_probs, Tensor) and target_probs.dim() == 3, "target_probs", "a tensor [B, N, V]",
          getattr(target_probs, "shape", type(target_probs).__name__))
    B, N, V = target_probs.shape
    S = accept_index.shape[1] if isinstance(accept_index, Tensor) and accept_index.dim() == 2 else None
    check_dims(op, {"predicts": (predicts, (None,)), "accept_index": (accept_index, (B, None)),
                    "accept_token_num": (accept_token_num, (B,)), "candidates": (candidates, (B, N)),
                    "retrive_index": (index, (B, N)), "retrive_next_token": (next_token, (B, N)),
                    "retrive_next_sibling": (next_sibling, (B, N)), "uniform_samples": (uniform_samples, (B, N)),
                    "uniform_samples_for_final_sampling": (uniform_samples_for_final_sampling, (B,)),
                    "draft_probs": (draft_probs, (B, N, V))}, target_probs.device)
    for name, t, dtype in (("predicts", predicts, torch.int32), ("accept_index", accept_index, torch.int32),
                           ("accept_token_num", accept_token_num, torch.int32),
                           ("candidates", candidates, torch.int64), ("retrive_index", index, torch.int64),
                           ("retrive_next_token", next_token, torch.int64),
                           ("retrive_next_sibling", next_sibling, torch.int64),
                           ("uniform_samples", uniform_samples, torch.float32),
                           ("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling, torch.float32),
                           ("target_probs", target_probs, torch.float32), ("draft_probs", draft_probs, torch.float32)):
        if t is not None:
            check_dtype(name, t, dtype)
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        check(op, 0 <= value <= 1, name, "a value in [0, 1]", value)
    check(op, S >= 1 and V >= 1, "accept_index, target_probs", "S >= 1 accept slots and V >= 1 tokens", (S, V))
    if B == 0:
        return
    tree = _tree(op, next_token, next_sibling)
    _check_slots(op, index, tree, predicts.numel())
    x = candidates.long()
    in_vocab = (x >= 0) & (x < V)
    x = x.clamp(0, V - 1)
    t_single = torch.tensor(threshold_single, dtype=torch.float32)
    t_acc = torch.tensor(threshold_acc, dtype=torch.float32).clamp(min=1e-9)
    p_edge = torch.where(in_vocab & (tree.depth > 0), _edge_probs(target_probs, x, tree), 0.0)
    choice, tested = _coin_choices(p_edge, tree, uniform_samples, t_single.to(x.device), t_acc.to(x.device))
    walks_on = tree.depth < S - 1  # sgl_kernel stops after S - 1 acceptances: no child tested below that depth
    choice, tested = torch.where(walks_on, choice, -1), torch.where(walks_on, tested, 0)

    # The walk: specsampler's greedy tree walk over one-hot rows "the child chosen at v" (node ids as tokens).
    chosen = torch.zeros(B, N, N + 1, device=x.device).scatter_(2, torch.where(choice >= 0, choice, N)[..., None], 1.0)
    ids = torch.arange(N, device=x.device).expand(B, N)
    res = verify_tree(chosen, ids, tree, method="greedy")
    path, n, stop = res.path[:, :S], res.num_accepted, res.last_node

    parent = tree.parents.clamp(min=0)
    rank_of = tree.sibling_rank
    rejected = (tree.depth > 0) & in_vocab & (rank_of < tested.gather(1, parent)) & (choice.gather(1, parent) != ids)
    on_path = torch.zeros(B, N + 1, dtype=torch.bool, device=x.device)
    on_path.scatter_(1, torch.where(path >= 0, path, N), True)
    rejected &= on_path[:, :N].gather(1, parent)
    batch = torch.arange(B, device=x.device)
    if draft_probs is not None:
        b, c = rejected.nonzero(as_tuple=True)
        v, t = parent[b, c], x[b, c]
        draft_probs[b, v, t] = target_probs[b, v, t]
    w = target_probs[batch, stop].float()
    at_stop = rejected & (parent == stop[:, None])
    if draft_probs is not None:
        bonus = (n == S - 1)[:, None]
        w = torch.where(bonus, w, (w - draft_probs[batch, stop].float()).clamp(min=0.0))
    else:  # the rejected tokens of the stop node leave its row (sgl_kernel's mask without draft_probs)
        w = w.masked_fill(torch.zeros_like(w).scatter_add_(1, x, at_stop.float()) > 0, 0.0)
    # a row left without mass: the last child rejected at the stop node with mass (in sibling order), as sgl_kernel
    rank, child = torch.where(at_stop & (p_edge > 0), rank_of, -1).max(1)
    y = draw_with_coins(w, uniform_samples_for_final_sampling,
                        exhausted=torch.where(rank >= 0, x.gather(1, child[:, None])[:, 0], V - 1))

    following = torch.nn.functional.pad(x.gather(1, path[:, 1:].clamp(min=0)), (0, 1))
    values = torch.where(torch.arange(path.shape[1], device=x.device) == n[:, None], y[:, None], following)
    _write_walk(predicts, accept_index, accept_token_num, index, path, n, values)


tree_speculative_sampling_target_only_rejmask = tree_speculative_sampling_target_only


@torch.no_grad()
def verify_tree_greedy(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    retrive_index: Tensor | None = None,
    retrive_next_token: Tensor | None = None,
    retrive_next_sibling: Tensor | None = None,
    target_predict: Tensor | None = None,
    *,
    retrieve_index: Tensor | None = None,
    retrieve_next_token: Tensor | None = None,
    retrieve_next_sibling: Tensor | None = None,
) -> None:
    """Greedy tree verification against the target's argmax tokens, in place (:func:`specsampler.verify_tree`,
    ``method="greedy"``).

    Args: as :func:`tree_speculative_sampling_target_only` for the outputs, ``candidates`` and the
    links; ``target_predict``: int64 ``[B, N]``, the target's token after each node, read (as
    sgl_kernel does) at the node's ``retrive_index`` in the flattened tensor. From the root, the walk
    moves to the first child (link order) whose token equals the target's, at most S - 1 times;
    ``predicts`` gets the target's token at the slot of every node on the accepted path.
    """
    op = "verify_tree_greedy"
    index, next_token, next_sibling = _links(
        op, (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
             ("retrive_next_sibling", retrive_next_sibling)),
        (("retrieve_index", retrieve_index), ("retrieve_next_token", retrieve_next_token),
         ("retrieve_next_sibling", retrieve_next_sibling)))
    _required(op, target_predict=target_predict)
    check(op, isinstance(candidates, Tensor) and candidates.dim() == 2, "candidates", "a tensor [B, N]",
          getattr(candidates, "shape", type(candidates).__name__))
    B, N = candidates.shape
    check_dims(op, {"predicts": (predicts, (None,)), "accept_index": (accept_index, (B, None)),
                    "accept_token_num": (accept_token_num, (B,)), "retrive_index": (index, (B, N)),
                    "retrive_next_token": (next_token, (B, N)), "retrive_next_sibling": (next_sibling, (B, N)),
                    "target_predict": (target_predict, (B, N))}, candidates.device)
    for name, t, dtype in (("predicts", predicts, torch.int32), ("accept_index", accept_index, torch.int32),
                           ("accept_token_num", accept_token_num, torch.int32),
                           ("candidates", candidates, torch.int64), ("retrive_index", index, torch.int64),
                           ("retrive_next_token", next_token, torch.int64),
                           ("retrive_next_sibling", next_sibling, torch.int64),
                           ("target_predict", target_predict, torch.int64)):
        check_dtype(name, t, dtype)
    S = accept_index.shape[1]
    check(op, S >= 1, "accept_index", "S >= 1 accept slots", S)
    if B == 0:
        return
    tree = _tree(op, next_token, next_sibling)
    _check_slots(op, index, tree, predicts.numel(), row=N)
    # sgl_kernel reads the target at the node's retrive_index of the flat [B * N] tensor, in request b's row
    # (kept there where the values go unchecked, for the writes too)
    row_start = torch.arange(B, device=index.device)[:, None] * N
    own = (index.long() - row_start).clamp(0, N - 1)
    predicted, index = target_predict.gather(1, own), row_start + own
    local = local_ids(torch.cat([candidates, predicted], 1))
    sentinel = 2 * N  # a row at it matches no child: the walk stops (after S - 1 acceptances)
    row_token = torch.where(tree.depth < S - 1, local[:, N:], sentinel)
    rows = torch.zeros(B, N, 2 * N + 1, device=candidates.device).scatter_(2, row_token[..., None], 1.0)
    res = verify_tree(rows, local[:, :N], tree, method="greedy")
    path = res.path[:, :S]
    _write_walk(predicts, accept_index, accept_token_num, index, path, res.num_accepted,
                predicted.gather(1, path.clamp(min=0)))


# sgl_kernel (0.4.10) exports its host implementation of the same walk under this name for CPU engines; here
# one function serves both (CPU and CUDA tensors)
verify_tree_greedy_cpu = verify_tree_greedy
