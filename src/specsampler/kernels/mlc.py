"""Seed 000's ``batch_spec_verify`` as a Triton kernel: one program per request walks its token tree.

The same rule as :func:`specsampler.mlc.batch_spec_verify` (global node indices; accept iff
``p >= u * q``; on a rejection the parent's row of ``model_probs`` becomes the normalised residual
``max(p - q, 0) / sum``, in place, unless the sum is below 1e-7, which accepts a child whose token
is in the vocabulary; ``token_tree_parent_ptr`` in/out). A rejection reads the parent and child
rows twice (the residual's mass, then the write); an acceptance reads two scalars.

The requests' trees must be disjoint (as in MLC): each program writes only its own rows. The
residual's mass is summed block by block, so rewritten rows can differ from the reference's in the
last bits of float32.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .rows import STAGES, launch_options

_DEGENERATE_SUM = tl.constexpr(1e-7)  # as specsampler.mlc: a smaller residual mass accepts the child


@triton.jit
def _link(links_ptr, node, stride, N):
    """``links[node]`` as an int64 node index, -1 when outside ``[0, N)``."""
    v = tl.load(links_ptr + node * stride).to(tl.int64)
    return tl.where((v >= 0) & (v < N), v, -1)


@triton.jit
def _residual_mass(m_row, q_row, V, BLOCK_V: tl.constexpr):
    """``sum(max(m - q, 0))`` over a row, block by block."""
    mass = tl.full((), 0.0, tl.float32)
    for start in tl.range(0, V, BLOCK_V, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK_V)
        m = tl.load(m_row + offs, mask=offs < V, other=0.0)
        q = tl.load(q_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        mass += tl.sum(tl.maximum(m - q, 0.0), 0)
    return mass


@triton.jit
def _write_residual(m_row, q_row, V, mass, BLOCK_V: tl.constexpr):
    """``m = max(m - q, 0) / mass`` over a row, in place."""
    for start in tl.range(0, V, BLOCK_V, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK_V)
        m = tl.load(m_row + offs, mask=offs < V, other=0.0)
        q = tl.load(q_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        tl.store(m_row + offs, tl.maximum(m - q, 0.0) / mass, mask=offs < V)


@triton.jit(do_not_specialize=["N", "stride_dp", "stride_dt", "stride_fc", "stride_ns", "stride_u"],
            do_not_specialize_on_alignment=["dt_ptr", "fc_ptr", "ns_ptr", "u_ptr", "pp_ptr"])
def _spec_verify_kernel(
    dp_ptr,  # float [N, V], last dim contiguous: draft_probs
    dt_ptr,  # int [N]: draft_tokens
    mp_ptr,  # float32 [N, V], contiguous: model_probs (in place)
    fc_ptr,  # int [N]: token_tree_first_child
    ns_ptr,  # int [N]: token_tree_next_sibling
    u_ptr,  # float [N]: uniform_samples
    pp_ptr,  # int [nbatch]: token_tree_parent_ptr (in/out)
    N,  # num_nodes
    V,  # vocabulary size
    stride_dp,  # draft_probs' row stride
    stride_dt,  # and those of the vectors
    stride_fc,
    stride_ns,
    stride_u,
    BLOCK_V: tl.constexpr,  # vocabulary entries per block
):
    """One program per request walks its tree (reference :func:`specsampler.mlc.batch_spec_verify`; plain loop
    in ``tests/mlc/test_mlc_verify.py``)."""
    b = tl.program_id(0)
    root = tl.load(pp_ptr + b).to(tl.int64)
    parent = tl.minimum(tl.maximum(root, 0), N - 1)
    child = tl.where(root == parent, _link(fc_ptr, parent, stride_fc, N), -1)  # a root out of range: no walk
    steps = tl.full((), 0, tl.int32)
    go = child >= 0
    while go:
        x = tl.load(dt_ptr + child * stride_dt).to(tl.int64)
        in_vocab = (x >= 0) & (x < V)
        m_row = mp_ptr + parent * V
        q_row = dp_ptr + child * stride_dp
        p = tl.load(m_row + x, mask=in_vocab, other=0.0)
        q = tl.load(q_row + x, mask=in_vocab, other=0.0).to(tl.float32)
        accept = in_vocab & (p >= tl.load(u_ptr + child * stride_u).to(tl.float32) * q)
        if ~accept:
            mass = _residual_mass(m_row, q_row, V, BLOCK_V)
            degenerate = mass < _DEGENERATE_SUM
            if ~degenerate:
                _write_residual(m_row, q_row, V, mass, BLOCK_V)
                tl.debug_barrier()  # the row's new values are read by other threads next
            accept = degenerate & in_vocab
        next_child = tl.where(accept, _link(fc_ptr, child, stride_fc, N), _link(ns_ptr, child, stride_ns, N))
        parent = tl.where(accept, child, parent)
        child = next_child
        steps += 1
        go = (child >= 0) & (steps <= N)  # at most N + 1 steps: a cycle in the links ends the walk
    tl.store(pp_ptr + b, parent.to(pp_ptr.dtype.element_ty))


def batch_spec_verify(
    draft_probs: Tensor,
    draft_tokens: Tensor,
    model_probs: Tensor,
    token_tree_first_child: Tensor,
    token_tree_next_sibling: Tensor,
    uniform_samples: Tensor,
    token_tree_parent_ptr: Tensor,
    *,
    block_v: int = 4096,
) -> None:
    """The kernel of :func:`specsampler.mlc.batch_spec_verify`, on inputs its checks accepted.

    Args:
        draft_probs: float ``[num_nodes, V]``, last dim contiguous (else copied): row c is the
            distribution node c's token was drawn from.
        draft_tokens: integer ``[num_nodes]``: each node's token; outside ``[0, V)`` never accepted.
        model_probs: float32 ``[num_nodes, V]``, contiguous. **Modified in place**: on a rejection
            the parent's row becomes the normalised residual.
        token_tree_first_child, token_tree_next_sibling: integer ``[num_nodes]``: global node
            indices, -1 (or any value outside ``[0, num_nodes)``) = none.
        uniform_samples: float ``[num_nodes]``: the acceptance uniform of each node.
        token_tree_parent_ptr: integer ``[nbatch]``, contiguous. **In/out**: each request's root
            (disjoint trees), then its last accepted node.
        block_v: vocabulary entries per block at most (a power of 2); rows are read in blocks of
            ``min(block_v, next_power_of_2(V))``.
    """
    num_nodes, V = draft_probs.shape
    nbatch = token_tree_parent_ptr.numel()
    if nbatch == 0:
        return
    dp = draft_probs if draft_probs.stride(1) == 1 else draft_probs.contiguous()
    block = min(block_v, triton.next_power_of_2(V))
    _spec_verify_kernel[(nbatch,)](
        dp_ptr=dp, dt_ptr=draft_tokens, mp_ptr=model_probs, fc_ptr=token_tree_first_child,
        ns_ptr=token_tree_next_sibling, u_ptr=uniform_samples, pp_ptr=token_tree_parent_ptr, N=num_nodes, V=V,
        stride_dp=dp.stride(0), stride_dt=draft_tokens.stride(0), stride_fc=token_tree_first_child.stride(0),
        stride_ns=token_tree_next_sibling.stride(0), stride_u=uniform_samples.stride(0), BLOCK_V=block,
        **launch_options(8 if block >= 2048 else 4),
    )
