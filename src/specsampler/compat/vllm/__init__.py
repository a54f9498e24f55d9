"""vLLM v1's rejection sampler (``vllm/v1/sample/rejection_sampler.py``, vLLM 0.33.0) on specsampler.

``from specsampler.compat.vllm import RejectionSampler, rejection_sample`` in place of vLLM's module: the
same names, argument order, defaults, output dtypes and metadata objects (read by attribute: vLLM is not
imported), as in vLLM 0.33.0; block verification (``verify_method="block"``, from vLLM's commit
``974eaf34``) is kept as a keyword-only extension. Lossless verification is
:func:`specsampler.verify_chain_from_logits`. vLLM's layout, the method each case maps to, the randomness,
vLLM's lossy modes (``synthetic``, ``fly``), the thinking budget and the differences: docs/design.md,
"Drop-in compatibility per peer", ``compat.vllm``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from specsampler import Philox, SamplingParams, logits_to_probs, verify_chain_from_logits
from specsampler.validation import check_no_bad, check_shape, check_tensor, fail, values_checkable

from .block import _BLOCK_VERIFY_VOCAB_BLOCK as _BLOCK_VERIFY_VOCAB_BLOCK
from .block import (
    rejection_random_sample_block_verify_kernel,
    rejection_random_sample_block_verify_pytorch,
    sample_recovered_tokens_block_verify_kernel,
    sample_recovered_tokens_blockwise_pytorch,
)
from .metadata import LogitsProcessors, SamplerOutput, SamplingMetadata, SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0
# vLLM's bound on draft tokens per request and step.
MAX_SPEC_LEN = 128

__all__ = [
    "GREEDY_TEMPERATURE",
    "LogitsProcessors",
    "MAX_SPEC_LEN",
    "PLACEHOLDER_TOKEN_ID",
    "RejectionSampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SpecDecodeMetadata",
    "apply_sampling_constraints",
    "generate_uniform_probs",
    "rejection_random_sample_block_verify_kernel",
    "rejection_random_sample_block_verify_pytorch",
    "rejection_sample",
    "sample_recovered_tokens",
    "sample_recovered_tokens_block_verify_kernel",
    "sample_recovered_tokens_blockwise_pytorch",
    "unconditional_to_conditional_rates",
]


def unconditional_to_conditional_rates(rates: list[float]) -> list[float]:
    """Per-position rates P(drafts 0..i accepted) -> P(draft i accepted | drafts before it were)."""
    return [p / before if before > 0.0 else 0.0 for p, before in zip(rates, [1.0, *rates[:-1]])]


def _replace(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` for dataclasses (vLLM's metadata), a shallow copy otherwise."""
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **changes)
    out = copy.copy(obj)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


# ----------------------------------------------------------------------------- the sampler module


