"""MLC-LLM's ``batch_spec_verify`` (``python/mlc_llm/op/batch_spec_verify.py``): its tree verification kernel
with global node indices and in-place buffers, on the PyTorch path or its Triton kernel (on CUDA tensors).

The rule and where it is lossy: docs/design.md, "Upstream entry points (MLC-LLM, LongSpec)".
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..kernels import use_triton
from ..sampling.processing import row_sum
from ..validation import check_device, check_mode, check_no_bad, check_shape, check_tensor, fail, values_checkable

_DEGENERATE_SUM = 1e-7  # a residual with a smaller mass is not renormalised: the child is accepted (as MLC-LLM)


def _check_node_values(op: str, name: str, bad: Tensor, values: Tensor, expected: str) -> None:
    """Fail on the first True of ``bad`` (indexed by node, then token), naming that entry."""
    hit = torch.nonzero(bad)
    if hit.numel():
        idx = tuple(int(i) for i in hit[0])
        fail(op, f"{name}[{', '.join(map(str, idx))}]", expected, values[idx].item())


def _check_contiguous(op: str, name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        fail(op, name, "a contiguous tensor (it is written in place)", f"strides {t.stride()}")


def _check_inputs(
    op: str,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    model_probs: Tensor,
    first_child: Tensor,
    next_sibling: Tensor,
    uniform_samples: Tensor,
    parent_ptr: Tensor,
    full: bool,
) -> None:
    check_tensor(op, "draft_probs", draft_probs, kind="float", ndim=2)
    num_nodes, V = draft_probs.shape
    if num_nodes == 0 or V == 0:
        fail(op, "draft_probs", "shape [num_nodes, V] with num_nodes >= 1 and V >= 1", list(draft_probs.shape))
    dev = draft_probs.device

    check_tensor(op, "draft_tokens", draft_tokens, kind="int", ndim=1)
    check_shape(op, "draft_tokens", draft_tokens, (num_nodes,), "[num_nodes]")
    check_device(op, "draft_tokens", draft_tokens, dev)

    check_tensor(op, "model_probs", model_probs, kind="float", ndim=2)
    check_shape(op, "model_probs", model_probs, (num_nodes, V), "[num_nodes, V]")
    check_device(op, "model_probs", model_probs, dev)
    if model_probs.dtype != torch.float32:
        fail(op, "model_probs", "dtype torch.float32 (it is written in place)", model_probs.dtype)
    _check_contiguous(op, "model_probs", model_probs)

    for name, t in (("token_tree_first_child", first_child), ("token_tree_next_sibling", next_sibling)):
        check_tensor(op, name, t, kind="int", ndim=1)
        check_shape(op, name, t, (num_nodes,), "[num_nodes]")
        check_device(op, name, t, dev)
        if values_checkable(t, full):
            _check_node_values(op, name, (t < -1) | (t >= num_nodes), t, f"node indices in [-1, {num_nodes})")

    check_tensor(op, "uniform_samples", uniform_samples, kind="float", ndim=1)
    check_shape(op, "uniform_samples", uniform_samples, (num_nodes,), "[num_nodes]")
    check_device(op, "uniform_samples", uniform_samples, dev)

    check_tensor(op, "token_tree_parent_ptr", parent_ptr, kind="int", ndim=1)
    check_device(op, "token_tree_parent_ptr", parent_ptr, dev)
    _check_contiguous(op, "token_tree_parent_ptr", parent_ptr)
    if values_checkable(parent_ptr, full):
        bad = (parent_ptr < 0) | (parent_ptr >= num_nodes)
        check_no_bad(op, "token_tree_parent_ptr", bad, parent_ptr, f"root node indices in [0, {num_nodes})")

    if full:
        # Draft tokens, draft rows and uniforms are read only for nodes that are some node's child.
        linked = torch.zeros(num_nodes, dtype=torch.bool, device=dev)
        for links in (first_child, next_sibling):
            linked[links[links >= 0].long()] = True
        tok = draft_tokens
        _check_node_values(op, "draft_tokens", linked & ((tok < 0) | (tok >= V)), tok, f"token ids in [0, {V})")
        for name, probs, rows in (("draft_probs", draft_probs, linked[:, None]), ("model_probs", model_probs, True)):
            bad = ~(torch.isfinite(probs) & (probs >= 0)) & rows
            _check_node_values(op, name, bad, probs, "finite probabilities >= 0")
        u = uniform_samples
        _check_node_values(op, "uniform_samples", linked & ~((u >= 0) & (u <= 1)), u, "values in [0, 1]")


@torch.no_grad()
def batch_spec_verify(
    draft_probs: Tensor,
    draft_tokens: Tensor,
    model_probs: Tensor,
    token_tree_first_child: Tensor,
    token_tree_next_sibling: Tensor,
    uniform_samples: Tensor,
    token_tree_parent_ptr: Tensor,
    *,
    validate: str = "structure",
) -> None:
    """Verify a batch of draft token trees as MLC-LLM's ``batch_spec_verify`` kernel does.

    All node indices are global: the trees of all requests live in one array of
    ``num_nodes`` nodes, every request's tree in its own (disjoint) set of nodes.

    Args:
        draft_probs: float ``[num_nodes, V]``; row c is the draft distribution node c's token
            was drawn from (rows of roots are not read).
        draft_tokens: int ``[num_nodes]``; the token of each node. A token outside ``[0, V)`` is
            never accepted: it goes through the rejection branch with its draft row.
        model_probs: float32 ``[num_nodes, V]``, contiguous; row v is the target distribution at
            node v, used to verify v's children. **Modified in place**: when a child of v is
            rejected, row v is replaced by the normalised residual ``max(p_v - q_child, 0)``.
        token_tree_first_child: int ``[num_nodes]``; first child of each node, -1 = none.
        token_tree_next_sibling: int ``[num_nodes]``; next sibling of each node, -1 = none.
        uniform_samples: float ``[num_nodes]``; uniform in [0, 1) for the acceptance test of each node.
        token_tree_parent_ptr: int ``[nbatch]``, contiguous. **In/out**: on input the root node of
            each request; on output the last accepted node of each request.
        validate: ``"structure"`` (default) or ``"full"``, see :mod:`specsampler.validation`. Node
            indices are checked on CPU tensors or in full mode; full mode also checks token ids
            and probability values of the nodes read.

    For each request, starting at ``parent = root`` and ``child = first_child[parent]``, while
    ``child != -1``: with ``x = draft_tokens[child]``, accept iff
    ``model_probs[parent, x] >= uniform_samples[child] * draft_probs[child, x]`` and move to
    ``parent = child``, ``child = first_child[child]``. Otherwise compute
    ``r = max(model_probs[parent] - draft_probs[child], 0)``: if ``sum(r) < 1e-7`` accept
    anyway, else set ``model_probs[parent] = r / sum(r)`` and try ``next_sibling[child]``. At
    the end ``token_tree_parent_ptr[b] = parent``; the caller then samples the next token from
    ``model_probs[token_tree_parent_ptr[b]]``. Computed in float32.

    Lossless only when sibling drafts were drawn i.i.d. from the same distribution. For
    children chosen deterministically (top-k, beam) this rule is off the target distribution;
    use ``specsampler.verify_tree(..., method="target_only")``. For siblings drawn without
    replacement use ``specsampler.verify_tree(..., method="rrs", draft_sampling="without_replacement")``.

    Whatever the values, nothing is read out of bounds and the output pointers are node indices:
    links outside ``[-1, num_nodes)`` end the walk like -1, a root outside ``[0, num_nodes)``
    is clamped into range and not walked, and a walk stops after ``num_nodes + 1`` steps
    (a cycle in the links).
    """
    op = "mlc.batch_spec_verify"
    full = check_mode(op, validate)
    _check_inputs(
        op,
        draft_probs,
        draft_tokens,
        model_probs,
        token_tree_first_child,
        token_tree_next_sibling,
        uniform_samples,
        token_tree_parent_ptr,
        full,
    )
    # buffers an engine made under torch.inference_mode are written as there (torch refuses in-place writes to them
    # outside it: the op failed after writing model_probs, leaving the pointers behind); dynamo cannot trace the
    # question, and a compiled graph's writes are its own
    outside = not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled() and (
        model_probs.is_inference() or token_tree_parent_ptr.is_inference())
    with torch.inference_mode() if outside else contextlib.nullcontext():
        _verify(draft_probs, draft_tokens, model_probs, token_tree_first_child, token_tree_next_sibling,
                uniform_samples, token_tree_parent_ptr)


def _verify(draft_probs: Tensor, draft_tokens: Tensor, model_probs: Tensor, token_tree_first_child: Tensor,
            token_tree_next_sibling: Tensor, uniform_samples: Tensor, token_tree_parent_ptr: Tensor) -> None:
    """:func:`batch_spec_verify` of checked inputs."""
    num_nodes, V = draft_probs.shape
    if use_triton(model_probs.device):
        from ..kernels import ops

        ops.mlc_batch_spec_verify(draft_probs, draft_tokens, model_probs, token_tree_first_child,
                                  token_tree_next_sibling, uniform_samples, token_tree_parent_ptr)
        return

    def links(t: Tensor) -> Tensor:
        """int64 copy with every value outside [-1, num_nodes) read as -1."""
        t = t.long()
        return torch.where((t >= 0) & (t < num_nodes), t, -1)

    first_child, next_sibling = links(token_tree_first_child), links(token_tree_next_sibling)
    roots = token_tree_parent_ptr.long()
    parent = roots.clamp(0, num_nodes - 1)
    child = torch.where(roots == parent, first_child[parent], -1)
    walking = torch.nonzero(child >= 0).squeeze(1)  # requests still walking

    with torch.no_grad():
        for _ in range(num_nodes + 1):
            if walking.numel() == 0:
                break
            par, chi = parent[walking], child[walking]
            tok = draft_tokens[chi].long()
            in_vocab = (tok >= 0) & (tok < V)
            tok = tok.clamp(0, V - 1)
            p = model_probs[par, tok]
            q = draft_probs[chi, tok].float()
            accept = in_vocab & (p >= uniform_samples[chi].float() * q)

            rejected = torch.nonzero(~accept).squeeze(1)
            if rejected.numel():
                rows = par[rejected]
                residual = (model_probs[rows] - draft_probs[chi[rejected]].float()).clamp_min(0.0)
                mass = row_sum(residual)
                degenerate = mass < _DEGENERATE_SUM
                write = ~degenerate
                model_probs[rows[write]] = residual[write] / mass[write, None]
                accept[rejected[degenerate & in_vocab[rejected]]] = True

            parent[walking] = torch.where(accept, chi, par)
            child[walking] = torch.where(accept, first_child[chi], next_sibling[chi])
            walking = walking[child[walking] >= 0]
        token_tree_parent_ptr.copy_(parent)

