"""The batch_spec_verify kernel (run in the Triton interpreter without a GPU) against specsampler.mlc.batch_spec_verify.

Both get copies of the same buffers; the output pointers must be identical and model_probs must be
rewritten in the same rows. Rewritten values may differ in the last bits (the kernel sums the
residual's mass in another order), so they are compared with a relative tolerance of 1e-5.
"""

import pytest
import torch
from kernelcheck import DEVICE

from specsampler import mlc
from specsampler.kernels import mlc as kmlc


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    """The reference (mlc.batch_spec_verify) runs its PyTorch code whatever SPECSAMPLER_BACKEND says."""
    monkeypatch.setenv("SPECSAMPLER_BACKEND", "torch")


def _normalise(x):
    return x / x.sum(-1, keepdim=True)


def _forest(g, V, sizes, shape):
    """Seed 000's buffers for one tree per request, the nodes of all requests scattered over a
    global node array (plus 2 unused nodes), siblings linked in random order.

    Draft rows mix the parent's target row with noise and the tokens are drawn from them; some
    target entries are 0; some children get a draft row 1.5 times the parent's row (a rejection
    then leaves a residual without mass: accepted); some tokens are outside the vocabulary.
    """
    N = sum(sizes) + 2
    slot = torch.randperm(N, generator=g)
    model = torch.rand(N, V, generator=g) ** torch.empty(N, 1).uniform_(1, 12, generator=g)  # peaked to flat
    model = _normalise(model * (torch.rand(N, V, generator=g) > 0.2) + 1e-3 * (torch.arange(V) == 0))
    draft = _normalise(torch.rand(N, V, generator=g) ** 4)
    tokens = torch.zeros(N, dtype=torch.int64)
    first_child = torch.full((N,), -1, dtype=torch.int64)
    next_sibling = torch.full((N,), -1, dtype=torch.int64)
    uniform = torch.rand(N, generator=g)
    roots, start = [], 0
    for n in sizes:
        nodes = slot[start : start + n]
        start += n
        roots.append(int(nodes[0]))
        for i in range(1, n):
            parent = nodes[i - 1 if shape == "chain" else int(torch.randint(0, i, (1,), generator=g))]
            child = nodes[i]
            next_sibling[child], first_child[parent] = first_child[parent], child  # prepend: random order
            mix = float(torch.rand(1, generator=g))
            draft[child] = mix * model[parent] + (1 - mix) * draft[child]
            if torch.rand(1, generator=g) < 0.2:
                draft[child] = 1.5 * model[parent]
            tokens[child] = torch.multinomial(draft[child], 1, generator=g)
            if torch.rand(1, generator=g) < 0.05:
                tokens[child] = (-1, V)[int(torch.randint(0, 2, (1,), generator=g))]
    return [draft, tokens, model, first_child, next_sibling, uniform, torch.tensor(roots)]


def _run(fn, args, dtypes=(torch.int64, torch.int64, torch.int64), **kw):
    """``fn`` on copies of the buffers on DEVICE (tokens, links and parent pointers in ``dtypes``);
    returns (model_probs, parent_ptr) after the call, on the CPU."""
    draft, tokens, model, first_child, next_sibling, uniform, roots = args
    model, ptr = model.to(DEVICE, copy=True), roots.to(DEVICE, dtypes[2], copy=True)
    links = first_child.to(DEVICE, dtypes[1]), next_sibling.to(DEVICE, dtypes[1])
    fn(draft.to(DEVICE), tokens.to(DEVICE, dtypes[0]), model, *links, uniform.to(DEVICE), ptr, **kw)
    return model.cpu(), ptr.cpu()


def _same(args, label, dtypes=(torch.int64, torch.int64, torch.int64), block_v=64):
    ref_model, ref_ptr = _run(mlc.batch_spec_verify, args, dtypes)
    model, ptr = _run(kmlc.batch_spec_verify, args, dtypes, block_v=block_v)
    assert ptr.dtype == ref_ptr.dtype and torch.equal(ptr, ref_ptr), f"{label}: parent_ptr {ptr} != {ref_ptr}"
    rewritten = (ref_model != args[2]).any(-1)
    assert torch.equal((model != args[2]).any(-1), rewritten), f"{label}: other rows rewritten"
    torch.testing.assert_close(model, ref_model, rtol=1e-5, atol=1e-7, msg=lambda m: f"{label}: {m}")
    return rewritten, ptr


