import pytest
import torch

import specsampler as ss
from specsampler import TokenTree


def _expected(cache, cache_lens, path, n):
    out = cache.clone()
    for b in range(cache.shape[0]):
        for j in range(int(n[b]) + 1):
            out[b, :, int(cache_lens[b]) + j] = cache[b, :, int(cache_lens[b]) + int(path[b, j])]
    return out


def test_accepted_path_entries_move_after_the_committed_cache():
    torch.manual_seed(0)
    B, H, S, D = 3, 2, 20, 4
    cache = torch.randn(B, H, S, D)
    cache_lens = torch.tensor([5, 0, 9])
    path = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 6]])
    n = torch.tensor([2, 0, 3])
    expected = _expected(cache, cache_lens, path, n)
    ss.compact_kv(cache, cache_lens, path, n)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[0, :, 7], expected[0, :, 10 - 5 + 2])  # the node-5 entry is now at 5 + 2


def test_a_cache_that_requires_grad_is_compacted_in_place():
    # every op runs under no_grad: the in-place moves raised torch's RuntimeError on a leaf that requires grad
    cache = torch.randn(2, 1, 6, 3, requires_grad=True)
    cache_lens, path, n = torch.tensor([1, 0]), torch.tensor([[0, 2], [0, 3]]), torch.tensor([1, 1])
    expected = _expected(cache.detach(), cache_lens, path, n)
    ss.compact_kv(cache, cache_lens, path, n)
    assert torch.equal(cache.detach(), expected)


def test_lists_of_layers_and_sequence_first_layouts():
    torch.manual_seed(1)
    B, S = 2, 12
    layers = [(torch.randn(B, 3, S, 2), torch.randn(B, 3, S, 2)) for _ in range(3)]
    seq_first = [torch.randn(B, S, 3, 2)]
    cache_lens, path, n = torch.tensor([1, 4]), torch.tensor([[0, 3, 4], [0, 2, -1]]), torch.tensor([2, 1])
    expected = [tuple(_expected(t, cache_lens, path, n) for t in kv) for kv in layers]
    expected_sf = _expected(seq_first[0].transpose(1, 2), cache_lens, path, n).transpose(1, 2)
    ss.compact_kv(layers, cache_lens, path, n)
    ss.compact_kv(seq_first, cache_lens, path, n, seq_dim=1)
    for got, want in zip(layers, expected):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(seq_first[0], expected_sf)


def test_compacting_a_tree_verification_result():
    torch.manual_seed(2)
    B, V = 4, 5
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 2, 3]] * B))
    p = torch.softmax(torch.randn(B, 6, V) * 4, -1)
    x = torch.cat([torch.zeros(B, 1, dtype=torch.long), p.argmax(-1)[:, [0, 0, 1, 2, 3]]], 1)
    res = ss.verify_tree(p, x, tree, method="greedy")
    cache_lens = torch.tensor([3, 0, 7, 1])
    cache = torch.zeros(B, 1, 16, 1)
    for b in range(B):  # store each node's id at its position
        cache[b, 0, cache_lens[b] : cache_lens[b] + 6, 0] = torch.arange(6).float()
    ss.compact_kv(cache, cache_lens, res.path, res.num_accepted)
    for b in range(B):
        n = int(res.num_accepted[b])
        got = cache[b, 0, cache_lens[b] : cache_lens[b] + n + 1, 0].long()
        assert got.tolist() == res.path[b, : n + 1].tolist()


def test_bad_kv_inputs_are_named():
    cache = torch.zeros(2, 1, 6, 1)
    with pytest.raises(ValueError, match=r"cache_lens \+ path: expected positions inside the cache \(< S = 6\)"):
        ss.compact_kv(cache, torch.tensor([4, 0]), torch.tensor([[0, 3], [0, 1]]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"num_accepted: expected shape \[B\] = \[2\], got \[3\]"):
        ss.compact_kv(cache, torch.tensor([0, 0]), torch.tensor([[0, 1], [0, 1]]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"cache tensor 0: expected a batch dim of size B = 2"):
        ss.compact_kv(torch.zeros(3, 1, 6, 1), torch.tensor([0, 0]), torch.tensor([[0, 1], [0, 1]]),
                      torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"cache: expected a tensor, a list .* or a Hugging Face DynamicCache"):
        ss.compact_kv({"k": cache}, torch.tensor([0, 0]), torch.tensor([[0, 1], [0, 1]]), torch.tensor([1, 1]))


@pytest.mark.parametrize("seq_dim", [0, -4, -5, 2.0, True, None])
def test_a_seq_dim_that_is_not_a_sequence_dim_is_named(seq_dim):
    """A float or None leaked a TypeError, -5 an IndexError, and the batch dim (0, -4) was taken as the sequence dim:
    entries moved between requests' rows, or an error about positions."""
    cache = torch.arange(24.0).view(4, 1, 6, 1)
    before = cache.clone()
    ones = torch.ones(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"compact_kv: (seq_dim: expected an int|cache tensor 0: expected a batch dim"
                                         r" of size B = 4 and a sequence dim .* other than it)"):
        ss.compact_kv(cache, ones * 0, torch.tensor([[0, 2]] * 4), ones, seq_dim=seq_dim)
    assert torch.equal(cache, before)


def test_a_negative_seq_dim_counts_from_the_end():
    torch.manual_seed(3)
    cache = torch.randn(2, 3, 8, 2)
    cache_lens, path, n = torch.tensor([1, 2]), torch.tensor([[0, 3], [0, 1]]), torch.tensor([1, 1])
    expected = _expected(cache, cache_lens, path, n)
    ss.compact_kv(cache, cache_lens, path, n, seq_dim=-2)
    assert torch.equal(cache, expected)
