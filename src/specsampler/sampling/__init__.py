"""Sampling: logits -> filtered probabilities (temperature, top-k, top-p, min-p, masks) and draws.

`ops` holds the public functions; `processing` routes rows to `filters`, `topk` (ordered prefixes) and
`nucleus` (top-p without sorting the vocabulary), into `distributions` (parts, draws by inversion);
`rounding` keeps sums batch-invariant; `greedy` is the argmax rule. Algorithms: docs/design.md, "Sampling"
and "Processing without sorting the vocabulary".
"""

from .ops import SampleOutput, logits_to_probs, min_p_renorm, sample, sample_from_logits, top_k_renorm, top_p_renorm

__all__ = ["SampleOutput", "logits_to_probs", "min_p_renorm", "sample", "sample_from_logits", "top_k_renorm",
           "top_p_renorm"]
