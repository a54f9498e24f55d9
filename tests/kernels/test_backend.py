"""Back-end choice (DESIGN.md): CUDA tensors run the Triton kernels, CPU tensors the PyTorch
reference, ``SPECSAMPLER_BACKEND`` forces one; the public functions give the same results on both."""

import pytest
import torch
from kernelcheck import DEVICE, KERNEL_OPS, as_tuple, mlc_case, public_op_calls, to_device

import specsampler as ss
from specsampler.kernels import use_triton

pytest.importorskip("triton")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_device_decides_unless_the_environment_forces_a_back_end(monkeypatch):
    monkeypatch.delenv("SPECSAMPLER_BACKEND", raising=False)
    assert not use_triton(CPU) and use_triton(CUDA)
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    assert not use_triton(CPU) and not use_triton(CUDA)
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(CPU) and use_triton(CUDA)


def test_a_bad_or_unusable_forced_back_end_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SPECSAMPLER_BACKEND.*one of"):
        use_triton(CPU)
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton(CPU)


def _both(monkeypatch, fn):
    """fn() under the torch back end, then under the triton one. The tests' inputs are on ``DEVICE``: CPU
    tensors (the kernels in the interpreter) without a GPU, CUDA tensors with one."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")
    ref = fn()
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    return ref, fn()


@pytest.mark.parametrize("method", ["token", "block", "target_only", "greedy"])
def test_verify_chain_gives_the_same_result_on_both_back_ends(monkeypatch, method):
    g = torch.Generator().manual_seed(3)
    B, K, V = 6, 3, 17
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1)
    x = torch.where(torch.rand(B, K, generator=g) < 0.7, p[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g))
    q = q if method in ("token", "block") else None
    n = torch.tensor([3, 2, 0, 1, 3, 3])
    p, x, q, n = to_device((p, x, q, n))
    for rng in (ss.Philox(torch.arange(B) * 7, 2), None):
        seeded = (lambda r=rng: r) if rng is not None else (lambda: torch.Generator().manual_seed(9))
        ref, got = _both(monkeypatch, lambda seeded=seeded: ss.verify_chain(p, x, q, num_drafts=n, method=method,
                                                                            rng=seeded()))
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.num_accepted, ref.num_accepted)
        torch.testing.assert_close(got.expected_accepted, ref.expected_accepted)


@pytest.mark.parametrize("method, drafting", [("greedy", "iid"), ("target_only", "iid"), ("rrs", "iid"),
                                              ("rrs", "without_replacement"), ("traversal", "iid"),
                                              ("traversal", "without_replacement")])
def test_verify_tree_gives_the_same_result_on_both_back_ends(monkeypatch, method, drafting):
    g = torch.Generator().manual_seed(4)
    B, V = 4, 11
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 1, 2, 3, -1]] * B))
    N = tree.size
    p = torch.softmax(torch.randn(B, N, V, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(B, N, V, generator=g) * 3, -1) if method in ("rrs", "traversal") else None
    x = torch.randint(0, V, (B, N), generator=g)
    tree, p, q, x = to_device((tree, p, q, x))
    for rng in (ss.Philox(torch.arange(B), 5), None):
        seeded = (lambda r=rng: r) if rng is not None else (lambda: torch.Generator().manual_seed(9))
        ref, got = _both(monkeypatch, lambda seeded=seeded: ss.verify_tree(p, x, tree, q, method=method,
                                                                           draft_sampling=drafting, rng=seeded()))
        assert torch.equal(got.path, ref.path) and torch.equal(got.tokens, ref.tokens)
        if ref.expected_accepted is not None:
            torch.testing.assert_close(got.expected_accepted, ref.expected_accepted)


def test_mlc_batch_spec_verify_mutates_the_same_way_on_both_back_ends(monkeypatch):
    from specsampler import mlc

    draft_probs, tokens, model, first_child, next_sibling, u, roots = to_device(
        mlc_case(torch.Generator().manual_seed(6), 9))

    def run():
        m, ptr = model.clone(), roots.clone()
        mlc.batch_spec_verify(draft_probs, tokens, m, first_child, next_sibling, u, ptr)
        return m, ptr

    (m_ref, ptr_ref), (m_got, ptr_got) = _both(monkeypatch, run)
    assert torch.equal(ptr_got, ptr_ref)
    torch.testing.assert_close(m_got, m_ref)


def test_sampling_gives_the_same_tokens_on_both_back_ends(monkeypatch):
    g = torch.Generator().manual_seed(8)
    B, M, V = 5, 2, 300
    logits = torch.randn(B, M, V, generator=g) * 3
    params = ss.SamplingParams(temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9]),
                               top_k=torch.tensor([0, 20, 0, 5, 0]), top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0]),
                               min_p=torch.tensor([0, 0, 0, 0, 0.1]))
    mask = torch.rand(B, 1, V, generator=g) < 0.9
    probs = torch.softmax(logits, -1)
    logits, mask, probs = to_device((logits, mask, probs))
    for rng in (ss.Philox(torch.arange(B) * 3, 1), None):
        seeded = (lambda r=rng: r) if rng is not None else (lambda: torch.Generator().manual_seed(2))
        ref, got = _both(monkeypatch, lambda seeded=seeded: ss.sample_from_logits(logits, params, seeded(), mask))
        assert torch.equal(got.tokens, ref.tokens)
        torch.testing.assert_close(got.logprobs, ref.logprobs)
        ref, got = _both(monkeypatch, lambda seeded=seeded: ss.sample(probs, seeded()))
        assert torch.equal(got, ref)


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_the_kernel_ops_trace_whole_under_torch_compile_fullgraph(monkeypatch, name):
    """The ops are torch custom ops with fake implementations: dynamo traces the Python around
    them without a graph break (aot_eager here; on a GPU, tests/kernels/test_gpu.py compiles with inductor)."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    torch._dynamo.reset()
    call = public_op_calls(DEVICE)[name]

    def step(seed, offset):
        return call(ss.Philox(seed, offset))

    args = (torch.arange(3, device=DEVICE), torch.full((3,), 4, device=DEVICE))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(as_tuple(compiled(*args)), as_tuple(step(*args)), strict=True):
        assert torch.equal(got, want), f"{name}: compiled and eager differ"