@pytest.mark.parametrize("shape", ["chain", "random"])
def test_kernel_equals_the_reference_on_random_forests(shape):
    g = torch.Generator().manual_seed(1 if shape == "chain" else 2)
    rewritten_rows = walked = 0
    for case in range(16):
        V = (3, 17, 130, 300)[case % 4]
        sizes = torch.randint(1, 9, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        args = _forest(g, V, sizes, shape)
        rewritten, ptr = _same(args, f"{shape} case {case} V={V} sizes={sizes}", block_v=(32, 64, 128)[case % 3])
        rewritten_rows += int(rewritten.sum())
        walked += int((ptr != args[6]).sum())
    assert rewritten_rows > 0 and walked > 0  # both rejections and acceptances happened


def test_every_branch_of_the_seed():
    """A hand-made batch: a rejection rewrites the parent's row and the next sibling is tested
    against it; a residual without mass accepts; an out-of-vocabulary token with a residual without
    mass is rejected without a write; all siblings rejected; p == u * q accepts; a root out of range
    is not walked."""
    V, N = 4, 11
    draft = torch.full((N, V), 0.25)
    model = torch.full((N, V), 0.25)
    tokens = torch.zeros(N, dtype=torch.int64)
    first_child = torch.full((N,), -1)
    next_sibling = torch.full((N,), -1)
    uniform = torch.full((N,), 0.5)
    # request 0: root 0, children 1 then 2
    model[0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    first_child[0], next_sibling[1] = 1, 2
    draft[1], tokens[1] = torch.tensor([0.25, 0.0, 0.75, 0.0]), 2  # p = 0: rejected, row 0 -> [1/3, 2/3, 0, 0]
    draft[2], tokens[2], uniform[2] = torch.tensor([0.0, 1.0, 0.0, 0.0]), 1, 0.6  # 2/3 >= 0.6 (0.5 would not be)
    # request 1: root 3 -> 4 (residual without mass: accepted) -> 5 (out of the vocabulary: rejected, no write)
    model[3] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    first_child[3], first_child[4] = 4, 5
    draft[4], tokens[4], uniform[4] = 2 * model[3], 3, 0.75
    draft[5], tokens[5] = 2 * model[4], V
    # request 2: root 6, its only child 7 rejected
    first_child[6] = 7
    draft[7], tokens[7] = torch.tensor([0.0, 0.5, 0.0, 0.5]), 3  # p = 0: rejected, row 6 -> [1, 0, 0, 0]
    model[6] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    # request 3: root 8, its child 9 accepted at p == u * q
    first_child[8], model[8] = 9, torch.tensor([0.5, 0.5, 0.0, 0.0])
    draft[9], tokens[9] = torch.tensor([1.0, 0.0, 0.0, 0.0]), 0
    first_child[N - 1] = 9  # walked (and its row rewritten) only if a root out of range were walked
    args = [draft, tokens, model, first_child, next_sibling, uniform, torch.tensor([0, 3, 6, 8])]
    for dtypes in ((torch.int64, torch.int64, torch.int64), (torch.int32, torch.int32, torch.int32)):
        _same(args, str(dtypes), dtypes)
        # a root out of range (which the reference rejects on CPU tensors) is clamped and not walked
        out_model, ptr = _run(kmlc.batch_spec_verify, args[:6] + [torch.tensor([0, 3, 6, 8, N + 5])], dtypes)
        assert ptr.tolist() == [2, 4, 6, 9, N - 1]
        expected = model.clone()
        expected[0] = torch.tensor([1 / 3, 2 / 3, 0.0, 0.0])
        expected[6] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        torch.testing.assert_close(out_model, expected)


def test_cycles_bad_links_strided_and_half_precision_inputs():
    """A cycle in the links ends after num_nodes + 1 steps, a link outside the node range ends a
    walk, and strided draft rows, tokens and uniforms (fp16 draft rows) are read through their strides."""
    g = torch.Generator().manual_seed(3)
    V = 37
    draft, tokens, model, first_child, next_sibling, uniform, roots = _forest(g, V, [6, 3], "chain")
    N = len(tokens)
    tokens.clamp_(0, V - 1)
    uniform[:] = 0.0  # every token in the vocabulary is accepted
    leaf = int(roots[0])
    while first_child[leaf] != -1:
        leaf = int(first_child[leaf])
    first_child[leaf] = roots[0]  # request 0 goes round its chain until it has made num_nodes + 1 steps
    tokens[first_child[roots[1]]] = -1  # request 1: rejected, then no next sibling
    args = [draft, tokens, model, first_child, next_sibling, uniform, roots]
    _same(args, "cycles")
    bad_links = next_sibling.clone()
    bad_links[first_child[roots[1]]] = N + 4  # read as -1 (the reference rejects it on CPU tensors)
    ref = _run(mlc.batch_spec_verify, args)
    out = _run(kmlc.batch_spec_verify, args[:4] + [bad_links] + args[5:])
    assert torch.equal(out[1], ref[1]) and out[1][1] == roots[1]
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-7)
    wide = torch.zeros(N, V + 5, dtype=torch.float16, device=DEVICE)  # views made on DEVICE keep their strides
    wide[:, 2 : V + 2] = draft.half()
    token_pairs = torch.stack([tokens, -tokens], 1).to(DEVICE)
    uniform_pairs = torch.stack([torch.rand(N, generator=g), torch.zeros(N)], 1).to(DEVICE)
    args = [wide[:, 2 : V + 2], token_pairs[:, 0], model, first_child, next_sibling, uniform_pairs[:, 0], roots]
    _same(args, "strided", (torch.int64, torch.int32, torch.int32))
