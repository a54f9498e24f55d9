"""MLC-LLM's ``SpecDecodeMetrics``: acceptance statistics of speculative decoding, in MLC's JSON layout."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..validation import fail
from .checks import _is_int


@dataclass
class SpecDecodeMetrics:
    """Acceptance statistics of speculative decoding (MLC's ``SpecDecodeMetrics``).

    draft_count[j]: verification steps that had a token at position j; accept_count[j]: steps
    that accepted position j. Positions count the draft tokens and the base model's own last
    prediction (the correction or bonus token), so position 0 is always accepted.
    """

    draft_count: list[int] = field(default_factory=list)
    accept_count: list[int] = field(default_factory=list)

    def update(self, draft_length: int, accept_length: int) -> None:
        """Count one verification step.

        draft_length: the tokens of the step, drafts plus the base model's last prediction.
        accept_length: the tokens it emitted (accepted drafts plus one), in ``[1, draft_length]``.
        Raises ``ValueError`` (:class:`~specsampler.ValidationError`) otherwise.
        """
        op = "SpecDecodeMetrics.update"
        if not _is_int(accept_length) or accept_length < 1:
            fail(op, "accept_length", "an int >= 1", repr(accept_length))
        if not _is_int(draft_length) or draft_length < accept_length:
            fail(op, "draft_length", f"an int >= accept_length = {accept_length}", repr(draft_length))
        grow = draft_length - len(self.draft_count)
        if grow > 0:
            self.draft_count += [0] * grow
            self.accept_count += [0] * grow
        for j in range(draft_length):
            self.draft_count[j] += 1
            if j < accept_length:
                self.accept_count[j] += 1

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not self.draft_count

    def reset(self) -> None:
        """Forget all counts."""
        self.draft_count.clear()
        self.accept_count.clear()

    def as_json(self) -> dict:
        """The metrics in MLC's layout (Prometheus-style labels).

        ``{"draft_count": [...], "accept_count": [...], "accept_prob": {"accept_prob{step=i}":
        accept_count[i] / draft_count[i]}, "accept_rate": {"accept_rate{step=i}": accept_count[i] /
        accept_count[i-1] for i >= 1 (0.0 when accept_count[i-1] == 0)}, "accept_len":
        {"accept_len{step=i}": the sum of accept_prob over steps 0..i}}``.
        """
        accept_prob, accept_rate, accept_len = {}, {}, {}
        total = 0.0
        for i, (drafted, accepted) in enumerate(zip(self.draft_count, self.accept_count)):
            prob = accepted / drafted
            total += prob
            accept_prob[f"accept_prob{{step={i}}}"] = prob
            accept_len[f"accept_len{{step={i}}}"] = total
            if i:
                before = self.accept_count[i - 1]
                accept_rate[f"accept_rate{{step={i}}}"] = accepted / before if before else 0.0
        return {"draft_count": list(self.draft_count), "accept_count": list(self.accept_count),
                "accept_prob": accept_prob, "accept_rate": accept_rate, "accept_len": accept_len}