def test_the_kernel_ops_trace_whole_when_a_size_changes_between_calls_and_with_dynamic_shapes(monkeypatch):
    """A chain length that changes between calls (dynamo then makes K symbolic) and ``dynamic=True``: the kept
    constants' keys were formed of the symbolic sizes, whose ``repr`` does not trace (``Unsupported``)."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    g = torch.Generator().manual_seed(5)

    def step(p, x, q, seed, offset):
        return ss.verify_chain(p, x, q, method="token", rng=ss.Philox(seed, offset)).tokens

    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
        for B, K in ((2, 2), (2, 3), (3, 4)):
            p = torch.softmax(torch.randn(B, K + 1, 32, generator=g), -1)
            q = torch.softmax(torch.randn(B, K, 32, generator=g), -1)
            args = to_device((p, torch.randint(0, 32, (B, K), generator=g), q, torch.arange(B), torch.full((B,), 4)))
            assert torch.equal(compiled(*args), step(*args)), (dynamic, B, K)


def test_a_target_only_tree_and_parameters_made_inside_trace_whole(monkeypatch):
    """A target-only tree reads a lazily derived tensor after its kernel (``functools.cached_property`` takes a lock
    before Python 3.12, which dynamo refused), and parameters of host numbers made inside the compiled function
    round to float32 without NumPy's ``errstate`` (which does not trace)."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    B, V = 2, 32
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]] * B)).to(DEVICE)
    p, logits = to_device((torch.softmax(torch.randn(B, 4, V, generator=g), -1), torch.randn(B, V, generator=g)))
    x = torch.randint(0, V, (B, 4), generator=g).to(DEVICE)

    def step(seed, offset):
        rng = ss.Philox(seed, offset)
        return (ss.verify_tree(p, x, tree, method="target_only", rng=rng).tokens,
                ss.sample_from_logits(logits, ss.SamplingParams(temperature=0.7, top_p=0.9), rng).tokens)

    args = to_device((torch.arange(B), torch.full((B,), 4)))
    for got, want in zip(torch.compile(step, fullgraph=True, backend="aot_eager")(*args), step(*args), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_the_kernel_ops_pass_torch_library_opcheck(monkeypatch, name):
    """``torch.library.opcheck`` on the arguments the public function passes to the op: no input is modified
    but those the schema declares (MLC's two), the fake implementation's outputs match the real ones
    (shapes, dtypes, strides), and autograd registration and AOT dispatch with dynamic shapes work."""
    from specsampler.kernels import ops

    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    calls, real = [], getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    public_op_calls(DEVICE)[name](ss.Philox(torch.arange(3, device=DEVICE), torch.full((3,), 4, device=DEVICE)))
    assert len(calls) == 1, f"the public function called specsampler::{name} {len(calls)} times"
    torch.library.opcheck(getattr(torch.ops.specsampler, name).default, *calls[0])


@pytest.mark.parametrize("method", ["token", "target_only"])
def test_verify_chain_from_logits_gives_the_same_result_on_both_back_ends(monkeypatch, method):
    """The dispatch (each method's kernel is checked in test_kernels_chain_logits.py)."""
    g = torch.Generator().manual_seed(11)
    B, K, V = 4, 3, 90
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1) if method in ("token", "block") else None
    x = torch.where(torch.rand(B, K, generator=g) < 0.8, logits[:, :K].argmax(-1), torch.randint(0, V, (B, K),
                                                                                                  generator=g))
    params = ss.SamplingParams(temperature=torch.tensor([0.0, 0.8, 1.0, 1.2]), top_k=torch.tensor([0, 10, 0, 40]),
                               top_p=torch.tensor([1.0, 0.9, 0.85, 1.0]))
    mask = torch.rand(B, 1, V, generator=g) < 0.95
    logits, q, x, mask = to_device((logits, q, x, mask))
    for rng in (ss.Philox(torch.arange(B) * 5, 3), None):
        seeded = (lambda r=rng: r) if rng is not None else (lambda: torch.Generator().manual_seed(4))
        ref, got = _both(monkeypatch, lambda seeded=seeded: ss.verify_chain_from_logits(
            logits, x, params, draft_probs=q, method=method, rng=seeded(), vocab_mask=mask))
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.num_accepted, ref.num_accepted)
        torch.testing.assert_close(got.expected_accepted, ref.expected_accepted)