class RejectionSampler(nn.Module):
    """vLLM's ``RejectionSampler``: target logits in, accepted + recovered + bonus tokens out.

    Processes the target logits as vLLM 0.33.0 does (penalties, allowed-token masks, bad words,
    min-tokens processors, the thinking budget, then temperature / top-k / top-p) and verifies with
    :func:`rejection_sample` (:func:`specsampler.verify_chain_from_logits`).

    Args:
        sampler: vLLM's ``Sampler`` (or anything with its call signature and ``logprobs_mode``);
            it samples the bonus tokens, and computes logprobs when they are asked for. Its
            ``use_fp64_gumbel`` (absent: False) is passed on to :func:`rejection_sample`, as vLLM does.
        spec_config: vLLM's ``SpeculativeConfig`` (or any object with the attributes read here):
            ``rejection_sample_method`` ``"standard"`` (default), ``"synthetic"``
            (with ``synthetic_acceptance_rates``) or ``"fly"`` (with ``fly_window_size``,
            ``fly_entropy_threshold`` and ``fly_entropy_top_k``, absent: 3); ``"block"`` verifies token
            by token here, as vLLM 0.33.0's v1 sampler does (its block verification lives in its
            ModelRunnerV2). Block verification is reached by ``verify_method="block"`` (the field of
            vLLM's commit ``974eaf34``; anything else is standard). ``synthetic`` and ``fly`` are lossy
            (docs/design.md, "Drop-in compatibility per peer": ``compat.vllm``).
        device: where the synthetic rates live. FLy on a CPU device is accepted (vLLM 0.33.0 raises
            ``NotImplementedError``: its FLy kernels are Triton's).
    """

    def __init__(self, sampler: Any, spec_config: Any = None, device: torch.device | None = None):
        super().__init__()
        self.sampler = sampler
        method = getattr(spec_config, "rejection_sample_method", "standard")
        self.use_fly = method == "fly"
        self.fly_window_size: int | None = None
        self.fly_entropy_threshold: float | None = None
        self.fly_entropy_top_k = 3
        if self.use_fly:
            if spec_config.fly_window_size is None:
                fail("RejectionSampler", "spec_config.fly_window_size", "an int >= 1 with FLy", None)
            self.fly_window_size = spec_config.fly_window_size
            self.fly_entropy_threshold = spec_config.fly_entropy_threshold
            # SpeculativeConfig's default; configs written for releases before the field have none
            self.fly_entropy_top_k = getattr(spec_config, "fly_entropy_top_k", 3)
        # vLLM reads it from the sampler (an attribute of its Sampler; a Mock's answers truthy, as there)
        self.use_fp64_gumbel = getattr(sampler, "use_fp64_gumbel", False)
        logprobs_mode = sampler.logprobs_mode
        self.is_processed_logprobs_mode = logprobs_mode.startswith("processed")
        self.is_logits_logprobs_mode = logprobs_mode.endswith("logits")
        self.synthetic_conditional_rates: Tensor | None = None
        if method == "synthetic":
            rates = unconditional_to_conditional_rates(list(spec_config.synthetic_acceptance_rates))
            self.synthetic_conditional_rates = torch.tensor(rates, dtype=torch.float32, device=device)
        self.synthetic_mode = self.synthetic_conditional_rates is not None
        # A plain string (a Mock config has a Mock here: anything but "block" is standard).
        verify_method = getattr(spec_config, "verify_method", "standard")
        self.verify_method = "block" if isinstance(verify_method, str) and verify_method == "block" else "standard"

    def forward(self, metadata: Any, draft_probs: Tensor | None, logits: Tensor, sampling_metadata: Any) -> Any:
        """Verify the drafts of ``metadata`` against ``logits``.

        Args:
            metadata: ``SpecDecodeMetadata`` (vLLM's or :class:`SpecDecodeMetadata`).
            draft_probs: float ``[T, V]``: the distribution each draft was drawn from; None for
                deterministic drafts (n-gram).
            logits: float ``[T + B, V]``: the target's logits, per request its draft positions then its
                bonus position (rows ``metadata.target_logits_indices`` and ``metadata.bonus_logits_indices``).
            sampling_metadata: ``SamplingMetadata`` (vLLM's or :class:`SamplingMetadata`).
        Returns:
            ``SamplerOutput`` with ``sampled_token_ids`` int32 ``[B, max_spec_len + 1]`` (``-1``
            after each request's tokens) and logprobs when ``max_num_logprobs`` is not None.
        """
        if metadata.max_spec_len > MAX_SPEC_LEN:
            fail("RejectionSampler", "metadata.max_spec_len", f"at most {MAX_SPEC_LEN}", metadata.max_spec_len)
        # Indexing copies: neither slice aliases the caller's logits.
        bonus_logits = logits[metadata.bonus_logits_indices]
        bonus_output = self.sampler(
            logits=bonus_logits,
            sampling_metadata=_replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits",
        )
        bonus_token_ids = bonus_output.sampled_token_ids
        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits if self.is_processed_logprobs_mode else raw_target_logits.clone()
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = apply_sampling_constraints(target_logits, metadata.cu_num_draft_tokens, sampling_metadata)
        output_token_ids = rejection_sample(
            metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len, metadata.cu_num_draft_tokens,
            draft_probs, target_logits, bonus_token_ids, sampling_metadata,
            synthetic_mode=self.synthetic_mode, synthetic_conditional_rates=self.synthetic_conditional_rates,
            use_fp64_gumbel=self.use_fp64_gumbel, fly_window_size=self.fly_window_size,
            fly_entropy_threshold=self.fly_entropy_threshold, fly_entropy_top_k=self.fly_entropy_top_k,
            verify_method=self.verify_method,
        )
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_output.logprobs_tensors.logprobs, output_token_ids,
            )
        return _sampler_output_type(bonus_output)(sampled_token_ids=output_token_ids,
                                                  logprobs_tensors=logprobs_tensors)

    def _get_logprobs_tensors(self, max_num_logprobs: int, metadata: Any, logits: Tensor, target_logits: Tensor,
                              bonus_logits: Tensor, sampled_token_ids: Tensor) -> Any:
        """Logprobs of every output slot, each from its own request's rows (``parse_output`` drops placeholders).

        Slot ``[b, j]`` reads request b's draft row j for ``j < n_b``, its bonus row for ``j == n_b`` and,
        past them, a row of zeros that belongs to no request, whatever token id the slot holds (a stale
        draft id left in an engine's buffer included); placeholders and ids outside ``[0, V)`` gather
        token 0. vLLM maps slot j to flat row ``cu_num_sampled_tokens[b - 1] + j`` clamped to the last
        row, so a tail slot there reads the next request's rows.

        Args:
            metadata: ``num_draft_tokens`` (B ints) is read.
            logits: float ``[T + B, V]``: only its vocabulary size is read.
            target_logits: float ``[T, V]``: the draft rows (raw or processed, per ``logprobs_mode``).
            bonus_logits: float ``[B, V]``: the bonus rows.
            sampled_token_ids: integer ``[B, max_spec_len + 1]`` from :func:`rejection_sample`.
        Returns:
            what ``sampler.gather_logprobs`` returns for ``B * (max_spec_len + 1)`` rows, slot-major.
        """
        op = "RejectionSampler"
        B, width = sampled_token_ids.shape
        V = logits.shape[-1]
        counts = list(metadata.num_draft_tokens)
        if len(counts) != B or any(n < 0 or n >= width for n in counts) or sum(counts) != target_logits.shape[0]:
            fail(op, "metadata.num_draft_tokens", f"B = {B} counts in [0, {width - 1}] summing to the "
                 f"{target_logits.shape[0]} draft rows", counts)
        if tuple(bonus_logits.shape) != (B, V):
            fail(op, "bonus logits", f"shape [B, V] = [{B}, {V}]", list(bonus_logits.shape))
        dev = target_logits.device
        chain = _Chain.of(counts, width - 1, dev)
        rows = torch.cat([chain.pad(target_logits.float(), 0.0), target_logits.new_zeros(B, 1, V).float()], 1)
        rows[torch.arange(B, device=dev), chain.counts] = bonus_logits.to(device=dev, dtype=torch.float32)
        tokens = sampled_token_ids.to(dev).long()
        own = torch.arange(width, device=dev) <= chain.counts[:, None]
        tokens = torch.where(own & (tokens >= 0) & (tokens < V), tokens, 0).flatten()
        rows = rows.flatten(0, 1)
        logprobs = rows if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(rows)
        return self.sampler.gather_logprobs(logprobs, max_num_logprobs, tokens)

    @staticmethod
    def parse_output(output_token_ids: Tensor, vocab_size: int, discard_req_indices: Sequence[int] = (),
                     logprobs_tensors: Any = None) -> tuple[list[list[int]], Any]:
        """The valid tokens of each request (placeholders and ids ``>= vocab_size`` dropped).

        Args:
            output_token_ids: integer ``[B, max_spec_len + 1]`` from :meth:`forward`.
            vocab_size: V.
            discard_req_indices: requests whose tokens are all dropped.
            logprobs_tensors: vLLM's ``LogprobsTensors`` to filter alike (``filter``, ``tolists``).
        Returns:
            (token lists, the filtered logprobs lists or None).
        """
        ids = output_token_ids.cpu().numpy()
        valid = (ids != PLACEHOLDER_TOKEN_ID) & (ids < vocab_size)
        logprobs = None
        if logprobs_tensors is not None:
            cu = [0] + valid.sum(axis=1).cumsum().tolist()
            logprobs = logprobs_tensors.filter(valid.flatten()).tolists(cu)
        if len(discard_req_indices) > 0:
            valid[list(discard_req_indices)] = False
        return [row[valid[i]].tolist() for i, row in enumerate(ids)], logprobs

    def apply_logits_processors(self, logits: Tensor, sampling_metadata: Any, metadata: Any) -> Tensor:
        """Penalties, allowed-token masks, bad words, min-tokens processors, then the thinking budget's
        forced tokens, per draft row (vLLM 0.33.0's order).

        logits: float32 ``[T, V]``, modified in place where vLLM modifies it; returns the result.
        """
        has_penalties = not sampling_metadata.no_penalties
        output_token_ids = sampling_metadata.output_token_ids
        if sampling_metadata.bad_words_token_ids or has_penalties:
            output_token_ids = self._combine_outputs_with_spec_tokens(
                output_token_ids, getattr(sampling_metadata, "spec_token_ids", None))
        if sampling_metadata.allowed_token_ids_mask is not None or has_penalties:
            request_of_row = torch.repeat_interleave(torch.arange(len(metadata.num_draft_tokens)),
                                                     torch.tensor(metadata.num_draft_tokens, dtype=torch.int64))
            request_of_row = request_of_row.to(logits.device)
            logits = self.apply_penalties(logits, sampling_metadata, metadata, request_of_row, output_token_ids)
            if sampling_metadata.allowed_token_ids_mask is not None:
                logits.masked_fill_(sampling_metadata.allowed_token_ids_mask[request_of_row], float("-inf"))
        if sampling_metadata.bad_words_token_ids:
            _apply_bad_words_with_drafts(logits, sampling_metadata.bad_words_token_ids, output_token_ids,
                                         metadata.num_draft_tokens)
        processors = getattr(getattr(sampling_metadata, "logitsprocs", None), "non_argmax_invariant", ())
        for processor in processors:
            if hasattr(processor, "apply_with_spec_decode"):  # vLLM's min-tokens processor
                logits = processor.apply_with_spec_decode(logits, metadata.num_draft_tokens)
        holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
        if holder is not None and holder.has_tracked_requests():
            logits = _apply_thinking_budget(holder, logits, metadata.num_draft_tokens,
                                            getattr(sampling_metadata, "spec_token_ids", None))
        return logits

    @staticmethod
    def apply_penalties(logits: Tensor, sampling_metadata: Any, metadata: Any, repeat_indices: Tensor,
                        output_token_ids: list[list[int]]) -> Tensor:
        """Repetition, frequency and presence penalties (OpenAI's definitions, as vLLM), in place.

        repeat_indices: int64 ``[T]``: the request of each row; output_token_ids: ``T`` lists,
        each row's output so far (its request's output plus the drafts before it).
        """
        if sampling_metadata.no_penalties:
            return logits
        if sampling_metadata.prompt_token_ids is None:
            fail("RejectionSampler", "sampling_metadata.prompt_token_ids", "a tensor [B, L] with penalties", None)
        T, V = logits.shape
        prompt = sampling_metadata.prompt_token_ids[repeat_indices].long()
        width = max((len(o) for o in output_token_ids), default=0)
        rows = [list(o) + [V] * (width - len(o)) for o in output_token_ids]
        output = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width).to(logits.device)
        output.masked_fill_(output == -1, V)  # placeholders of async scheduling count as padding
        prompt_mask = _bin_counts(prompt, T, V) > 0
        output_counts = _bin_counts(output, T, V)
        repetition = sampling_metadata.repetition_penalties[repeat_indices].unsqueeze(1)
        penalties = torch.where(prompt_mask | (output_counts > 0), repetition, 1.0)
        logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
        logits -= sampling_metadata.frequency_penalties[repeat_indices].unsqueeze(1) * output_counts
        logits -= sampling_metadata.presence_penalties[repeat_indices].unsqueeze(1) * (output_counts > 0)
        return logits

    @staticmethod
    def _combine_outputs_with_spec_tokens(output_token_ids: list[list[int]],
                                          spec_token_ids: list[list[int]] | None = None) -> list[list[int]]:
        """One list per draft row: the request's output followed by the drafts before that row."""
        if spec_token_ids is None:
            return output_token_ids
        result = []
        for out, spec in zip(output_token_ids, spec_token_ids):
            result += [list(out) + list(spec[:i]) for i in range(len(spec))]
        return result


