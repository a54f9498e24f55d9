"""Stand-ins for the metadata objects vLLM passes its rejection sampler (same fields): for callers and tests
without vLLM installed. The sampler reads them by attribute, so vLLM's own objects work as well."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass
class SpecDecodeMetadata:
    """Stand-in for vLLM's ``vllm.v1.spec_decode.metadata.SpecDecodeMetadata`` (same fields).

    draft_token_ids: int32 ``[T]``; num_draft_tokens: ``B`` ints; cu_num_draft_tokens,
    cu_num_sampled_tokens: int32 ``[B]`` (inclusive cumulative sums of drafts, and of drafts + 1);
    target_logits_indices ``[T]``, bonus_logits_indices ``[B]``: rows of the target's logits;
    logits_indices ``[T + B]``. ``max_spec_len`` = the longest chain.
    """

    draft_token_ids: Tensor
    num_draft_tokens: list[int]
    cu_num_draft_tokens: Tensor
    cu_num_sampled_tokens: Tensor
    target_logits_indices: Tensor
    bonus_logits_indices: Tensor
    logits_indices: Tensor

    def __post_init__(self):
        self.max_spec_len = max(self.num_draft_tokens, default=0)

    @classmethod
    def make_dummy(cls, draft_token_ids: list[list[int]], device: torch.device | str) -> SpecDecodeMetadata:
        """Metadata for the given drafts of each request (logits indices all 0, as vLLM's)."""
        n = [len(ids) for ids in draft_token_ids]
        B, T = len(n), sum(n)
        as_int32 = lambda values: torch.from_numpy(np.asarray(values, dtype=np.int32)).to(device)
        return cls(
            draft_token_ids=torch.tensor(sum(draft_token_ids, []), dtype=torch.int32, device=device),
            num_draft_tokens=n,
            cu_num_draft_tokens=as_int32(np.cumsum(n, dtype=np.int32)),
            cu_num_sampled_tokens=as_int32(np.cumsum([k + 1 for k in n], dtype=np.int32)),
            target_logits_indices=torch.zeros(T, dtype=torch.int32, device=device),
            bonus_logits_indices=torch.zeros(B, dtype=torch.int32, device=device),
            logits_indices=torch.zeros(T + B, dtype=torch.int32, device=device),
        )


class LogitsProcessors:
    """Stand-in for vLLM's ``LogitsProcessors`` container: no processors."""

    all: tuple = ()
    argmax_invariant: tuple = ()
    non_argmax_invariant: tuple = ()


@dataclass
class SamplingMetadata:
    """Stand-in for vLLM's ``vllm.v1.sample.metadata.SamplingMetadata`` (the fields the rejection
    sampler reads; vLLM's object works as well).

    The fields of vLLM 0.33.0's, in its order. temperature: float ``[B]`` (``0`` = greedy) or None when
    ``all_greedy``; top_p / top_k ``[B]`` or None; generators: request index -> ``torch.Generator``;
    max_num_logprobs: None = no logprobs; penalties ``[B]`` with ``prompt_token_ids [B, L]`` padded with V;
    output_token_ids and spec_token_ids: per request lists (spec_token_ids None: no drafts to combine with
    the outputs, as vLLM); allowed_token_ids_mask: bool ``[B, V]``, True = disallowed; bad_words_token_ids:
    request index -> banned token sequences; logprob_token_ids: request index -> token ids to return
    logprobs for (read by vLLM's ``Sampler``, not by the rejection sampler); thinking_budget_state_holder:
    vLLM's ``ThinkingBudgetStateHolder`` (or anything with its ``has_tracked_requests()`` and
    ``apply_to_logits(logits, predict_bonus_token, spec_token_ids)``), applied to the draft rows last.
    """

    temperature: Tensor | None = None
    all_greedy: bool = True
    all_random: bool = False
    top_p: Tensor | None = None
    top_k: Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    prompt_token_ids: Tensor | None = None
    frequency_penalties: Tensor | None = None
    presence_penalties: Tensor | None = None
    repetition_penalties: Tensor | None = None
    output_token_ids: list[list[int]] = field(default_factory=list)
    allowed_token_ids_mask: Tensor | None = None
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    logitsprocs: Any = field(default_factory=LogitsProcessors)
    logprob_token_ids: dict[int, list[int]] | None = None
    spec_token_ids: list[list[int]] | None = None
    thinking_budget_state_holder: Any = None


@dataclass
class SamplerOutput:
    """Stand-in for vLLM's ``SamplerOutput``: sampled_token_ids int32 ``[B, max_spec_len + 1]``."""

    sampled_token_ids: Tensor
    logprobs_tensors: Any = None
