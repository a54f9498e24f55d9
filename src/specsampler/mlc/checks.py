"""Argument checks of the MLC entry points: MLC's loosely typed arguments (Python sequences of ints,
lists of results, cumulative lengths) checked and turned into CPU tensors, with errors naming the entry."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import Tensor

from ..validation import check_tensor, fail
from .results import SampleResult


def _is_int(v: object) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _checked_list(op: str, name: str, values: object, n: int | None, what: str, kind: type) -> list:
    """``values`` as a list of ``n`` (when given) instances of ``kind``."""
    if isinstance(values, (str, bytes, Tensor)) or not isinstance(values, Iterable):
        fail(op, name, f"a sequence of {kind.__name__}", type(values).__name__)
    values = list(values)
    if n is not None and len(values) != n:
        fail(op, name, f"{n} entries ({what})", f"{len(values)} entries")
    for i, v in enumerate(values):
        if not isinstance(v, kind):
            fail(op, f"{name}[{i}]", f"a {kind.__name__}", type(v).__name__, request=i)
    return values


def _host_ints(op: str, name: str, values: object) -> Tensor:
    """A sequence of ints (or a 1-D integer tensor) as a CPU int64 tensor."""
    if isinstance(values, Tensor):
        check_tensor(op, name, values, kind="int", ndim=1)
        return values.to("cpu", torch.int64)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        fail(op, name, "a sequence of ints or a 1-D integer tensor", type(values).__name__)
    values = list(values)
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    try:
        t = torch.tensor(values)  # ints give an integer dtype; a float or a bool among them does not
    except (TypeError, ValueError, RuntimeError, OverflowError):
        t = None
    if t is None or t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        bad = next((i for i, v in enumerate(values) if not _is_int(v)), None)
        if bad is not None:
            fail(op, f"{name}[{bad}]", "an int", repr(values[bad]))
        fail(op, name, "a sequence of ints that fit in int64", "other values")
    return t.to(torch.int64)


def _check_cum(op: str, cum: Tensor, B: int, num_nodes: int) -> Tensor:
    """Check ``cum_verify_lengths`` (CPU int64 ``[B+1]``) and return the node counts ``[B]``."""
    if cum.numel() != B + 1:
        fail(op, "cum_verify_lengths", f"B + 1 = {B + 1} entries (B = len(request_ids))", f"{cum.numel()} entries")
    if int(cum[0]) != 0:
        fail(op, "cum_verify_lengths[0]", "0", int(cum[0]))
    lengths = cum[1:] - cum[:-1]
    bad = (lengths < 1).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        fail(op, f"cum_verify_lengths[{i + 1}]",
             f"> cum_verify_lengths[{i}] = {int(cum[i])} (every request has its root node)", int(cum[i + 1]),
             request=i)
    if int(cum[-1]) != num_nodes:
        fail(op, f"cum_verify_lengths[{B}]", f"the number of rows of probs, {num_nodes}", int(cum[-1]))
    return lengths


def _draft_tokens(op: str, draft_output_tokens, lengths: Tensor, V: int) -> Tensor:
    """The draft token ids of all non-root nodes, request by request: CPU int64 ``[num_nodes - B]``."""
    B = lengths.numel()
    if isinstance(draft_output_tokens, (str, bytes, Tensor)) or not isinstance(draft_output_tokens, Iterable):
        fail(op, "draft_output_tokens", "a sequence of lists of SampleResult", type(draft_output_tokens).__name__)
    outer = list(draft_output_tokens)
    if len(outer) != B:
        fail(op, "draft_output_tokens", f"{B} lists (one per request)", f"{len(outer)} entries")
    flat = []
    for i, (drafts, n) in enumerate(zip(outer, lengths.tolist())):
        name = f"draft_output_tokens[{i}]"
        if isinstance(drafts, (str, bytes)) or not isinstance(drafts, Iterable):
            fail(op, name, "a sequence of SampleResult", type(drafts).__name__, request=i)
        drafts = list(drafts)
        if len(drafts) != n - 1:
            fail(op, name, f"{n - 1} draft tokens (cum_verify_lengths gives {n} nodes, the root included)",
                 f"{len(drafts)}", request=i)
        for k, d in enumerate(drafts):
            if not isinstance(d, SampleResult):
                fail(op, f"{name}[{k}]", "a SampleResult", type(d).__name__, request=i)
            t = d.sampled_token_id[0]
            if not _is_int(t) or not 0 <= t < V:
                fail(op, f"{name}[{k}].sampled_token_id[0]", f"a token id in [0, {V})", repr(t), request=i)
            flat.append(int(t))
    return torch.tensor(flat, dtype=torch.int64)


def _parent_ptr(op: str, token_tree_parent_ptr, cum: Tensor, lengths: Tensor) -> Tensor:
    """Check the request-local parent pointers; CPU int64 ``[num_nodes]``."""
    parents = _host_ints(op, "token_tree_parent_ptr", token_tree_parent_ptr)
    num_nodes = int(cum[-1])
    if parents.numel() != num_nodes:
        fail(op, "token_tree_parent_ptr", f"{num_nodes} entries (one per node, cum_verify_lengths[-1])",
             f"{parents.numel()} entries")
    request = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    node = torch.arange(num_nodes) - cum[:-1][request]
    bad = torch.where(node == 0, parents != -1, (parents < 0) | (parents >= node)).nonzero()
    if bad.numel():
        g = int(bad[0, 0])
        b, j = int(request[g]), int(node[g])
        expected = "-1 (node 0 is the request's root)" if j == 0 else f"a request-local parent index in [0, {j})"
        fail(op, f"token_tree_parent_ptr[{g}] (node {j})", expected, int(parents[g]), request=b)
    return parents

