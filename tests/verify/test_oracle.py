import itertools

import numpy as np
import pytest

from specsampler.verify import oracle
from specsampler.verify.exactness import argmax_drafter, random_model

CHAIN_CASES = [(V, K, zeros) for V in (3, 4, 5, 6) for K in (1, 2, 3, 4) for zeros in (False, True) if V**K <= 1296]


@pytest.mark.parametrize("V, K, zeros", CHAIN_CASES)
def test_chain_oracle_reproduces_the_target_joint_distribution(V, K, zeros):
    seed = 31 * V + 7 * K + zeros
    target, draft = random_model(V, seed, zeros), random_model(V, seed + 1, zeros)
    joint = oracle.target_joint(target, K + 1)
    assert abs(sum(joint.values()) - 1) < 1e-12
    for method, drafter in (("token", draft), ("block", draft), ("target_only", argmax_drafter(draft))):
        out = oracle.chain(target, drafter, K, method, V)
        assert oracle.max_error(oracle.extend(out.sequences, target, K + 1), joint) < 1e-12, method
        assert 0 <= out.expected_accepted <= K


def test_greedy_oracle_is_the_greedy_walk():
    V, K = 5, 3
    target, draft = random_model(V, 1), random_model(V, 2)
    out = oracle.chain(target, argmax_drafter(draft), K, "greedy", V)
    (seq,) = out.sequences
    walk = oracle.greedy_sequence(target, K + 1)
    assert seq == walk[: len(seq)] and out.sequences[seq] == 1.0
    # a drafter that proposes the target's argmax is accepted to the end
    assert oracle.chain(target, argmax_drafter(target), K, "greedy", V).expected_accepted == K


def test_block_accepts_at_least_as_much_as_token_on_every_test_model():
    for V, K, zeros in CHAIN_CASES:
        target, draft = random_model(V, 5 * V + K, zeros), random_model(V, 9 * V + K, zeros)
        token = oracle.chain(target, draft, K, "token", V).expected_accepted
        block = oracle.chain(target, draft, K, "block", V).expected_accepted
        assert block >= token - 1e-12, (V, K, zeros)


def _lossy_chain(target, draft, K, V, verify):
    """Distribution of emitted sequences for sampled drafts under a custom per-chain ``verify``."""
    seqs = {}
    for drafts in itertools.product(range(V), repeat=K):
        q = [np.asarray(draft(drafts[:i])) for i in range(K)]
        weight = float(np.prod([q[i][drafts[i]] for i in range(K)]))
        if weight == 0:
            continue
        p = [np.asarray(target(drafts[:i])) for i in range(K + 1)]
        for seq, prob in verify(drafts, p, q):
            seqs[seq] = seqs.get(seq, 0.0) + weight * prob
    return seqs


def test_the_oracle_tells_lossy_rules_from_exact_ones():
    V, K = 4, 2
    target, draft = random_model(V, 41), random_model(V, 42)
    joint = oracle.target_joint(target, K + 1)

    def resample_from_target(drafts, p, q):  # LongSpec's chain sampler: rejections redrawn from p
        out, reach = [], 1.0
        for i in range(K):
            accept = min(1.0, p[i][drafts[i]] / q[i][drafts[i]])
            out += [(drafts[:i] + (y,), reach * (1 - accept) * p[i][y]) for y in range(V)]
            reach *= accept
        return out + [(drafts + (y,), reach * p[K][y]) for y in range(V)]

    def relaxed_threshold(drafts, p, q):  # an acceptance threshold below 1 (accept if p/q >= 0.5 u)
        out, reach = [], 1.0
        for i in range(K):
            accept = min(1.0, 2 * p[i][drafts[i]] / q[i][drafts[i]])
            residual = np.maximum(p[i] - q[i], 0)
            residual /= residual.sum()
            out += [(drafts[:i] + (y,), reach * (1 - accept) * residual[y]) for y in range(V)]
            reach *= accept
        return out + [(drafts + (y,), reach * p[K][y]) for y in range(V)]

    for lossy in (resample_from_target, relaxed_threshold):
        seqs = oracle.extend(_lossy_chain(target, draft, K, V, lossy), target, K + 1)
        assert oracle.total_variation(seqs, joint) > 1e-3, lossy.__name__
    exact = oracle.extend(oracle.chain(target, draft, K, "token", V).sequences, target, K + 1)
    assert oracle.total_variation(exact, joint) < 1e-12


