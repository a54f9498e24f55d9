import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specsampler import TokenTree, verify_tree


def test_parents_give_links_depths_and_sizes():
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, -1, 2, -1, -1]]))
    assert tree.first_child.tolist() == [[1, 3, 5, 6, -1, -1, -1], [1, 2, 4, -1, -1, -1, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1, -1], [-1] * 7]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 2, 3], [0, 1, 2, -1, 3, -1, -1]]
    assert tree.num_nodes.tolist() == [7, 4]
    assert tree.max_depth == 3
    assert tree.parents.dtype == torch.int64 and tree.size == 7 and tree.batch_size == 2


def test_mask_holds_each_node_and_its_ancestors():
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1, -1]]))
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool
    )
    assert torch.equal(tree.mask()[0], expected)


def test_first_child_next_sibling_keeps_link_order():
    # root's children listed 2 then 1
    fc = torch.tensor([[2, 3, -1, -1]])
    ns = torch.tensor([[-1, -1, 1, -1]])
    tree = TokenTree.from_first_child_next_sibling(fc, ns)
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
    assert tree.first_child.tolist() == fc.tolist() and tree.next_sibling.tolist() == ns.tolist()
    assert tree.depth.tolist() == [[0, 1, 1, 2]]


def test_a_tree_stays_as_built_when_the_callers_buffers_are_written_after():
    """from_parents and from_first_child_next_sibling kept a CPU int64 input as the tree's own tensor: an engine
    writing the buffer for its next step changed ``parents`` but not the links built from it, and the walk read a
    tree that is neither (here it stopped at node 1, whose child 3 has become node 2's)."""
    p = torch.tensor([[[0.0, 1.0, 0.0]] * 4])  # every row draws token 1
    drafts = torch.tensor([[0, 1, 2, 1]])
    parents = torch.tensor([[-1, 0, 0, 1]])
    fc, ns = torch.tensor([[1, 3, -1, -1]]), torch.tensor([[-1, 2, -1, -1]])
    trees = [TokenTree.from_parents(parents), TokenTree.from_first_child_next_sibling(fc, ns)]
    parents[0, 3] = 2
    fc[0] = torch.tensor([2, -1, 3, -1])
    ns[0, 2] = 1
    for tree in trees:
        assert tree.parents.tolist() == [[-1, 0, 0, 1]] and tree.first_child.tolist() == [[1, 3, -1, -1]]
        assert verify_tree(p, drafts, tree, method="target_only").path.tolist() == [[0, 1, 3]]


def test_root_only_and_single_chain():
    tree = TokenTree.from_parents(torch.tensor([[-1], [-1]]))
    assert tree.max_depth == 0 and tree.num_nodes.tolist() == [1, 1]
    chain = TokenTree.from_parents(torch.tensor([[-1, 0, 1, 2, 3]]))
    assert chain.max_depth == 4 and chain.first_child.tolist() == [[1, 2, 3, 4, -1]]


def test_any_integer_dtype_and_to_device():
    tree = TokenTree.from_parents(torch.tensor([[-1, 0, 0]], dtype=torch.int32))
    assert tree.parents.dtype == torch.int64
    moved = tree.to("cpu")
    assert torch.equal(moved.first_child, tree.first_child) and moved.max_depth == tree.max_depth


@st.composite
def random_parents(draw):
    B = draw(st.integers(1, 4))
    N = draw(st.integers(1, 12))
    rows = []
    for _ in range(B):
        row, present = [-1], [0]
        for i in range(1, N):
            if draw(st.booleans()) and draw(st.booleans()):
                row.append(-1)  # absent
            else:
                p = draw(st.sampled_from(present))
                row.append(p)
                present.append(i)
        rows.append(row)
    return torch.tensor(rows)


@settings(max_examples=200, deadline=None)
@given(parents=random_parents())
def test_the_three_forms_round_trip(parents):
    tree = TokenTree.from_parents(parents)
    via_links = TokenTree.from_first_child_next_sibling(tree.first_child, tree.next_sibling)
    via_mask = TokenTree.from_mask(tree.mask())
    for other in (via_links, via_mask):
        for name in ("parents", "first_child", "next_sibling", "depth", "num_nodes"):
            assert torch.equal(getattr(other, name), getattr(tree, name)), name
        assert other.max_depth == tree.max_depth
        assert torch.equal(other.mask(), tree.mask())
    # depth = number of proper ancestors; children come after their parent in sibling lists
    assert torch.equal(tree.mask().sum(2) - 1, tree.depth.clamp(min=-1))
    for b in range(parents.shape[0]):
        for v in range(parents.shape[1]):
            kids, c = [], int(tree.first_child[b, v])
            while c != -1:
                kids.append(c)
                c = int(tree.next_sibling[b, c])
            assert kids == [i for i in range(parents.shape[1]) if int(parents[b, i]) == v and i > 0]


