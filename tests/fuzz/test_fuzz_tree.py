"""Fuzzing tree verification (verify_tree, verify_tree_from_logits: every method and draft sampling,
random trees with absent nodes), the TokenTree constructors on arbitrary input, and compact_kv,
against the error policy (see fuzzkit)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from fuzzkit import (
    BACKENDS,
    FLOAT_DTYPES,
    LOGIT_CLASSES,
    PROB_CLASSES,
    Ids,
    Mask,
    Params,
    Rng,
    Values,
    bad_logits,
    bad_probs,
    build_mask,
    build_params,
    build_rng,
    call_contract,
    check_tree_result,
    fuzz,
    fuzz_report,  # noqa: F401  (autouse: the examples-run report)
    garbage_strategy,
    ids_strategy,
    make_ids,
    make_logits,
    make_probs,
    mask_has_empty_row,
    mask_is_structurally_bad,
    mask_strategy,
    params_strategy,
    parents_strategy,
    rng_strategy,
    tree_from,
    values_strategy,
    vocab,
)
from hypothesis import strategies as st

import specsampler as ss

METHODS = ("auto", "greedy", "target_only", "rrs", "traversal", "rrs", "traversal", "unknown")
SAMPLINGS = ("iid", "without_replacement", "iid", "without_replacement", "deterministic")


@dataclass(frozen=True)
class TreeCase:
    parents: list[list[int]]
    build: str  # the constructor: "parents", "links" or "mask"
    other_n: bool  # a tree of another size than the tensors (a structural mistake)
    V: int
    target: Values
    drafts: Ids
    method: str
    with_q: bool
    q: Values
    draft_sampling: str
    params: Params | None
    mask: Mask
    rng: Rng
    validate: str


@st.composite
def tree_cases(draw, backend: str, from_logits: bool) -> TreeCase:
    B = draw(st.integers(1, 3) if backend == "torch" else st.integers(1, 2))
    N = draw(st.integers(1, 7) if backend == "torch" else st.integers(1, 5))
    V = draw(vocab(backend))
    method = draw(st.sampled_from(METHODS))
    sampled = method in ("rrs", "traversal") or (method == "auto" and draw(st.booleans()))
    with_q = sampled if draw(st.integers(0, 9)) else not sampled
    classes = LOGIT_CLASSES if from_logits else PROB_CLASSES
    garbage = draw(st.integers(0, 2)) == 0  # a third of the examples: bad values everywhere, default validation
    values = garbage_strategy if garbage else values_strategy
    return TreeCase(draw(parents_strategy(B, N)), draw(st.sampled_from(("parents", "links", "mask"))),
                    draw(st.integers(0, 19)) == 0, V, draw(values(classes, FLOAT_DTYPES)), draw(ids_strategy(garbage)),
                    method, with_q, draw(values(PROB_CLASSES, FLOAT_DTYPES)), draw(st.sampled_from(SAMPLINGS)),
                    draw(params_strategy(B)) if from_logits else None,
                    draw(mask_strategy()) if from_logits else Mask("none", 0), draw(rng_strategy()),
                    "structure" if garbage else draw(st.sampled_from(("structure", "full"))))


def _check(case: TreeCase, from_logits: bool):
    tree = tree_from(case.parents, case.build)
    B, N, V = tree.batch_size, tree.size, case.V
    n_tensors = N + 1 if case.other_n else N
    shape = (B, n_tensors, V)
    target = (make_logits if from_logits else make_probs)(case.target, shape)
    drafts = make_ids(case.drafts, (B, n_tensors), V)
    q = make_probs(case.q, shape) if case.with_q else None
    mask = build_mask(case.mask, shape) if from_logits else None
    rng = build_rng(case.rng, B)
    method = ("rrs" if case.with_q else "target_only") if case.method == "auto" else case.method
    structural = (
        case.other_n
        or method == "unknown"
        or (method in ("rrs", "traversal") and q is None)
        or (method == "target_only" and q is not None)
        or case.draft_sampling not in ("iid", "without_replacement")
        or case.rng.kind in ("philox_bad_shape", "bad_type")
        or (from_logits and (case.params.bad or mask_is_structurally_bad(case.mask, shape)))
    )
    bad_values = False
    if case.validate == "full" and not case.other_n:
        present, child = tree.depth >= 0, tree.depth > 0
        x = drafts.long()
        bad_values = (
            bool((((x < 0) | (x >= V)) & child).any())
            or (bad_logits(target, present) if from_logits else bad_probs(target, present))
            or (q is not None and bad_probs(q, child))
            or (from_logits and mask_has_empty_row(mask, shape, present))
        )
    kw = dict(draft_probs=q, method=case.method, draft_sampling=case.draft_sampling, rng=rng, validate=case.validate)
    if from_logits:
        call = lambda: ss.verify_tree_from_logits(target, drafts, tree, build_params(case.params), vocab_mask=mask,
                                                  expected_accepted=True, **kw)
    else:
        call = lambda: ss.verify_tree(target, drafts, tree, **kw)
    out = call_contract(call, [target, drafts, tree, q, mask, rng], must_raise=structural or bad_values,
                        must_pass=not structural and not bad_values, value_error=bad_values and not structural)
    if out.error is None:
        check_tree_result(out.result, tree, drafts, V)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_tree_gives_a_clear_error_or_a_path_of_the_tree(backend):
    fuzz("verify_tree", backend, tree_cases(backend, False), lambda case: _check(case, False), n=(100, 30))


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_tree_from_logits_gives_a_clear_error_or_a_path_of_the_tree(backend):
    fuzz("verify_tree_from_logits", backend, tree_cases(backend, True), lambda case: _check(case, True), n=(100, 25))


# ----------------------------------------------------------------------------- TokenTree constructors


def _assert_valid_tree(tree: ss.TokenTree) -> None:
    """Invariants of a constructed tree, and the other two constructors give the same tree."""
    p, d = tree.parents, tree.depth
    B, N = p.shape
    assert bool((p[:, 0] == -1).all()) and bool((d[:, 0] == 0).all())
    idx = torch.arange(N)
    present = d >= 0
    assert bool(((p < idx) | ~present).all()), "a parent after its child"
    kids = present & (idx > 0)
    assert bool((d.gather(1, p.clamp(min=0))[kids] + 1 == d[kids]).all()), "depth is not the parent's plus 1"
    assert bool((p[~present] == -1).all())
    for other in (ss.TokenTree.from_first_child_next_sibling(tree.first_child, tree.next_sibling),
                  ss.TokenTree.from_mask(tree.mask())):
        assert torch.equal(other.parents, p) and torch.equal(other.depth, d)


@dataclass(frozen=True)
class RawTree:
    kind: str  # "parents", "links", "mask"
    B: int
    N: int
    seed: int
    dtype: torch.dtype


@pytest.mark.parametrize("kind", ["parents", "links", "mask"])
def test_token_tree_constructors_give_a_clear_error_or_a_valid_tree_on_any_input(kind):
    def body(raw: RawTree):
        g = torch.Generator().manual_seed(raw.seed)
        B, N = raw.B, raw.N
        idx = torch.arange(N)
        near = torch.where(torch.rand(B, N, generator=g) < 0.7, idx - 1, torch.randint(-3, N + 2, (B, N), generator=g))
        if raw.kind == "parents":
            args = (near.to(raw.dtype),)
            make = ss.TokenTree.from_parents
        else:  # a valid tree's links or mask, one entry of them changed half the time
            N = max(N, 1)
            near = near[:, :N] if near.shape[1] else torch.full((B, 1), -1)
            rows = [[-1] + [int(v) if 0 <= v < i else -1 for i, v in enumerate(r.tolist()) if i] for r in near]
            for r in rows:
                for i in range(1, N):
                    r[i] = r[i] if r[i] <= 0 or r[r[i]] != -1 else -1
            ref = ss.TokenTree.from_parents(torch.tensor(rows, dtype=torch.int64).reshape(B, N))
            args = [ref.first_child.clone(), ref.next_sibling.clone()] if raw.kind == "links" else [ref.mask()]
            if B and N and bool(torch.rand(1, generator=g) < 0.5):
                t = args[int(torch.randint(len(args), (1,), generator=g))].view(-1)
                at = int(torch.randint(t.numel(), (1,), generator=g))
                t[at] = ~t[at] if t.dtype == torch.bool else int(torch.randint(-3, N + 2, (1,), generator=g))
            args = tuple(a if a.dtype == torch.bool and raw.dtype == torch.bool else a.to(raw.dtype) for a in args)
            make = ss.TokenTree.from_mask if raw.kind == "mask" else ss.TokenTree.from_first_child_next_sibling
        out = call_contract(lambda: make(*args), list(args))
        if out.error is None:
            _assert_valid_tree(out.result)

    dtypes = (torch.int64, torch.int32, torch.int8) if kind != "mask" else (torch.bool, torch.int64)
    strategy = st.builds(RawTree, st.just(kind), st.integers(0, 3), st.integers(0, 6), st.integers(0, 2**31 - 1),
                         st.sampled_from(dtypes))
    fuzz(f"TokenTree.from_{kind}", "torch", strategy, body, n=(60, 0))


# ----------------------------------------------------------------------------- compact_kv


@dataclass(frozen=True)
class KvCase:
    B: int
    S: int
    J: int
    layout: str  # "tensor", "list", "pairs"
    seq_dim: int
    seed: int
    lens: str  # "ok", "negative", "past_end"
    path: str  # "tree", "garbage"
    counts: str  # "ok", "garbage"
    validate: str


def test_compact_kv_gives_a_clear_error_or_moves_only_inside_the_cache():
    def body(case: KvCase):
        g = torch.Generator().manual_seed(case.seed)
        B, S, J = case.B, case.S, case.J
        shape = [B, 2, 3] if case.seq_dim == 1 else [B, 3, 2]
        shape.insert(case.seq_dim, S)
        base = torch.randn(shape, generator=g)
        cache = {"tensor": base.clone(), "list": [base.clone(), base.clone() + 1],
                 "pairs": [(base.clone(), base.clone() - 1)]}[case.layout]
        lens = torch.randint(0, max(1, S - J), (B,), generator=g)
        if case.lens == "negative":
            lens[0 if B else slice(0)] = -3
        elif case.lens == "past_end":
            lens[0 if B else slice(0)] = S
        path = torch.randint(1, max(2, J + 1), (B, J), generator=g)
        if J:
            path[:, 0] = 0
        if case.path == "garbage":
            path = torch.randint(-3, S + 3, (B, J), generator=g)
        n = torch.randint(0, max(1, J), (B,), generator=g)
        if case.counts == "garbage":
            n = torch.randint(-2, J + 3, (B,), generator=g)
        positions = lens[:, None] + torch.arange(J)
        valid = torch.arange(J) <= n[:, None]
        used_src = (lens[:, None] + path.clamp(min=0))[valid & (path >= 0)]
        used_dst = positions[valid & (path >= 0)]
        inside = bool(((used_src >= 0) & (used_src < S)).all()) and bool(((used_dst >= 0) & (used_dst < S)).all())
        out = call_contract(lambda: ss.compact_kv(cache, lens, path, n, seq_dim=case.seq_dim, validate=case.validate),
                            [lens, path, n], must_raise=not inside, must_pass=inside and case.counts == "ok")
        if out.error is None:
            assert all(t.shape == base.shape for t in (cache if isinstance(cache, list) else [cache])
                       for t in (t if isinstance(t, tuple) else (t,)))

    strategy = st.builds(KvCase, st.integers(0, 3), st.integers(0, 8), st.integers(0, 4),
                         st.sampled_from(("tensor", "list", "pairs")), st.sampled_from((1, 2)),
                         st.integers(0, 2**31 - 1), st.sampled_from(("ok", "ok", "negative", "past_end")),
                         st.sampled_from(("tree", "tree", "garbage")), st.sampled_from(("ok", "garbage")),
                         st.sampled_from(("structure", "full")))
    fuzz("compact_kv", "torch", strategy, body, n=(80, 0))