def test_argmax_drafts_verified_with_the_soft_draft_distribution_are_lossy():
    # deterministic drafts verified by the token rule against the distribution they were NOT drawn from
    V, K = 4, 2
    target, draft = random_model(V, 51), random_model(V, 52)
    drafts = ()
    for _ in range(K):
        drafts += (int(np.argmax(draft(drafts))),)
    p = [np.asarray(target(drafts[:i])) for i in range(K + 1)]
    q = [np.asarray(draft(drafts[:i])) for i in range(K)]
    wrong = {s: pr for s, pr, _ in oracle.chain_given_drafts("token", drafts, p, q)}
    right = oracle.chain(target, argmax_drafter(draft), K, "target_only", V).sequences
    joint = oracle.target_joint(target, K + 1)
    assert oracle.total_variation(oracle.extend(wrong, target, K + 1), joint) > 1e-3
    assert oracle.total_variation(oracle.extend(right, target, K + 1), joint) < 1e-12


# ----------------------------------------------------------------------------- trees

TREE_SHAPES = [[2, 2], [3, 1], [1, 2, 1], [2, 2, 2]]
LOSSLESS_TREE = {"iid": ("rrs", "traversal", "target_only"), "without_replacement": ("rrs", "traversal", "target_only"),
                 "top_k": ("target_only",)}


@pytest.mark.parametrize("shape", TREE_SHAPES, ids=str)
@pytest.mark.parametrize("drafting", ["iid", "without_replacement", "top_k"])
@pytest.mark.parametrize("zeros", [False, True])
def test_tree_oracle_reproduces_the_target_joint_distribution(shape, drafting, zeros):
    V = 4
    seed = 100 + 10 * len(shape) + sum(shape)
    target = random_model(V, seed, zeros)
    draft = random_model(V, seed + 1, zeros and drafting != "without_replacement")
    joint = oracle.target_joint(target, len(shape) + 1)
    for method in LOSSLESS_TREE[drafting]:
        out = oracle.tree(target, draft, shape, method, V, draft_sampling=drafting)
        assert abs(sum(out.sequences.values()) - 1) < 1e-12
        assert oracle.max_error(oracle.extend(out.sequences, target, len(shape) + 1), joint) < 1e-12, method


def test_the_oracle_shows_the_known_lossy_tree_rules_lossy():
    V, shape = 4, [2, 2]
    target, draft = random_model(V, 61), random_model(V, 62)
    joint = oracle.target_joint(target, 3)

    def tv(**kw):
        out = oracle.tree(target, draft, shape, "rrs", V, **kw)
        return oracle.total_variation(oracle.extend(out.sequences, target, 3), joint)

    assert tv(draft_sampling="top_k") > 0.05  # MLC: deterministic top-k siblings under the iid rule
    assert tv(draft_sampling="without_replacement", assume="iid") > 1e-3  # the iid rule on w/o drafts
    assert tv(draft_sampling="without_replacement") < 1e-12
    assert tv(draft_sampling="iid") < 1e-12
    out = oracle.tree(target, draft, shape, "target_only", V, draft_sampling="top_k")
    assert oracle.total_variation(oracle.extend(out.sequences, target, 3), joint) < 1e-12


def test_traversal_accepts_at_least_as_much_as_rrs_on_the_test_models():
    for i, shape in enumerate(TREE_SHAPES):
        for drafting in ("iid", "without_replacement"):
            target, draft = random_model(4, 70 + i), random_model(4, 80 + i)
            rrs = oracle.tree(target, draft, shape, "rrs", 4, draft_sampling=drafting).expected_accepted
            traversal = oracle.tree(target, draft, shape, "traversal", 4, draft_sampling=drafting).expected_accepted
            assert traversal >= rrs - 1e-12, (shape, drafting)


def test_greedy_tree_oracle_follows_the_argmax():
    target, draft = random_model(4, 91), random_model(4, 92)
    out = oracle.tree(target, draft, [2, 2], "greedy", 4, draft_sampling="top_k")
    (seq,) = out.sequences
    assert seq == oracle.greedy_sequence(target, len(seq))


def test_the_monte_carlo_z_score_takes_the_exact_laws_spread_not_the_samples():
    # a sample of equal counts (few trials) has no spread of its own: its z was infinite ("FAIL" for exact methods)
    import numpy as np

    from specsampler.verify.exactness import MonteCarlo
    from specsampler.verify.oracle import Outcome

    exact = Outcome({(1,): 0.5, (2, 3): 0.5}, 0.5)  # 0 or 1 accepted drafts, evenly: variance 1/4
    mc = MonteCarlo(1.0, 1.0, 0, np.ones(16), None, exact, 0.0)
    assert mc.z_score() == pytest.approx(0.5 / (0.5 / 4))  # |1 - 0.5| over sqrt(0.25 / 16)
    assert MonteCarlo(1.0, 1.0, 0, np.full(16, 0.5), None, exact, 0.0).z_score() == 0.0
    certain = Outcome({(2, 3): 1.0}, 1.0)  # no spread: any gap is infinitely far
    assert MonteCarlo(1.0, 1.0, 0, np.zeros(4), None, certain, 0.0).z_score() == float("inf")
    assert MonteCarlo(1.0, 1.0, 0, np.ones(4), None, certain, 0.0).z_score() == 0.0