@pytest.mark.parametrize("method, drafting", [("target_only", "iid"), ("traversal", "without_replacement")])
def test_verify_tree_from_logits_gives_the_same_result_on_both_back_ends(monkeypatch, method, drafting):
    """The dispatch (each method's kernel is checked in test_kernels_tree_logits.py)."""
    g = torch.Generator().manual_seed(12)
    B, V = 3, 70
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 2, 3]] * B))
    N = tree.size
    logits = torch.randn(B, N, V, generator=g) * 3
    x = torch.randint(0, V, (B, N), generator=g)
    x[:, 1], x[:, 3], x[:, 5] = logits[:, 0].argmax(-1), logits[:, 1].argmax(-1), logits[:, 3].argmax(-1)
    q = torch.softmax(torch.randn(B, N, V, generator=g) * 3, -1) if method in ("rrs", "traversal") else None
    params = ss.SamplingParams(temperature=torch.tensor([0.0, 0.7, 1.0]), top_k=torch.tensor([0, 8, 0]),
                               top_p=torch.tensor([1.0, 0.9, 0.8]))
    mask = torch.rand(B, 1, V, generator=g) < 0.95
    tree, logits, x, q, mask = to_device((tree, logits, x, q, mask))
    for rng in (ss.Philox(torch.arange(B) * 5, 3), None):
        seeded = (lambda r=rng: r) if rng is not None else (lambda: torch.Generator().manual_seed(4))
        ref, got = _both(monkeypatch, lambda seeded=seeded: ss.verify_tree_from_logits(
            logits, x, tree, params, draft_probs=q, method=method, draft_sampling=drafting, rng=seeded(),
            vocab_mask=mask))
        assert torch.equal(got.path, ref.path) and torch.equal(got.tokens, ref.tokens)


_VIEWS = {"view", "_unsafe_view", "unsqueeze", "expand", "slice", "select", "alias", "detach", "reshape",
          "squeeze", "t", "transpose", "permute", "as_strided"}