def _apply_thinking_budget(holder: Any, logits: Tensor, num_draft_tokens: list[int],
                           spec_token_ids: list[list[int]] | None) -> Tensor:
    """The thinking budget's forced end-of-thinking tokens on the draft rows, each request's on its own rows.

    vLLM 0.33.0 calls ``holder.apply_to_logits(logits, predict_bonus_token=False, spec_token_ids=...)`` on
    the flat draft rows; the holder finds request b's rows from the lengths of ``spec_token_ids`` and writes
    its forced token at row ``start_b + i``, ``i`` up to the request's draft count: a force at the bonus
    position (``i = n_b``, which the bonus sampler applies) lands there on the next request's first draft
    row. Here the holder gets a copy in which each request owns ``max(n_b, len(spec_token_ids[b])) + 1``
    rows (its draft rows, then scratch rows) and the layout to match; only the draft rows are copied back,
    so a request's forcing never reaches another request's rows, and one at its bonus position is dropped
    here (the bonus sampler's call applies it). One call, as in vLLM.

    Args:
        holder: ``has_tracked_requests()`` was True; ``apply_to_logits`` is called once.
        logits: float ``[T, V]``, the draft rows in vLLM's flat layout (written in place).
        num_draft_tokens: ``B`` ints summing to T.
        spec_token_ids: per request the drafts (vLLM's), or None.
    Returns:
        ``logits``, with the holder's changes to each request's own draft rows.
    """
    spec = list(spec_token_ids) if spec_token_ids is not None else []
    layout = []
    for b, n in enumerate(num_draft_tokens):
        own = list(spec[b]) if b < len(spec) else []
        layout.append(own + [PLACEHOLDER_TOKEN_ID] * (max(n, len(own)) + 1 - len(own)))
    sizes = torch.tensor([len(rows) for rows in layout], dtype=torch.int64)
    counts = torch.tensor(list(num_draft_tokens), dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    request = torch.repeat_interleave(torch.arange(len(layout)), counts)
    rows = (starts[request] + torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[request])
    rows = rows.to(logits.device)
    padded = logits.new_zeros((int(sizes.sum()), logits.shape[-1]))
    padded[rows] = logits
    padded = holder.apply_to_logits(padded, predict_bonus_token=False, spec_token_ids=layout)
    logits.copy_(padded[rows])
    return logits


def _sampler_output_type(bonus_output: Any) -> type:
    """The caller's ``SamplerOutput`` class where it has the two fields, else ours."""
    cls = type(bonus_output)
    return cls if dataclasses.is_dataclass(cls) and {"sampled_token_ids", "logprobs_tensors"} <= {
        f.name for f in dataclasses.fields(cls)} else SamplerOutput


def _bin_counts(tokens: Tensor, rows: int, vocab_size: int) -> Tensor:
    """int64 ``[rows, V]``: occurrences of each id in each row of ``tokens`` (id V = padding)."""
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.int64, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    return counts[:, :vocab_size]


def _apply_bad_words_with_drafts(logits: Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                                 past_tokens_ids: list[list[int]], num_draft_tokens: list[int]) -> None:
    """Ban, per draft row of a request with bad words, each bad word's last token where its prefix
    ends the row's past tokens (in place). Rows of request i start after the drafts of requests < i."""
    starts = np.concatenate([[0], np.cumsum(num_draft_tokens)]).tolist()
    for i, words in bad_words_token_ids.items():
        for row in range(starts[i], starts[i] + num_draft_tokens[i]):
            past = past_tokens_ids[row]
            for word in words:
                prefix = len(word) - 1
                if prefix <= len(past) and (prefix == 0 or list(past[-prefix:]) == list(word[:-1])):
                    logits[row, word[-1]] = float("-inf")


# ----------------------------------------------------------------------------- functions


def _check_cu(op: str, cu_num_draft_tokens: Tensor, num_draft_tokens: list[int]) -> None:
    """``cu_num_draft_tokens`` (integer ``[B]``) is the inclusive cumulative sum of ``num_draft_tokens``.

    Request b owns draft rows ``[cu[b - 1], cu[b])``: a wrong sum hands a request another request's rows.
    The values are compared on the CPU (free there); on a device the functions read the list alone.
    """
    check_tensor(op, "cu_num_draft_tokens", cu_num_draft_tokens, kind="int", ndim=1)
    B = len(num_draft_tokens)
    check_shape(op, "cu_num_draft_tokens", cu_num_draft_tokens, (B,), "[B] (len(num_draft_tokens))")
    if values_checkable(cu_num_draft_tokens, False):
        expected = torch.tensor(num_draft_tokens, dtype=torch.int64).cumsum(0)
        check_no_bad(op, "cu_num_draft_tokens", cu_num_draft_tokens.long() != expected, cu_num_draft_tokens,
                     f"the cumulative sums of num_draft_tokens {expected.tolist()}")



def apply_sampling_constraints(logits: Tensor, cu_num_draft_tokens: Tensor, sampling_metadata: Any) -> Tensor:
    """Temperature, then top-k, then top-p per request, on the draft rows' logits (in place).

    Args:
        logits: float ``[T, V]``.
        cu_num_draft_tokens: integer ``[B]``.
        sampling_metadata: temperature ``[B]`` (0 = greedy: those rows stay unscaled), top_k /
            top_p ``[B]`` or None.
    Returns:
        ``logits`` scaled, with the tokens outside top-k / top-p at ``-inf`` (unchanged when
        ``all_greedy``). Top-k keeps exactly k tokens (ties to the lower id, via
        :func:`specsampler.logits_to_probs`); vLLM keeps every token tied with the k-th.
    """
    if sampling_metadata.all_greedy:
        return logits
    op = "apply_sampling_constraints"
    check_tensor(op, "cu_num_draft_tokens", cu_num_draft_tokens, kind="int", ndim=1)
    T, cu = logits.shape[0], cu_num_draft_tokens.long()
    if values_checkable(cu, False):
        counts = torch.diff(cu, prepend=cu.new_zeros(1))
        check_no_bad(op, "cu_num_draft_tokens", counts < 0, cu, "non-decreasing values from 0 (cumulative counts)")
        last = int(cu[-1]) if cu.numel() else 0
        if last != T:
            fail(op, "cu_num_draft_tokens", f"a last value of T = {T} (rows of logits)", last)
    # row t belongs to the first request whose range ends after t (a clamp keeps bad ranges on a device in range)
    request = torch.searchsorted(cu.to(logits.device), torch.arange(T, device=logits.device), right=True)
    request = request.clamp_(max=max(cu.numel() - 1, 0))
    expand = lambda x: x.to(logits.device)[request]
    temperature = expand(sampling_metadata.temperature)
    temperature = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    logits.div_(temperature.unsqueeze(-1).to(logits.dtype))
    top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
    if top_k is None and top_p is None:
        return logits
    params = SamplingParams(top_k=expand(top_k) if top_k is not None else 0,
                            top_p=expand(top_p).float() if top_p is not None else 1.0)
    kept = logits_to_probs(logits, params) > 0
    return logits.masked_fill_(~kept, float("-inf"))


def generate_uniform_probs(num_tokens: int, num_draft_tokens: list[int], generators: dict[int, torch.Generator],
                           device: torch.device | str) -> Tensor:
    """vLLM's acceptance uniforms: float64 ``[num_tokens]`` in [0, 1), exactly its draws.

    All from the global generator, then each seeded request (with drafts) redraws its slice from its
    own generator. Used by the lossy modes; lossless verification draws from Philox streams.
    """
    u = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    start = 0
    for i, n in enumerate(num_draft_tokens):
        if n == 0:  # no draw for a request without drafts: it keeps its generator's state
            continue
        generator = generators.get(i)
        if generator is not None:
            u[start:start + n].uniform_(generator=generator)
        start += n
    return u


def sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int], cu_num_draft_tokens: Tensor,
                            draft_token_ids: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                            sampling_metadata: Any, device: torch.device | str,
                            use_fp64_gumbel: bool = False) -> Tensor:
    """A draw from each draft position's residual ``max(p - q, 0)`` (``q`` one-hot at the draft
    when ``draft_probs`` is None), exactly vLLM's: ``argmax(residual / e)`` with ``e ~ Exp(1)`` per
    request and token (an exponential race, i.e. a categorical draw from the normalised residual),
    ``e`` from the request's generator when seeded. A residual of all zeros gives token 0.

    Args:
        max_spec_len: K; num_draft_tokens: ``B`` ints; cu_num_draft_tokens: integer ``[B]``.
        draft_token_ids: integer ``[T]`` (or ``[T, 1]``); draft_probs: float ``[T, V]`` or None;
        target_probs: float ``[T, V]``.
        sampling_metadata: its ``generators`` are read.
        device: where the exponentials are drawn.
        use_fp64_gumbel: draw the exponentials in float64.
    Returns:
        ``draft_token_ids``'s shape and dtype, ids in ``[0, V)``.
    """
    op = "sample_recovered_tokens"
    B, V = len(num_draft_tokens), target_probs.shape[-1]
    T = draft_token_ids.shape[0]
    if any(n < 0 for n in num_draft_tokens) or sum(num_draft_tokens) != T:
        fail(op, "num_draft_tokens", f"B counts >= 0 summing to T = {T} (rows of draft_token_ids)", num_draft_tokens)
    _check_cu(op, cu_num_draft_tokens, num_draft_tokens)
    e = torch.empty((B, V), dtype=torch.float64 if use_fp64_gumbel else torch.float32, device=device)
    e.exponential_()
    for i, generator in sampling_metadata.generators.items():
        if num_draft_tokens[i] > 0:
            e[i].exponential_(generator=generator)
    inv_e = e.reciprocal()
    if draft_probs is None:
        residual = target_probs.clone()
        x = draft_token_ids.reshape(-1).long()
        rows = torch.nonzero((x >= 0) & (x < V))[:, 0]
        residual[rows, x[rows]] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min_(0.0)
    request = torch.repeat_interleave(torch.arange(B, device=residual.device),
                                      torch.tensor(num_draft_tokens, device=residual.device),
                                      output_size=draft_token_ids.shape[0])
    recovered = (residual * inv_e[request]).argmax(-1)
    return recovered.to(draft_token_ids.dtype).reshape(draft_token_ids.shape)


