"""MLC-LLM's per-request inputs of the Sampler: :class:`GenerationConfig` (its fields, plus ``top_k`` and
``min_p``) and :class:`RandomGenerator` (a seed and a step offset: a :class:`~specsampler.Philox` stream)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from ..validation import fail
from .checks import _is_int, _is_real

_GREEDY_TEMPERATURE = 1e-5  # MLC: a temperature below this samples the argmax
_MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def _is_greedy(cfg: GenerationConfig) -> bool:
    return cfg.temperature < _GREEDY_TEMPERATURE


@dataclass(frozen=True)
class GenerationConfig:
    """A request's generation configuration: MLC-LLM's fields, plus ``top_k`` and ``min_p``.

    The :class:`Sampler` reads ``temperature`` (only to tell greedy requests apart: below
    ``1e-5`` it samples the argmax, as MLC does), ``top_k``, ``top_p``, ``min_p``, ``logprobs``
    and ``top_logprobs``. Temperature scaling itself, the penalties and ``logit_bias`` are
    applied to the logits by MLC's LogitProcessor *before* the sampler, which takes
    probabilities: the sampler does not apply them, and this library has no logit processor.
    ``n``, ``seed``, ``max_tokens`` and ``stop_token_ids`` are the engine's (a
    :class:`RandomGenerator` is made from ``seed``).

    Args:
        n: completions per prompt, ``>= 1``.
        temperature: ``>= 0``; below ``1e-5`` greedy (argmax, ties to the lower id).
        top_p: in ``(0, 1]``; ``1`` is off.
        top_k: keep the k most likely tokens; ``<= 0`` is off.
        min_p: in ``[0, 1]``; keep the tokens with probability ``>= min_p * max probability``.
        frequency_penalty, presence_penalty: in ``[-2, 2]`` (OpenAI's range).
        repetition_penalty: ``> 0``; ``1`` is off.
        logprobs: return log-probabilities (:meth:`SampleResult.get_logprob_json`).
        top_logprobs: in ``[0, 20]``: how many of the most likely tokens to return at each
            position; ``> 0`` requires ``logprobs`` (as OpenAI).
        logit_bias: ``None`` or ``{token id >= 0: bias in [-100, 100]}``.
        seed: ``None`` or an int.
        max_tokens: ``None`` (no limit) or an int ``>= 1``.
        stop_token_ids: token ids ``>= 0``, any sequence (stored as a tuple).

    Raises :class:`~specsampler.ValidationError` naming the field when a value is out of range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        def check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                fail("GenerationConfig", f"GenerationConfig.{name}", expected, repr(getattr(self, name)))

        check("n", _is_int(self.n) and self.n >= 1, "an int >= 1")
        check("temperature", _is_real(self.temperature) and self.temperature >= 0, "a finite number >= 0")
        check("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]")
        check("top_k", _is_int(self.top_k), "an int (<= 0: off)")
        check("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            check(name, _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]")
        check("repetition_penalty", _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
              "a finite number > 0")
        check("logprobs", isinstance(self.logprobs, bool), "a bool")
        check("top_logprobs", _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS,
              f"an int in [0, {_MAX_TOP_LOGPROBS}]")
        check("top_logprobs", self.logprobs or self.top_logprobs == 0, "0 unless logprobs is True")
        bias = self.logit_bias
        check("logit_bias", bias is None or (isinstance(bias, dict) and all(
            _is_int(k) and k >= 0 and _is_real(v) and -100 <= v <= 100 for k, v in bias.items())),
            "None or a dict {token id >= 0: bias in [-100, 100]}")
        check("seed", self.seed is None or _is_int(self.seed), "None or an int")
        check("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "None or an int >= 1")
        stop = self.stop_token_ids
        check("stop_token_ids", isinstance(stop, Sequence) and not isinstance(stop, str)
              and all(_is_int(t) and t >= 0 for t in stop), "a sequence of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))


class RandomGenerator:
    """A request's random stream: the :class:`~specsampler.Philox` stream ``(seed, offset)``.

    One per request. Each :class:`Sampler` call that draws for a request reads its generator's
    stream at ``offset`` and then advances ``offset`` by 1; a generator that serves k samples of
    one call reads offsets ``offset, ..., offset + k - 1`` in sample order and advances by k.
    So consecutive calls draw new numbers, and a new generator with the same seed replays the
    same draws, whatever the rest of the batch.

    Args:
        seed: an int (its value modulo 2**64, as two's complement int64, is the Philox key), or
            None for a random 63-bit seed from :mod:`secrets`.
    Attributes:
        seed: int, as given (or drawn).
        offset: int, the step counter; starts at 0.
    """

    def __init__(self, seed: int | None = None):
        if seed is None:
            seed = secrets.randbits(63)
        elif not _is_int(seed):
            fail("RandomGenerator", "seed", "None or an int", repr(seed))
        self.seed = int(seed)
        self.offset = 0

    def __repr__(self) -> str:
        return f"RandomGenerator(seed={self.seed}, offset={self.offset})"

