"""Fuzzing the drop-in compat functions (``specsampler.compat``) against the error policy, with the
peers' own messages: a ValueError (FlashInfer's and SGLang's checks, ours) or token ids in range,
every input not documented as written in place unchanged, and no hang. On both back ends."""

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
    Values,
    assert_ids,
    assert_unchanged,
    fuzz,
    fuzz_report,  # noqa: F401  (autouse: the examples-run report)
    garbage_strategy,
    ids_strategy,
    make_ids,
    make_logits,
    make_probs,
    snapshot,
    values_strategy,
)
from hypothesis import strategies as st

import specsampler.compat.flashinfer as flashinfer
import specsampler.compat.sglang as sglang
from specsampler.compat import hf, tokenspeed, vllm

SAMPLERS = {  # name -> (function, input kind, filter parameters)
    "flashinfer.sampling_from_probs": (flashinfer.sampling_from_probs, "probs", ()),
    "flashinfer.sampling_from_logits": (flashinfer.sampling_from_logits, "logits", ()),
    "flashinfer.top_p_sampling_from_probs": (flashinfer.top_p_sampling_from_probs, "probs", ("top_p",)),
    "flashinfer.top_k_sampling_from_probs": (flashinfer.top_k_sampling_from_probs, "probs", ("top_k",)),
    "flashinfer.min_p_sampling_from_probs": (flashinfer.min_p_sampling_from_probs, "probs", ("min_p",)),
    "flashinfer.top_k_top_p_sampling_from_probs": (flashinfer.top_k_top_p_sampling_from_probs, "probs",
                                                   ("top_k", "top_p")),
    "flashinfer.top_k_top_p_sampling_from_logits": (flashinfer.top_k_top_p_sampling_from_logits, "logits",
                                                    ("top_k", "top_p")),
    "sglang.top_p_sampling_from_probs": (sglang.sampling.top_p_sampling_from_probs, "probs", ("top_p",)),
    "sglang.min_p_sampling_from_probs": (sglang.sampling.min_p_sampling_from_probs, "probs", ("min_p",)),
    "sglang.top_k_top_p_sampling_from_probs": (sglang.sampling.top_k_top_p_sampling_from_probs, "probs",
                                               ("top_k", "top_p")),
    "sglang.top_k_top_p_sampling_from_logits": (sglang.sampling.top_k_top_p_sampling_from_logits, "logits",
                                                ("top_k", "top_p")),
}
FILTERS = {  # name -> (function, input kind, parameter)
    "flashinfer.top_p_renorm_probs": (flashinfer.top_p_renorm_probs, "probs", "top_p"),
    "flashinfer.top_k_renorm_probs": (flashinfer.top_k_renorm_probs, "probs", "top_k"),
    "flashinfer.top_k_mask_logits": (flashinfer.top_k_mask_logits, "logits", "top_k"),
    "flashinfer.softmax": (flashinfer.softmax, "logits", None),
    "sglang.top_k_renorm_prob": (sglang.sampling.top_k_renorm_prob, "probs", "top_k"),
    "sglang.top_p_renorm_prob": (sglang.sampling.top_p_renorm_prob, "probs", "top_p"),
}
PARAM_VALUES = {"top_k": (0, 1, 3, -1, 10**6), "top_p": (1.0, 0.5, 1e-6, 0.0, 1.5, float("nan")),
                "min_p": (0.0, 0.3, 1.0, -0.1, 2.0)}
CHAINS = ("flashinfer.chain_speculative_sampling", "vllm.rejection_sample", "hf.speculative_sampling",
          "tokenspeed.chain_speculative_sampling_target_only", "tokenspeed.verify_chain_greedy")


@dataclass(frozen=True)
class CompatCase:
    name: str
    B: int
    K: int
    V: int
    values: Values
    q: Values
    ids: Ids
    params: tuple
    param_form: str  # "scalar" or "tensor"
    indices: str  # "none", "ok", "outside"
    check_nan: bool
    seeded: bool
    seed: int


@st.composite
def compat_cases(draw, backend: str) -> CompatCase:
    name = draw(st.sampled_from((*SAMPLERS, *FILTERS, *CHAINS)))
    kind = "logits" if "logits" in name or name in ("flashinfer.softmax", "vllm.rejection_sample",
                                                    "hf.speculative_sampling") else "probs"
    garbage = draw(st.integers(0, 2)) == 0
    values = garbage_strategy if garbage else values_strategy
    classes = LOGIT_CLASSES if kind == "logits" else PROB_CLASSES
    V = draw(st.integers(1, 9) | st.sampled_from((64, 300) if backend == "torch" else (64,)))
    return CompatCase(name, draw(st.integers(1, 3)), draw(st.integers(0, 3)), V,
                      draw(values(classes, FLOAT_DTYPES)), draw(values(PROB_CLASSES)), draw(ids_strategy(garbage)),
                      tuple(draw(st.sampled_from(v)) for v in PARAM_VALUES.values()),
                      draw(st.sampled_from(("scalar", "tensor"))), draw(st.sampled_from(("none", "ok", "outside"))),
                      draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1)))


def _param(case: CompatCase, name: str):
    v = case.params[list(PARAM_VALUES).index(name)]
    if case.param_form == "scalar":
        return v
    return torch.full((case.B,), v, dtype=torch.int32 if name == "top_k" else torch.float32)