def rejection_sample(
    draft_token_ids: Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_logits: Tensor,
    bonus_token_ids: Tensor,
    sampling_metadata: Any,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: Tensor | None = None,
    use_fp64_gumbel: bool = False,
    fly_window_size: int | None = None,
    fly_entropy_threshold: float | None = None,
    fly_entropy_top_k: int = 3,
    *,
    verify_method: str = "standard",
) -> Tensor:
    """Verify each request's drafts; maps onto :func:`specsampler.verify_chain_from_logits`.

    vLLM 0.33.0's parameters in its order; ``verify_method`` (block verification, vLLM's commit
    ``974eaf34``, where it was the 11th parameter) is keyword-only after them.

    Args:
        draft_token_ids: integer ``[T]``: the drafts of all requests, concatenated.
        num_draft_tokens: ``B`` ints, each ``<= max_spec_len``, summing to T.
        max_spec_len: K, the width of the output minus one.
        cu_num_draft_tokens: integer ``[B]``: inclusive cumulative sums of ``num_draft_tokens``.
        draft_probs: float ``[T, V]`` or None (deterministic drafts).
        target_logits: float ``[T, V]``: the target's processed logits (temperature, top-k, top-p
            applied; greedy rows unscaled) at each draft position.
        bonus_token_ids: integer ``[B, 1]`` (or ``[B]``): emitted when all of a request's drafts are accepted.
        sampling_metadata: ``all_greedy``, ``all_random``, ``temperature [B]`` (0 = greedy), ``generators``.
        synthetic_mode, synthetic_conditional_rates: vLLM's synthetic acceptance (lossy): draft i
            is accepted iff ``u_i < rates[i]``, float32 ``[>= K]``.
        use_fp64_gumbel: the exponentials of :func:`sample_recovered_tokens` in float64, as vLLM; they
            are drawn by the lossy modes, which use vLLM's draws (the lossless path draws by inversion
            from Philox streams and has none). A string here (the older call's ``verify_method`` in
            this position) raises ``ValueError``.
        fly_window_size, fly_entropy_threshold, fly_entropy_top_k: FLy's deferral (lossy), off when the
            window is None; with a window the threshold must be given (None is vLLM's "unset": its
            assertion, a ``ValueError`` here) and the entropy is over the ``fly_entropy_top_k`` largest
            target probabilities (vLLM's ``ValueError("fly_entropy_top_k must be greater than zero")``
            below 1). FLy with ``synthetic_mode`` raises vLLM's
            ``ValueError("FLy is incompatible with synthetic rejection sampling")``.
        verify_method: keyword only: ``"standard"`` (token rejection sampling) or ``"block"`` (block
            verification, for sampled drafts when ``max_spec_len >= 3``).
    Returns:
        int32 ``[B, max_spec_len + 1]``: accepted drafts, then the recovered or bonus token, then -1.
    """
    op = "rejection_sample"
    B, K = len(num_draft_tokens), int(max_spec_len)
    check_tensor(op, "draft_token_ids", draft_token_ids, kind="int", ndim=1)
    check_tensor(op, "target_logits", target_logits, kind="float", ndim=2)
    T, V = target_logits.shape
    check_shape(op, "draft_token_ids", draft_token_ids, (T,), "[T] (rows of target_logits)")
    if draft_probs is not None:
        check_tensor(op, "draft_probs", draft_probs, kind="float", ndim=2)
        check_shape(op, "draft_probs", draft_probs, (T, V), "[T, V]")
    check_tensor(op, "bonus_token_ids", bonus_token_ids, kind="int", ndim=(1, 2))
    if bonus_token_ids.numel() != B:
        fail(op, "bonus_token_ids", f"B = {B} tokens ([B, 1])", list(bonus_token_ids.shape))
    if sum(num_draft_tokens) != T or any(n < 0 or n > K for n in num_draft_tokens):
        fail(op, "num_draft_tokens", f"B counts in [0, max_spec_len = {K}] summing to T = {T}", num_draft_tokens)
    _check_cu(op, cu_num_draft_tokens, num_draft_tokens)
    if verify_method not in ("standard", "block"):
        fail(op, "verify_method", "'standard' or 'block'", repr(verify_method))
    if isinstance(use_fp64_gumbel, str):
        fail(op, "use_fp64_gumbel", "a bool (the 11th argument since vLLM 0.33.0; pass verify_method= by keyword)",
             repr(use_fp64_gumbel))
    if fly_window_size is not None:
        if fly_entropy_threshold is None:
            fail(op, "fly_entropy_threshold", "a float with fly_window_size set", None)
        if synthetic_mode:
            raise ValueError("FLy is incompatible with synthetic rejection sampling")
        if fly_entropy_top_k <= 0:
            raise ValueError("fly_entropy_top_k must be greater than zero")
        if V == 0:
            raise ValueError("FLy requires a non-empty target vocabulary")
    dev = target_logits.device
    chain = _Chain.of(num_draft_tokens, K, dev)
    bonus = bonus_token_ids.reshape(B).to(device=dev, dtype=torch.int64)
    greedy = _greedy_rows(sampling_metadata, B, dev)
    if synthetic_mode or fly_window_size is not None:
        rates = synthetic_conditional_rates if synthetic_mode else None
        fly = None if fly_window_size is None else (int(fly_window_size), float(fly_entropy_threshold),
                                                    int(fly_entropy_top_k))
        return _rejection_sample_lossy(chain, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                       target_logits, bonus, greedy, sampling_metadata, rates, fly, use_fp64_gumbel)
    n = chain.counts
    x = chain.pad(draft_token_ids.long(), 0)
    q = chain.pad(draft_probs.float(), 0.0) if draft_probs is not None else None
    logits = torch.cat([chain.pad(target_logits, 0.0), target_logits.new_zeros(B, 1, V)], 1)
    if sampling_metadata.all_greedy:
        method, params = "greedy", None
    else:
        method = "target_only" if q is None else ("block" if verify_method == "block" and K >= 3 else "token")
        params = None if sampling_metadata.all_random else SamplingParams(temperature=torch.where(greedy, 0.0, 1.0))
    rng = Philox(_request_seeds(num_draft_tokens, sampling_metadata.generators, dev))
    res = verify_chain_from_logits(logits, x, params, draft_probs=q, num_drafts=n, method=method, rng=rng)
    # The bonus position holds the caller's bonus token, not the one drawn from the padding row.
    tokens = res.tokens.scatter(1, n[:, None], torch.where(res.num_accepted == n, bonus,
                                                           res.tokens.gather(1, n[:, None])[:, 0])[:, None])
    return tokens.to(torch.int32)