def _launches_besides_the_kernel(fn) -> list[str]:
    """The aten ops (views aside: they launch nothing) a call dispatches besides its kernel's custom op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen, kernels = [], []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if func.namespace == "specsampler":
                kernels.append(name)
            elif name not in _VIEWS:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Watch():
        fn()
    assert kernels, "the kernel did not run"
    return seen


def test_a_call_with_shared_parameters_launches_its_kernel_alone(monkeypatch):
    """At a small batch a GPU op's time is its launches (at B = 1 on an H100 a chain verify launched 16 fills and
    checks besides its 3 kernels, a tree verify 26 besides its one): per-row parameters given as scalars, default
    draft counts and draw indices are made once; the drafts' clamping and masks are left to the paths that read
    them; the tree kernel writes the emitted tokens and last node itself."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "triton")
    g = torch.Generator().manual_seed(0)
    V, K = 300, 3
    params, greedy = ss.SamplingParams(temperature=0.7, top_k=20, top_p=0.9), ss.SamplingParams(temperature=0.0)
    rng = ss.Philox(torch.tensor([5]), torch.tensor([2]))
    logits, chain = torch.randn(1, V, generator=g), torch.randn(1, K + 1, V, generator=g)
    drafts = chain[:, :K].argmax(-1)
    q = torch.softmax(torch.randn(1, K, V, generator=g), -1)
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]]))
    rows, nodes = torch.randn(1, 4, V, generator=g), torch.randint(0, V, (1, 4), generator=g)
    qt = torch.softmax(torch.randn(1, 4, V, generator=g), -1)
    logits, chain, drafts, q, rows, nodes, tree, qt = to_device((logits, chain, drafts, q, rows, nodes, tree, qt))
    calls = {
        "sample_from_logits": lambda: ss.sample_from_logits(logits, params, rng),
        "greedy sampling": lambda: ss.sample_from_logits(logits, greedy, ss.Philox(3)),
        "chain token": lambda: ss.verify_chain_from_logits(chain, drafts, params, draft_probs=q, method="token",
                                                           rng=rng),
        "chain target_only": lambda: ss.verify_chain_from_logits(chain, drafts, params, method="target_only",
                                                                 rng=ss.Philox(1, 4)),
        "tree target_only": lambda: ss.verify_tree_from_logits(rows, nodes, tree, params, method="target_only",
                                                               rng=rng),
        "tree rrs": lambda: ss.verify_tree_from_logits(rows, nodes, tree, params, draft_probs=qt, method="rrs",
                                                       rng=rng),
    }  # (a greedy tree also launches one conversion: its expected_accepted is its count as float32)
    for name, call in calls.items():
        first = call()
        assert _launches_besides_the_kernel(call) == [], name
        again = call()  # the kept tensors were only read: the same result
        for field in ("tokens", "num_accepted", "path", "last_node"):
            if hasattr(first, field):
                assert torch.equal(getattr(first, field), getattr(again, field)), (name, field)


def test_kept_constants_are_shared_until_the_limit_then_made_per_call(monkeypatch):
    from specsampler import constants

    monkeypatch.setattr(constants, "_KEPT", {})
    a = constants.full(4, 0.5, torch.float32, "cpu")
    assert a is constants.full(4, 0.5, torch.float32, "cpu") and a.tolist() == [0.5] * 4
    neg = constants.full(4, -0.0, torch.float32, "cpu")  # equal to 0.0 as a key, not as a value
    assert neg is not constants.full(4, 0.0, torch.float32, "cpu") and torch.signbit(neg).all()
    assert constants.full(4, 1, torch.int64, "cpu").dtype == torch.int64
    assert constants.index_in_request(3, 2, "cpu").tolist() == [0, 1, 0, 1, 0, 1]
    with torch.inference_mode():  # made inside inference mode, usable outside it
        made = constants.full(2, 7, torch.int64, "cpu")
    assert not made.is_inference() and (made + 1).tolist() == [8, 8]
    monkeypatch.setattr(constants, "LIMIT", len(constants._KEPT))
    fresh = constants.full(4, 0.25, torch.float32, "cpu")
    assert fresh is not constants.full(4, 0.25, torch.float32, "cpu") and fresh.tolist() == [0.25] * 4
    assert constants.full(4, 0.5, torch.float32, "cpu") is a  # the kept ones stay
