"""Shared pieces of the kernel-versus-reference tests (the kernels run in the Triton interpreter on
CPU tensors without a GPU, on CUDA tensors with one)."""

import contextlib

import numpy as np
import torch

import specsampler as ss
from specsampler import TokenTree, mlc

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def to_device(items):
    """A tuple (or named tuple) with its tensors and token trees moved to :data:`DEVICE`."""
    moved = [t.to(DEVICE) if isinstance(t, (torch.Tensor, TokenTree)) else t for t in items]
    return type(items)(*moved) if hasattr(items, "_fields") else tuple(moved)


def on_device(fn):
    """``fn`` (a kernel launcher) with its tensor arguments moved to :data:`DEVICE` and its tensor outputs
    (one, or a tuple) back on the CPU: tests written with CPU tensors run the real kernels on a GPU."""
    def move(v):
        return v.to(DEVICE) if isinstance(v, torch.Tensor) else v

    def run(*args, **kwargs):
        out = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
        return out.cpu() if isinstance(out, torch.Tensor) else tuple(t.cpu() for t in out)

    return run


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


def mlc_case(g: torch.Generator, V: int) -> tuple:
    """Inputs of :func:`specsampler.mlc.batch_spec_verify` for two requests of 7 nodes: nodes 0-3 (root 0,
    children 1 and 2, 3 under 1) and nodes 4-6 (root 4, a chain 5, 6): ``(draft_probs, draft_tokens,
    model_probs, first_child, next_sibling, uniform_samples, parent_ptr)``, the last two in/out."""
    first_child = torch.tensor([1, 3, -1, -1, 5, 6, -1], dtype=torch.int32)
    next_sibling = torch.tensor([-1, 2, -1, -1, -1, -1, -1], dtype=torch.int32)
    draft_probs = torch.softmax(torch.randn(7, V, generator=g) * 2, -1)
    model = torch.softmax(torch.randn(7, V, generator=g) * 2, -1)
    tokens = torch.multinomial(draft_probs, 1, generator=g)[:, 0].int()
    u = torch.rand(7, generator=g)
    return draft_probs, tokens, model, first_child, next_sibling, u, torch.tensor([0, 4], dtype=torch.int32)


KERNEL_OPS = ("verify_chain", "verify_chain_from_logits", "verify_tree", "verify_tree_from_logits",
              "sample_from_logits", "sample", "mlc_batch_spec_verify")


def as_tuple(out) -> tuple:
    """A call's output tensors: one tensor, or a tuple of them, as a tuple."""
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def public_op_calls(device, V: int = 40) -> dict:
    """One call of each public function that runs a kernel (a torch custom op) on ``device``, by the
    op's name (:data:`KERNEL_OPS`): ``{name: fn(rng) -> the call's output tensors}`` (``rng`` a
    :class:`specsampler.Philox` over 3 requests). Sampled drafts, top-k / top-p rows, a vocabulary mask
    and a tree with two branches: the ops' optional arguments are given. Every tensor is on ``device``
    before a call: the calls copy nothing from the host."""
    g = torch.Generator().manual_seed(21)
    B, K, N = 3, 2, 4
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1)
    x = torch.where(torch.rand(B, K, generator=g) < 0.7, p[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g))
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]] * B))
    xt = torch.randint(0, V, (B, N), generator=g)
    xt[:, 1] = logits[:, 0].argmax(-1)
    tree_logits = torch.randn(B, N, V, generator=g) * 3
    qt = torch.softmax(torch.randn(B, N, V, generator=g) * 3, -1)
    mask = torch.rand(B, 1, V, generator=g) < 0.9
    mask[..., 0] = True
    (logits, p, q, x, tree, xt, tree_logits, qt, mask) = (t.to(device) for t in (logits, p, q, x, tree, xt,
                                                                                  tree_logits, qt, mask))
    params = ss.SamplingParams(temperature=torch.tensor([0.0, 0.8, 1.1], device=device),
                               top_k=torch.tensor([0, 10, 0], device=device),
                               top_p=torch.tensor([1.0, 0.9, 0.8], device=device))
    mlc_q, mlc_x, mlc_p, first_child, next_sibling, mlc_u, roots = (t.to(device) for t in mlc_case(g, V))

    def mlc_verify(rng):
        m, ptr = mlc_p.clone(), roots.clone()
        mlc.batch_spec_verify(mlc_q, mlc_x, m, first_child, next_sibling, mlc_u, ptr)
        return m, ptr

    return {
        "verify_chain": lambda rng: ss.verify_chain(p, x, q, method="token", rng=rng).tokens,
        "verify_chain_from_logits": lambda rng: ss.verify_chain_from_logits(
            logits, x, params, draft_probs=q, method="token", rng=rng, vocab_mask=mask).tokens,
        "verify_tree": lambda rng: ss.verify_tree(p[:, :1].expand(B, N, V), xt, tree, qt, method="traversal",
                                                  rng=rng).tokens,
        "verify_tree_from_logits": lambda rng: ss.verify_tree_from_logits(
            tree_logits, xt, tree, params, method="target_only", rng=rng, vocab_mask=mask).tokens,
        "sample_from_logits": lambda rng: ss.sample_from_logits(logits[:, 0], params, rng, mask[:, 0]).tokens,
        "sample": lambda rng: ss.sample(p[:, 0], rng),
        "mlc_batch_spec_verify": mlc_verify,
    }
