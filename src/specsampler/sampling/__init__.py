"""Sampling: logits -> filtered probabilities (temperature, top-k, top-p, min-p, masks) and draws.

`ops` holds the public functions; `processing` how rows are filtered without sorting the vocabulary
(top-k from chunk maxima, the nucleus search, draws by inversion, the CPU rounding helpers).
Algorithms: ARCHITECTURE.md, "Sampling".
"""

from .ops import SampleOutput, logits_to_probs, min_p_renorm, sample, sample_from_logits, top_k_renorm, top_p_renorm

__all__ = ["SampleOutput", "logits_to_probs", "min_p_renorm", "sample", "sample_from_logits", "top_k_renorm",
           "top_p_renorm"]
