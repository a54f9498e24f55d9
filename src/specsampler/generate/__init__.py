"""Speculative generation with Hugging Face causal LMs: the loop, the drafters, the built-in model pair.

`loop` holds `speculative_generate` and `generate` (plain sampling, the baseline); `modelpair` the
built-in byte-level target/draft pair and its training script (weights in `pair/`). Needs transformers
(the `hf` extra) only for the models themselves.
"""

from .loop import GenerationOutput, GenerationStats, generate, speculative_generate

__all__ = ["GenerationOutput", "GenerationStats", "generate", "speculative_generate"]