@pytest.mark.parametrize(
    "parents, fragments",
    [
        ([[0, 0, 1]], ["parents[0, 0] (node 0)", "-1 (node 0 is the root)", "got 0", "request 0"]),
        ([[-1, 0, 1], [-1, 2, 0]], ["parents[1, 1] (node 1)", "a parent comes before its child", "got 2", "request 1"]),
        ([[-1, 0, 1], [-1, 0, 0], [-1, 0, 2]], ["parents[2, 2] (node 2)", "got 2", "request 2"]),
        ([[-1, -1, 1]], ["parents[0, 2] (node 2)", "present parent", "parent 1, which is absent"]),
        ([[-1, 0, -3]], ["parents[0, 2]", "[-1, i)", "got -3"]),
    ],
)
def test_bad_parents_name_request_and_node(parents, fragments):
    with pytest.raises(ValueError) as err:
        TokenTree.from_parents(torch.tensor(parents))
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


@pytest.mark.parametrize(
    "fc, ns, fragments",
    [
        ([[1, 3, -1, 2]], [[-1, -1, -1, -1]], ["(node 2)", "smaller index", "node 2 whose parent is 3", "request 0"]),
        ([[1, 2, -1, -1]], [[-1, 2, -1, -1]], ["(node 2)", "one parent per node", "two parents"]),
        ([[1, -1, -1, -1], [1, -1, -1, -1]], [[-1, 2, 1, -1], [-1, -1, -1, -1]],
         ["(node", "cycle", "request 0"]),
        ([[1, -1, -1, 2]], [[-1, -1, -1, -1]], ["(node 3)", "absent", "not in the tree"]),
        ([[1, -1, 0]], [[-1, -1, -1]], ["root is nobody's child"]),
        ([[1, -1]], [[1, -1]], ["next_sibling[0, 0] (node 0)", "the root has no sibling"]),
        ([[1, -1, 3]], [[-1, -1, -1]], ["first_child[0, 2]", "[-1, 3)", "got 3"]),
        ([[-1, 2, 1]], [[-1, -1, -1]], ["cycle"]),
    ],
)
def test_bad_child_lists_name_request_and_node(fc, ns, fragments):
    with pytest.raises(ValueError) as err:
        TokenTree.from_first_child_next_sibling(torch.tensor(fc), torch.tensor(ns))
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_bad_masks_name_request_and_node():
    good = TokenTree.from_parents(torch.tensor([[-1, 0, 1, 0]] * 2)).mask()
    m = good.clone()
    m[1, 0, 0] = False
    with pytest.raises(ValueError, match=r"mask\[1, 0\] \(node 0\).*root.*request 1"):
        TokenTree.from_mask(m)
    m = TokenTree.from_parents(torch.tensor([[-1, 0, 0, 1]])).mask()
    m[0, 3, 2] = True  # node 3 below both 1 and 2, siblings: not a chain
    with pytest.raises(ValueError, match=r"\(node 3\).*chain.*request 0"):
        TokenTree.from_mask(m)
    m = good.clone()
    m[1, 3, 3] = False  # node 3 absent but its row still has the root
    with pytest.raises(ValueError, match=r"\(node 3\).*absent.*request 1"):
        TokenTree.from_mask(m)
    m = good.clone()
    m[0, 1, 2] = True  # node 2 claimed as ancestor of node 1: parent after child
    with pytest.raises(ValueError, match=r"\(node 1\)"):
        TokenTree.from_mask(m)
    with pytest.raises(ValueError, match=r"mask: expected a bool tensor"):
        TokenTree.from_mask(good.int())
    with pytest.raises(ValueError, match=r"shape \[B, N, N\]"):
        TokenTree.from_mask(good[:, :, :3])


def test_wrong_types_and_shapes():
    with pytest.raises(ValueError, match="parents: expected an integer tensor, got torch.float32"):
        TokenTree.from_parents(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"parents: expected 2 dimensions, got shape \[3\]"):
        TokenTree.from_parents(torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match=r"next_sibling: expected shape \[B, N\] \(as first_child\) = \[1, 3\]"):
        TokenTree.from_first_child_next_sibling(torch.tensor([[1, -1, -1]]), torch.tensor([[-1, -1]]))


def test_an_empty_batch_of_trees_verifies_to_empty_results():
    tree = TokenTree.from_parents(torch.zeros(0, 3, dtype=torch.int64))
    assert tree.batch_size == 0 and tree.max_depth == 0
    res = verify_tree(torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.int64), tree, method="target_only")
    assert res.tokens.shape == (0, 1) and res.num_accepted.shape == (0,)