@dataclass(frozen=True)
class _Chain:
    """Where each flattened draft row sits in the padded ``[B, K]`` layout."""

    B: int
    K: int
    counts: Tensor  # int64 [B]
    request: Tensor  # int64 [T]
    position: Tensor  # int64 [T]

    @staticmethod
    def of(num_draft_tokens: list[int], K: int, device: torch.device) -> _Chain:
        counts = torch.tensor(num_draft_tokens, dtype=torch.int64)
        request = torch.repeat_interleave(torch.arange(len(num_draft_tokens)), counts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(int(counts.sum())) - starts[request]
        return _Chain(len(num_draft_tokens), max(K, 0), counts.to(device), request.to(device), position.to(device))

    def pad(self, rows: Tensor, fill: float | int) -> Tensor:
        """``[T, ...]`` -> ``[B, K, ...]``, ``fill`` past each request's drafts."""
        out = rows.new_full((self.B, self.K, *rows.shape[1:]), fill)
        out[self.request, self.position] = rows
        return out


def _greedy_rows(sampling_metadata: Any, B: int, device: torch.device) -> Tensor:
    """bool ``[B]``: the greedy requests."""
    if sampling_metadata.all_greedy:
        return torch.ones(B, dtype=torch.bool, device=device)
    if sampling_metadata.all_random:
        return torch.zeros(B, dtype=torch.bool, device=device)
    return (sampling_metadata.temperature == GREEDY_TEMPERATURE).to(device)


def _request_seeds(num_draft_tokens: list[int], generators: dict[int, torch.Generator], device: torch.device) -> Tensor:
    """int64 ``[B]``: each request's Philox key, from its own generator where it has one."""
    seeds = torch.randint(0, 2**62, (len(num_draft_tokens),), dtype=torch.int64, device=device)
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            seeds[i] = torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=generator,
                                     device=generator.device).to(device)[0]
    return seeds