def _body(case: CompatCase) -> None:
    B, K, V = case.B, case.K, case.V
    g = torch.Generator().manual_seed(case.seed)
    if case.name in SAMPLERS or case.name in FILTERS:
        fn, kind, names = SAMPLERS.get(case.name) or FILTERS[case.name]
        x = (make_logits if kind == "logits" else make_probs)(case.values, (B, V))
        inputs = [x]
        if case.name in FILTERS:
            args = (x,) if names is None else (x, _param(case, names))
            kwargs = {}
        else:
            args = (x, *(_param(case, n) for n in names))
            kwargs = {"check_nan": case.check_nan}
            if case.indices != "none":
                idx = torch.randint(B, (B + 1,), generator=g, dtype=torch.int32)
                if case.indices == "outside":
                    idx[0] = B + 2
                kwargs["indices"] = idx
                inputs.append(idx)
            if case.seeded and case.name.startswith("flashinfer"):
                kwargs.update(seed=case.seed, offset=3)
        inputs += [a for a in args if isinstance(a, torch.Tensor)]

        def check(out):
            if case.name in FILTERS:
                assert out.shape == x.shape
                return
            tokens = out[0] if isinstance(out, tuple) else out
            rows = kwargs["indices"].numel() if "indices" in kwargs else B
            assert tokens.shape == (rows,)
            assert_ids(tokens.long(), V, pad=False, what=case.name)

        call = lambda: fn(*args, **kwargs)
    elif case.name == "flashinfer.chain_speculative_sampling":
        q = make_probs(case.q, (B, K, V))
        p = make_probs(case.values, (B, K + 1, V))
        x = make_ids(case.ids, (B, K), V)
        counters = [torch.zeros(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32)]  # written in place
        inputs = [q, p, x]
        call = lambda: flashinfer.chain_speculative_sampling(q, x, p, *counters, seed=case.seed, offset=0)

        def check(out):
            tokens, accepted, emitted = out
            assert tokens.shape == (B, K + 1)
            assert_ids(tokens.long(), V, pad=True, what=case.name)
            assert bool(((emitted >= 0) & (emitted <= K)).all()) and bool((accepted >= emitted).all())
    elif case.name == "vllm.rejection_sample":
        counts = torch.randint(0, K + 1, (B,), generator=g).tolist()
        T = sum(counts)
        logits = make_logits(case.values, (T, V))
        q = make_probs(case.q, (T, V)) if case.seeded else None
        x = make_ids(case.ids, (T,), V).to(torch.int32)
        bonus = torch.randint(V, (B, 1), generator=g, dtype=torch.int32)
        cu = torch.tensor(counts).cumsum(0).to(torch.int32)
        temperature = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, 1.0)
        sm = vllm.SamplingMetadata(temperature=temperature, all_greedy=bool((temperature == 0).all()),
                                   all_random=bool((temperature != 0).all()), generators={})
        inputs = [logits, x, bonus, cu, temperature] + ([q] if q is not None else [])
        call = lambda: vllm.rejection_sample(x, counts, max(K, 1), cu, q, logits, bonus, sm)

        def check(out):
            assert out.shape == (B, max(K, 1) + 1)
            assert_ids(out.long(), V, pad=True, what=case.name)
    elif case.name == "hf.speculative_sampling":
        ids = torch.cat([torch.zeros(1, 2, dtype=torch.int64), make_ids(case.ids, (1, K), V).long()], 1)
        q_logits = make_logits(case.values, (1, K, V))
        p_logits = make_logits(Values(case.values.seed + 1, case.values.dtype, case.values.kind, case.values.where),
                               (1, K + 1, V))
        inputs = [ids, q_logits, p_logits]
        call = lambda: hf.speculative_sampling(ids, q_logits, K, p_logits)

        def check(out):
            tokens, n = out
            assert 0 <= int(n) <= K and tokens.shape == (1, int(n) + 1)
            assert_ids(tokens, V, pad=False, what=case.name)
    else:  # tokenspeed: B requests of N = K + 1 positions, outputs written in place
        N = K + 1
        cand = make_ids(case.ids, (B, N), V).to(torch.int32)
        predicts = torch.full((B * N,), -7, dtype=torch.int32)
        accept_index = torch.full((B, N), -7, dtype=torch.int32)
        accept_num = torch.full((B,), -7, dtype=torch.int32)  # these three are written in place
        if case.name == "tokenspeed.verify_chain_greedy":
            target = make_ids(Ids(case.ids.seed + 1, case.ids.dtype, case.ids.bad), (B, N), V).to(torch.int32)
            inputs = [cand, target]
            call = lambda: tokenspeed.verify_chain_greedy(predicts, accept_index, accept_num, cand, target, B, N)
        else:
            p = make_probs(case.values, (B, N, V))
            coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
            inputs = [cand, p, coins, final]
            call = lambda: tokenspeed.chain_speculative_sampling_target_only(predicts, accept_index, accept_num, cand,
                                                                             coins, final, p)

        def check(out):
            n = accept_num.long()
            assert bool(((n >= 0) & (n < N)).all()), f"accept_token_num {n.tolist()} outside [0, {N})"
            if case.name != "tokenspeed.verify_chain_greedy":  # the greedy one emits the target's ids as given
                emitted = predicts.view(B, N).long().gather(1, n[:, None])
                assert_ids(emitted, V, pad=False, what=case.name)

    snap = snapshot(inputs)
    try:
        out = call()
    except ValueError as err:
        assert str(err), "a ValueError without a message"
    else:
        check(out)
    assert_unchanged(snap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compat_functions_give_a_value_error_or_tokens_in_range(backend):
    fuzz("compat", backend, compat_cases(backend), _body, n=(150, 25))
