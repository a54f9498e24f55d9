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