# ----------------------------------------------------------------------------- lossy modes


def _fly_entropy(probs: Tensor, k: int) -> Tensor:
    """FLy's uncertainty: entropy of the ``k`` largest probabilities of each row (``k >= 1``)."""
    top = torch.topk(probs.float(), min(k, probs.shape[-1]), dim=-1).values
    return -torch.where(top > 0, top * top.log(), 0.0).sum(-1)


def _next_all(ok: Tensor, window: int) -> Tensor:
    """bool ``[B, K]``: ``ok`` holds at each of the next ``window`` positions (inside ``[B, K]``)."""
    B, K = ok.shape
    run = torch.cat([ok.long(), ok.new_zeros(B, window + 1, dtype=torch.long)], 1).cumsum(1)
    before = torch.cat([ok.new_zeros(B, 1, dtype=torch.long), run], 1)
    pos = torch.arange(K, device=ok.device)
    return (before[:, pos + window + 1] - before[:, pos + 1]) == window


def _rejection_sample_lossy(chain: _Chain, num_draft_tokens: list[int], cu_num_draft_tokens: Tensor,
                            draft_token_ids: Tensor, draft_probs: Tensor | None, target_logits: Tensor,
                            bonus: Tensor, greedy: Tensor, sampling_metadata: Any, rates: Tensor | None,
                            fly: tuple[int, float, int] | None, use_fp64_gumbel: bool) -> Tensor:
    """vLLM's synthetic and FLy modes (lossy), with its uniforms and recovered tokens.

    fly: FLy's ``(window, entropy threshold, entropy top-k)``, or None.

    Per draft position an acceptance and a replacement token (greedy requests: the target argmax;
    sampled ones: :func:`sample_recovered_tokens`); each request emits its accepted prefix, then
    the replacement at the first rejection, or its bonus token. Sampled requests accept by
    vLLM's rule ``q(x) > 0 and p(x) / q(x) >= u`` (``q = 1`` without draft_probs).
    """
    B, K, dev = chain.B, chain.K, target_logits.device
    T, V = target_logits.shape
    n, pos = chain.counts, torch.arange(K, device=dev)
    x = draft_token_ids.long()
    valid = (x >= 0) & (x < V)
    at_draft = lambda rows: rows.gather(1, x.clamp(0, V - 1)[:, None])[:, 0]
    sampled_row = ~greedy[chain.request]
    replacement = target_logits.argmax(-1)
    probs = target_logits.softmax(-1, dtype=torch.float32)
    p_x = torch.where(valid, at_draft(probs), 0.0).double()
    q_x = at_draft(draft_probs).double() if draft_probs is not None else torch.ones_like(p_x)
    u = None
    if rates is not None or not sampling_metadata.all_greedy:
        u = generate_uniform_probs(T, num_draft_tokens, sampling_metadata.generators, dev)
    if not sampling_metadata.all_greedy:
        recovered = sample_recovered_tokens(K, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                            probs, sampling_metadata, dev, use_fp64_gumbel)
        replacement = torch.where(sampled_row, recovered.long(), replacement)
    if rates is not None:
        accept = u < rates[chain.position].double()
    else:
        accept = x == replacement
        if u is not None:
            accept = torch.where(sampled_row, valid & (q_x > 0) & (p_x / q_x >= u), accept)
    if fly is not None:
        fly_window, fly_threshold, fly_top_k = fly
        reachable = torch.where(sampled_row, (q_x > 0) & (p_x > 0), at_draft(target_logits) > float("-inf"))
        deferrable = valid & ~accept & reachable & (_fly_entropy(probs, fly_top_k) >= fly_threshold)
        later = _next_all(chain.pad(accept, False), fly_window) & ((pos + fly_window) < n[:, None])
        accept = accept | (deferrable & later[chain.request, chain.position])
    run = chain.pad(accept, False).long().cumprod(1).sum(1)  # accepted drafts per request
    if K:
        stop = chain.pad(replacement, PLACEHOLDER_TOKEN_ID).gather(1, run.clamp(max=K - 1)[:, None])[:, 0]
        bonus = torch.where(run < n, stop, bonus)
    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=dev)
    out[:, :K] = torch.where(pos < run[:, None], chain.pad(x, PLACEHOLDER_TOKEN_ID), PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, run[:, None], bonus[:, None])
    return out.to(torch.int32)
