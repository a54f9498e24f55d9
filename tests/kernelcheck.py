"""Shared pieces of the kernel-versus-reference tests (the kernels run in the Triton interpreter on
CPU tensors without a GPU, on CUDA tensors with one)."""

import contextlib

import numpy as np
import torch

from specsampler import TokenTree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def to_device(items):
    """A tuple (or named tuple) with its tensors and token trees moved to :data:`DEVICE`."""
    moved = [t.to(DEVICE) if isinstance(t, (torch.Tensor, TokenTree)) else t for t in items]
    return type(items)(*moved) if hasattr(items, "_fields") else tuple(moved)


def chain_shape(g: torch.Generator, b_max: int, k_max: int) -> tuple[int, int, int]:
    """A random (B, K, V): B in 1..b_max, K in 1..k_max, V in 3..300."""
    return (int(torch.randint(1, b_max + 1, (1,), generator=g)), int(torch.randint(1, k_max + 1, (1,), generator=g)),
            int(torch.randint(3, 301, (1,), generator=g)))


def assert_same_chain(kernel, ref, label: str) -> None:
    """A chain kernel's (tokens, num_accepted) equal the reference's ChainResult."""
    tokens, num_accepted = kernel
    assert torch.equal(num_accepted, ref.num_accepted), f"{label}: num_accepted {num_accepted} != {ref.num_accepted}"
    assert torch.equal(tokens, ref.tokens), f"{label}: tokens\n{tokens}\n!= reference\n{ref.tokens}"


def traversal_slots_case(sampling: str, B: int = 16):
    """Inputs of the traversal tests whose slots must keep their own scratch rows (the tree, target
    rows p, draft rows q, tokens x on :data:`DEVICE`; V = 4). Root children Z (a leaf), A (two
    leaves), B (one leaf); leaves carry tokens out of range. Z's deletion makes the root's Mb
    [0, .25, .25, .5]; A (a = .5) has its Mb updated twice, the second time swapped in from the spare
    row, and then it is accepted (Mb [0, 0, 1, 0]) or deleted, making the root's Mb [0, 0, 0, 1]; B
    (a = 0) is pushed into A's slot and its Mb updated: that must not touch the root's, which draws
    token 3. So the token is 2 when A is accepted (probability 0.2), else 3. Dyadic values."""
    V = 4
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 0, 2, 2, 3]] * B)).to(DEVICE)
    quarter = [0.25] * 4
    p = torch.tensor([[0.0, 0.375, 0.375, 0.25], quarter, quarter, quarter, quarter, quarter, quarter])
    q = torch.tensor([quarter, [0.5, 0.25, 0.25, 0.0], [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0],
                      [0.125, 0.125, 0.0, 0.75], [0.5, 0.5, 0.0, 0.0], quarter])
    if sampling == "without_replacement":  # siblings hold the first child's q; removals give the rows above
        q = q[[0, 1, 1, 1, 4, 4, 6]]
    p, q = p.expand(B, 7, V).contiguous().to(DEVICE), q.expand(B, 7, V).contiguous().to(DEVICE)
    x = torch.tensor([[0, -1, 1, 0, V + 2, -1, V]], device=DEVICE).expand(B, 7).contiguous()
    return tree, p, q, x


def assert_traversal_slots_outcome(path: torch.Tensor, n: torch.Tensor, y: torch.Tensor) -> None:
    """The outcome :func:`traversal_slots_case` implies: A accepted (token 2) or not (token 3), sometimes."""
    assert torch.equal(y, torch.where(n == 1, 2, 3)) and (path[:, 1] == torch.where(n == 1, 2, -1)).all()
    assert 0 < int(n.sum()) < n.numel() // 2  # A is accepted with probability 0.2


@contextlib.contextmanager
def recorded_loads(monkeypatch):
    """Inside, every address a masked load of the Triton interpreter reads is recorded in the list
    yielded (numpy arrays; see :func:`row_reads`)."""
    from triton.runtime.interpreter import InterpreterBuilder

    loaded = []
    load = InterpreterBuilder.create_masked_load

    def recording_load(self, ptrs, mask, *args):
        loaded.append(ptrs.data[mask.data.astype(bool)])
        return load(self, ptrs, mask, *args)

    with monkeypatch.context() as m:
        m.setattr(InterpreterBuilder, "create_masked_load", recording_load)
        yield loaded


def row_reads(loaded: list, t: torch.Tensor) -> torch.Tensor:
    """How many of the recorded loads fell in each row of ``t`` ``[B, R, V]`` (rows contiguous):
    int64 ``[B, R]``."""
    B, R, V = t.shape
    addresses = torch.from_numpy(np.concatenate(loaded).astype(np.int64)) if loaded else torch.zeros(0).long()
    starts = t.data_ptr() + t.element_size() * (t.stride(0) * torch.arange(B)[:, None] + t.stride(1) * torch.arange(R))
    starts = starts.view(-1)
    hit = (addresses[:, None] >= starts) & (addresses[:, None] < starts + t.element_size() * V)
    return hit.sum(0).view(B, R)
