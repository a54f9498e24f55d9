"""MLC-LLM's ``SampleResult``: a sampled token with its probability and the most likely tokens, and its
logprobs in OpenAI's JSON layout."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

_MIN_PROB = 1e-10  # MLC: logprob = log(max(prob, 1e-10))


def _token_string(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return str(token_id)
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return str(tokenizer.convert_ids_to_tokens(token_id))
    return str(tokenizer.decode([token_id]))


def _logprob_entry(tokenizer, token_id: int, prob: float) -> dict:
    text = _token_string(tokenizer, token_id)
    logprob = math.log(prob if prob > _MIN_PROB else _MIN_PROB)  # NaN too becomes 1e-10
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


@dataclass
class SampleResult:
    """A sampled token (MLC's ``SampleResult``).

    sampled_token_id: ``(token id, probability)``: the token and its probability in the row it
        was drawn from (each :class:`Sampler` method says which row).
    top_prob_tokens: ``[(token id, probability), ...]``: the ``top_logprobs`` most likely tokens
        of that row, most likely first (ties: lower id first); empty unless the request's
        config has ``logprobs``.
    """

    sampled_token_id: tuple[int, float]
    top_prob_tokens: list[tuple[int, float]] = field(default_factory=list)

    def get_token_id(self) -> int:
        """The sampled token id."""
        return self.sampled_token_id[0]

    def get_logprob_json(self, tokenizer=None, logprob: bool = True) -> str:
        """The token's logprobs as a JSON object in OpenAI's layout, or ``""`` when ``logprob`` is False.

        Whether logprobs are on is the caller's to say, as in MLC's ``GetLogProbJSON(tokenizer,
        logprob)``: pass the request's ``GenerationConfig.logprobs``.

        Returns ``{"token": str, "logprob": float, "bytes": [int, ...], "top_logprobs": [{"token",
        "logprob", "bytes"}, ...]}`` (``top_logprobs`` from :attr:`top_prob_tokens`, in order), with
        ``logprob = log(max(prob, 1e-10))`` and ``bytes`` the UTF-8 bytes of the token string.
        The token string is ``str(token_id)`` without a tokenizer, else
        ``tokenizer.convert_ids_to_tokens(token_id)`` if it has that method, else
        ``tokenizer.decode([token_id])``.
        """
        if not logprob:
            return ""
        top = [_logprob_entry(tokenizer, t, p) for t, p in self.top_prob_tokens]
        return json.dumps({**_logprob_entry(tokenizer, *self.sampled_token_id), "top_logprobs": top})

