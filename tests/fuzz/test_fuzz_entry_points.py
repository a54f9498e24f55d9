"""Fuzzing the seed entry points against the error policy (see fuzzkit): ``mlc.batch_spec_verify`` (both
back ends; ``model_probs`` and ``token_tree_parent_ptr`` are written by design, every other input must
be unchanged), the ``mlc.Sampler`` methods and the ``longspec`` entry points."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from fuzzkit import (
    BACKENDS,
    FLOAT_DTYPES,
    INT_DTYPES,
    LOGIT_CLASSES,
    PROB_CLASSES,
    Ids,
    Rng,
    Values,
    assert_ids,
    bad_logits,
    bad_probs,
    build_rng,
    call_contract,
    fuzz,
    fuzz_report,  # noqa: F401  (autouse: the examples-run report)
    garbage_strategy,
    ids_strategy,
    make_ids,
    make_logits,
    make_probs,
    parents_strategy,
    rng_strategy,
    tree_from,
    values_strategy,
    vocab,
)
from hypothesis import strategies as st

import specsampler as ss
from specsampler import mlc

# ----------------------------------------------------------------------------- mlc.batch_spec_verify


@dataclass(frozen=True)
class SpecCase:
    parents: list[list[int]]  # one tree per request, laid out one after another in the global nodes
    V: int
    draft: Values
    model: Values
    tokens: Ids
    links: str  # "forest", "garbage" (random indices, cycles), "outside" (values outside [-1, num_nodes))
    uniforms: str  # "ok", "garbage" (NaN, negative, above 1)
    roots: str  # "ok", "outside"
    link_dtype: torch.dtype
    seed: int
    validate: str


@st.composite
def spec_cases(draw, backend: str) -> SpecCase:
    B = draw(st.integers(1, 3))
    N = draw(st.integers(1, 5))
    garbage = draw(st.integers(0, 2)) == 0
    values = garbage_strategy if garbage else values_strategy
    return SpecCase(draw(parents_strategy(B, N)), draw(vocab(backend)), draw(values(PROB_CLASSES, FLOAT_DTYPES)),
                    draw(values(PROB_CLASSES)), draw(ids_strategy(garbage)),
                    draw(st.sampled_from(("forest", "forest", "garbage", "outside"))),
                    draw(st.sampled_from(("ok", "ok", "garbage"))), draw(st.sampled_from(("ok", "ok", "outside"))),
                    draw(st.sampled_from(INT_DTYPES)), draw(st.integers(0, 2**31 - 1)),
                    "structure" if garbage else draw(st.sampled_from(("structure", "full"))))


def _forest(case: SpecCase, g: torch.Generator):
    """Global first_child / next_sibling of the requests' trees, their roots, and the links' validity."""
    trees = [tree_from([row], "parents") for row in case.parents]
    starts = torch.tensor([0] + [t.size for t in trees]).cumsum(0)
    num_nodes = int(starts[-1])
    fc = torch.cat([torch.where(t.first_child[0] >= 0, t.first_child[0] + s, -1) for t, s in zip(trees, starts)])
    ns = torch.cat([torch.where(t.next_sibling[0] >= 0, t.next_sibling[0] + s, -1) for t, s in zip(trees, starts)])
    if case.links == "garbage":
        fc = torch.where(torch.rand(num_nodes, generator=g) < 0.5, torch.randint(-1, num_nodes, (num_nodes,),
                                                                                  generator=g), fc)
        ns = torch.where(torch.rand(num_nodes, generator=g) < 0.3, torch.randint(-1, num_nodes, (num_nodes,),
                                                                                  generator=g), ns)
    elif case.links == "outside":
        fc[int(torch.randint(num_nodes, (1,), generator=g))] = num_nodes + 2
    roots = starts[:-1].clone()
    if case.roots == "outside":
        roots[0] = num_nodes
    return fc, ns, roots, num_nodes


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlc_batch_spec_verify_gives_a_clear_error_or_node_pointers_in_range(backend):
    def body(case: SpecCase):
        g = torch.Generator().manual_seed(case.seed)
        fc, ns, roots, num_nodes = _forest(case, g)
        V = case.V
        draft = make_probs(case.draft, (num_nodes, V))
        model = make_probs(case.model, (num_nodes, V))
        tokens = make_ids(case.tokens, (num_nodes,), V)
        u = torch.rand(num_nodes, generator=g)
        if case.uniforms == "garbage":
            u[int(torch.randint(num_nodes, (1,), generator=g))] = float(["nan", "-1", "2", "inf"][case.seed % 4])
        fc, ns, ptr = fc.to(case.link_dtype), ns.to(case.link_dtype), roots.to(case.link_dtype)
        structural = case.links == "outside" or case.roots == "outside" or not model.is_contiguous()
        bad_values = False
        if case.validate == "full":
            linked = torch.zeros(num_nodes, dtype=torch.bool)
            for links in (fc, ns):
                linked[links[(links >= 0) & (links < num_nodes)].long()] = True
            t = tokens.long()
            bad_values = (bool((((t < 0) | (t >= V)) & linked).any())  # MLC's rule: finite values >= 0 (any sum)
                          or bool(((~torch.isfinite(draft) | (draft < 0)) & linked[:, None]).any())
                          or bool((~torch.isfinite(model) | (model < 0)).any())
                          or bool((linked & ~((u >= 0) & (u <= 1))).any()))
        out = call_contract(lambda: mlc.batch_spec_verify(draft, tokens, model, fc, ns, u, ptr, validate=case.validate),
                            [draft, tokens, fc, ns, u], must_raise=structural or bad_values,
                            must_pass=not structural and not bad_values)
        if out.error is None:
            assert bool(((ptr >= 0) & (ptr < num_nodes)).all()), f"parent pointers {ptr.tolist()} outside the nodes"
            if case.links == "forest":  # each request ends in its own tree
                starts = roots.long()
                ends = torch.cat([starts[1:], torch.tensor([num_nodes])])
                assert bool(((ptr.long() >= starts) & (ptr.long() < ends)).all()), "a walk left its tree"

    fuzz("mlc.batch_spec_verify", backend, spec_cases(backend), body, n=(80, 25))


# ----------------------------------------------------------------------------- mlc.Sampler


@dataclass(frozen=True)
class SamplerCase:
    sampler: str  # "cpu", "gpu" (the GPU sampler on the CPU), "gpu_small" (capacity below the call)
    method: str
    R: int
    V: int
    probs: Values
    configs: tuple[dict, ...]
    indices: str  # "ok", "outside"
    parents: list[list[int]]
    verify_method: str
    draft_sampling: str
    draft: Values
    seed: int
    validate: str


CONFIGS = ({}, {"temperature": 0.0}, {"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.3},
           {"logprobs": True, "top_logprobs": 3},
           {"top_p": 0.0}, {"temperature": -1.0}, {"top_logprobs": 2})  # the last three are invalid configs
SAMPLER_METHODS = ("batch_renormalize_probs_by_top_p", "batch_sample_tokens_with_prob_before_top_p",
                   "batch_sample_tokens_with_prob_after_top_p", "batch_verify_draft_tokens_with_prob_after_top_p")


@st.composite
def sampler_cases(draw) -> SamplerCase:
    method = draw(st.sampled_from(SAMPLER_METHODS))
    parents = draw(parents_strategy(draw(st.integers(1, 3)), draw(st.integers(1, 4))))
    garbage = draw(st.integers(0, 2)) == 0
    values = garbage_strategy if garbage else values_strategy
    return SamplerCase(draw(st.sampled_from(("cpu", "gpu", "gpu_small"))), method, draw(st.integers(1, 4)),
                       draw(st.integers(1, 9) | st.sampled_from((64, 300))), draw(values(PROB_CLASSES, FLOAT_DTYPES)),
                       tuple(draw(st.sampled_from(CONFIGS)) for _ in range(len(parents))),
                       draw(st.sampled_from(("ok", "ok", "outside"))), parents,
                       draw(st.sampled_from(("rrs", "traversal", "target_only", "greedy"))),
                       draw(st.sampled_from(("iid", "without_replacement"))), draw(values(PROB_CLASSES)),
                       draw(st.integers(0, 2**31 - 1)), "structure" if garbage else draw(st.sampled_from(("structure",
                                                                                                          "full"))))


def test_mlc_sampler_methods_give_a_clear_error_or_tokens_in_range():
    def body(case: SamplerCase):
        V = case.V
        bad_config = any(c in CONFIGS[-3:] for c in case.configs)
        if case.method != "batch_verify_draft_tokens_with_prob_after_top_p":
            n = len(case.configs)
            probs = make_probs(case.probs, (case.R, V))
            idx = [i % case.R for i in range(n)]
            if case.indices == "outside":
                idx[0] = case.R
            sampler = (mlc.Sampler.create_cpu_sampler() if case.sampler == "cpu" else
                       mlc.Sampler.create_gpu_sampler(n if case.sampler == "gpu" else max(1, n - 1), V, "cpu"))
            structural = bad_config or case.indices == "outside"
            if case.method == "batch_renormalize_probs_by_top_p":  # a row's samples share one config (filtered once)
                first = {}
                structural |= any(first.setdefault(i, c) != c for i, c in zip(idx, map(repr, case.configs)))
                capacity = {"cpu": case.R, "gpu": n, "gpu_small": max(1, n - 1)}[case.sampler]
                structural |= capacity < case.R  # the GPU sampler renormalises every row of probs
            args = [probs, idx, [f"r{i}" for i in range(n)]]
            if case.method == "batch_renormalize_probs_by_top_p":
                call = lambda: sampler.batch_renormalize_probs_by_top_p(
                    *args, [mlc.GenerationConfig(**c) for c in case.configs], validate=case.validate)
            else:
                call = lambda: getattr(sampler, case.method)(
                    *args, [mlc.GenerationConfig(**c) for c in case.configs],
                    [mlc.RandomGenerator(case.seed + i) for i in range(n)], validate=case.validate)
            bad_values = case.validate == "full" and bad_probs(probs[idx]) if not structural else False
            out = call_contract(call, [probs], must_raise=structural or bad_values,
                                must_pass=not structural and not bad_values)
            if out.error is None and case.method != "batch_renormalize_probs_by_top_p":
                for r in out.result:
                    assert 0 <= r.get_token_id() < V, f"sampled token {r.get_token_id()} outside [0, {V})"
                    assert all(0 <= t < V for t, _ in r.top_prob_tokens)
            return
        trees = [tree_from([row], "parents") for row in case.parents]
        lengths = [int(t.num_nodes[0]) for t in trees]
        # a request's nodes are its present nodes; its parent pointers index them (absent ones dropped)
        local = []
        for t in trees:
            keep = (t.depth[0] >= 0).nonzero()[:, 0].tolist()
            renum = {old: new for new, old in enumerate(keep)}
            local.append([-1] + [renum[int(t.parents[0, k])] for k in keep[1:]])
        cum = [0]
        for n_i in lengths:
            cum.append(cum[-1] + n_i)
        probs = make_probs(case.probs, (cum[-1], V))
        draft = make_probs(case.draft, (cum[-1], V))
        g = torch.Generator().manual_seed(case.seed)
        drafts = [[mlc.SampleResult((int(torch.randint(V, (1,), generator=g)), 0.5)) for _ in range(n_i - 1)]
                  for n_i in lengths]
        parent_ptr = [p for row in local for p in row]
        B = len(trees)
        sampler = (mlc.Sampler.create_cpu_sampler() if case.sampler == "cpu" else
                   mlc.Sampler.create_gpu_sampler(cum[-1] if case.sampler == "gpu" else max(1, cum[-1] - 1), V, "cpu"))
        structural = bad_config or (case.sampler == "gpu_small" and cum[-1] > 1)
        sampled = case.verify_method in ("rrs", "traversal")
        call = lambda: sampler.batch_verify_draft_tokens_with_prob_after_top_p(
            probs, [f"r{i}" for i in range(B)], cum, [mlc.GenerationConfig(**c) for c in case.configs],
            [mlc.RandomGenerator(case.seed + i) for i in range(B)], drafts, parent_ptr, draft if sampled else None,
            method=case.verify_method, draft_sampling=case.draft_sampling, validate=case.validate)
        bad_values = False
        if case.validate == "full" and not structural:
            roots = torch.zeros(cum[-1], dtype=torch.bool)
            roots[cum[:-1]] = True
            bad_values = bad_probs(probs) or (sampled and bad_probs(draft, ~roots))
        out = call_contract(call, [probs, draft], must_raise=structural or bad_values,
                            must_pass=not structural and not bad_values)
        if out.error is None:
            results, last = out.result
            assert len(results) == B and len(last) == B
            for b, (res, node) in enumerate(zip(results, last)):
                assert 0 <= node < lengths[b], f"request {b}: last node {node} outside its {lengths[b]} nodes"
                assert 1 <= len(res) <= lengths[b], f"request {b}: {len(res)} tokens from {lengths[b]} nodes"
                assert all(0 <= r.get_token_id() < V for r in res), f"request {b}: a token outside [0, {V})"

    fuzz("mlc.Sampler", "torch", sampler_cases(), body, n=(60, 0))


# ----------------------------------------------------------------------------- longspec


@dataclass(frozen=True)
class LongSpecCase:
    parents: list[list[int]]
    V: int
    ids: Ids
    target: Values
    draft: Values
    temperature: float
    draft_sampling: str
    mask_dtype: torch.dtype
    rng: Rng
    validate: str


@st.composite
def longspec_cases(draw) -> LongSpecCase:
    B, N = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    garbage = draw(st.integers(0, 2)) == 0
    values = garbage_strategy if garbage else values_strategy
    return LongSpecCase(draw(parents_strategy(B, N)), draw(vocab("torch")), draw(ids_strategy(garbage)),
                        draw(values(LOGIT_CLASSES, FLOAT_DTYPES)), draw(values(LOGIT_CLASSES, FLOAT_DTYPES)),
                        draw(st.sampled_from((1.0, 0.7, 1e-3, 0.0, -1.0, float("nan")))),
                        draw(st.sampled_from(("deterministic", "iid", "without_replacement", "other"))),
                        draw(st.sampled_from((torch.bool, torch.int64, torch.float32))), draw(rng_strategy()),
                        "structure" if garbage else draw(st.sampled_from(("structure", "full"))))


def test_longspec_entry_points_give_a_clear_error_or_outputs_in_range():
    def body(case: LongSpecCase):
        tree = tree_from(case.parents, "parents")
        B, N, V = tree.batch_size, tree.size, case.V
        mask = tree.mask().to(case.mask_dtype)
        ids = make_ids(case.ids, (B, N), V)
        out_ids = make_ids(Ids(case.ids.seed + 1, case.ids.dtype, case.ids.bad), (B, N), V)
        lens = torch.zeros(B, dtype=torch.int64)
        res = call_contract(lambda: ss.longspec.tree_verification(ids, out_ids, mask, lens, 1),
                            [ids, out_ids, mask, lens], must_pass=True)
        acc_ids, acc_num, double = res.result
        D = tree.max_depth
        assert acc_ids.shape == (B, D + 1) and bool(((acc_num >= 1) & (acc_num <= D + 1)).all())
        assert set(double.tolist()) <= {0, 1}
        pos = torch.arange(D + 1)
        assert bool((acc_ids[pos >= acc_num[:, None]] == -1).all()), "acc_ids not -1 after acc_num"

        p_llm = make_logits(case.target, (B, N, V))
        p_ssm = make_logits(case.draft, (B, N, V))
        rng = build_rng(case.rng, B)
        T = case.temperature
        structural = not T > 0 or case.draft_sampling == "other" or case.rng.kind in ("philox_bad_shape", "bad_type")
        bad_values = False
        if case.validate == "full" and not structural:
            child, present = tree.depth > 0, tree.depth >= 0
            x = ids.long()
            bad_values = bool((((x < 0) | (x >= V)) & child).any()) or bad_logits(p_llm, present)
            if case.draft_sampling != "deterministic":  # the draft rows become q = softmax(p_ssm[parent] / T)
                parent_rows = p_ssm[torch.arange(B)[:, None], tree.parents.clamp(min=0)]
                q = torch.softmax(parent_rows.float() / T, -1)
                bad_values |= bad_probs(q, child)
        res = call_contract(lambda: ss.longspec.verify_stochastic(ids, mask, p_llm, p_ssm, T,
                                                                  draft_sampling=case.draft_sampling, rng=rng,
                                                                  validate=case.validate),
                            [ids, mask, p_llm, p_ssm, rng], must_raise=structural or bad_values,
                            must_pass=not structural and not bad_values)
        if res.error is None:
            acc_ids, acc_num = res.result
            assert acc_ids.shape == (B, D + 2) and bool(((acc_num >= 2) & (acc_num <= D + 2)).all())
            emitted = acc_ids[:, 1:]
            assert_ids(torch.where(torch.arange(D + 1) < (acc_num - 1)[:, None], emitted, -1), V, pad=True,
                       what="verify_stochastic acc_ids")
            assert bool((acc_ids[torch.arange(D + 2) >= acc_num[:, None]] == -1).all())

    fuzz("longspec", "torch", longspec_cases(), body, n=(60, 0))
