"""The kernels never read or write out of bounds, and their outputs stay in range, whatever the ids,
counts, links and parameters: the values that default validation does not read on a device (no host
sync) reach the kernels as they are.

Each test runs the public op with value checks off, as on a device under ``validate="structure"``,
on both back ends; the kernels run in the Triton interpreter on CPU tensors under the fuzz suite's
bounds check (every load and store of a launch inside one of its tensor arguments).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fuzz"))
from fuzzkit import BACKENDS, bounds_checked, use_backend  # noqa: E402

import specsampler as ss  # noqa: E402
from specsampler import mlc, validation  # noqa: E402

WILD_IDS = [-1, -2, 7, 8, 1000, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]  # V = 7 below
V = 7


@pytest.fixture(params=BACKENDS)
def device_like(request, monkeypatch):
    """Value checks off (as on a device without validate="full"), on the back end of the parameter."""
    original = validation.values_checkable
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "values_checkable", None) is original:
            monkeypatch.setattr(module, "values_checkable", lambda t, full: full)
    with use_backend(request.param), bounds_checked(request.param == "triton"):
        yield request.param


def _in_range(t: torch.Tensor, lo: int, hi: int) -> bool:
    return bool(((t >= lo) & (t < hi)).all())


@pytest.mark.parametrize("method", ["token", "block", "target_only", "greedy"])
@pytest.mark.parametrize("from_logits", [False, True])
def test_chain_kernels_stay_in_bounds_whatever_the_draft_ids_and_counts(device_like, method, from_logits):
    K = 3
    B = len(WILD_IDS)
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    drafts = torch.tensor(WILD_IDS)[:, None].repeat(1, K)
    drafts[:, 0] = torch.arange(B) % V  # some requests accept a first draft, then meet the wild one
    num_drafts = torch.tensor([K, K + 5, -3, 0, 2**40, -(2**40), 1, K, 2])
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if method in ("token", "block") else None
    rng = ss.Philox(torch.arange(B))
    if from_logits:
        res = ss.verify_chain_from_logits(target.log(), drafts, draft_probs=q, num_drafts=num_drafts, method=method,
                                          rng=rng)
    else:
        res = ss.verify_chain(target, drafts, q, num_drafts=num_drafts, method=method, rng=rng)
    assert _in_range(res.num_accepted, 0, K + 1)
    assert _in_range(res.tokens, -1, V)
    emitted = res.tokens.gather(1, res.num_accepted[:, None])
    assert _in_range(emitted, 0, V), "no correction or bonus token"


@pytest.mark.parametrize("method", ["rrs", "traversal", "target_only", "greedy"])
@pytest.mark.parametrize("draft_sampling", ["iid", "without_replacement"])
@pytest.mark.parametrize("from_logits", [False, True])
def test_tree_kernels_stay_in_bounds_whatever_the_draft_ids(device_like, method, draft_sampling, from_logits):
    B = len(WILD_IDS)
    g = torch.Generator().manual_seed(1)
    tree = ss.TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 1, 2, -1]] * B))
    N = tree.size
    target = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    drafts = torch.tensor(WILD_IDS)[:, None].repeat(1, N)
    drafts[:, 1] = torch.arange(B) % V
    q = torch.softmax(torch.randn(B, N, V, generator=g), -1) if method in ("rrs", "traversal") else None
    kw = dict(draft_probs=q, method=method, draft_sampling=draft_sampling, rng=ss.Philox(torch.arange(B)))
    if from_logits:
        res = ss.verify_tree_from_logits(target.log(), drafts, tree, **kw)
    else:
        res = ss.verify_tree(target, drafts, tree, **kw)
    assert _in_range(res.tokens, -1, V) and _in_range(res.num_accepted, 0, tree.max_depth + 1)
    on_path = res.path[:, 1:]
    assert _in_range(drafts.gather(1, on_path.clamp(min=0))[on_path >= 0], 0, V), "an out-of-range draft accepted"


def test_sampling_kernels_stay_in_bounds_whatever_the_parameters(device_like):
    B = 8
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, V, generator=g)
    logits[1] = float("nan")
    logits[2, :3] = float("inf")
    logits[3] = float("-inf")
    params = ss.SamplingParams(
        temperature=torch.tensor([-1.0, float("nan"), float("inf"), 0.0, 1e-30, 1.0, 1.0, 1.0]),
        top_k=torch.tensor([2**63 - 1, -(2**63), -1, V + 10, 0, 1, 3, 2**31]),
        top_p=torch.tensor([0.0, float("nan"), 2.0, -1.0, 1.0, 1e-30, 0.5, float("inf")]),
        min_p=torch.tensor([float("nan"), 5.0, -1.0, 1.0, 0.0, 0.5, 1.0, float("-inf")]),
    )
    mask = torch.ones(B, V, dtype=torch.bool)
    mask[5] = False
    out = ss.sample_from_logits(logits, params, ss.Philox(torch.arange(B)), mask)
    assert _in_range(out.tokens, 0, V)
    probs = torch.rand(B, V, generator=g)
    probs[0] = float("nan")
    probs[1] = -1.0
    probs[2] = 0.0
    probs[3, 0] = float("inf")
    assert _in_range(ss.sample(probs, ss.Philox(torch.arange(B))), 0, V)


def test_mlc_kernel_stays_in_bounds_whatever_the_links(device_like):
    n = 9
    g = torch.Generator().manual_seed(3)
    draft = torch.softmax(torch.randn(n, V, generator=g), -1)
    model = torch.softmax(torch.randn(n, V, generator=g), -1)
    tokens = torch.tensor(WILD_IDS)
    first_child = torch.tensor([1, 2, -7, 4, 2**40, 0, 3, -(2**40), 8])  # cycles, and indices far outside
    next_sibling = torch.tensor([5, 3, 1, -2, n, 2**62, -1, 6, 0])
    u = torch.tensor([0.5, float("nan"), -1.0, 2.0, 0.1, float("inf"), 0.0, 0.99, 0.3])
    ptr = torch.tensor([0, n + 4, -3, 2**40])
    mlc.batch_spec_verify(draft, tokens, model, first_child, next_sibling, u, ptr)
    assert _in_range(ptr, 0, n)


def test_the_bounds_check_catches_a_load_past_a_tensor():
    # the harness itself: a kernel reading one element past its input is caught, one reading inside is not
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def copy(src, dst, shift):
        offs = tl.arange(0, 8)
        tl.store(dst + offs, tl.load(src + offs + shift))

    src, dst = torch.arange(8, dtype=torch.float32), torch.empty(8)
    if src.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the bounds check runs in the Triton interpreter")
    with bounds_checked():
        copy[(1,)](src, dst, 0)
        assert torch.equal(dst, src)
        with pytest.raises(Exception, match="OutOfBounds.*copy: load of 4 bytes"):  # as the interpreter wraps it
            copy[(1,)](src, dst, 1)
