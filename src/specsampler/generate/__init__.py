"""Speculative generation with Hugging Face causal LMs: the loop, the drafters, the built-in model pair.

`loop` holds `speculative_generate` and `generate` (plain sampling, the baseline); its parts:
`drafters` (a draft model's chain or tree, prompt lookup), `layout` (tree layouts, prepared once per
shape), `draws` (the random streams, many steps at once), `cache` (a model's KV cache and attention
bias). `timing` splits a run's wall time into the models' forwards and the rest (`specsampler bench
generate`, the demo); `modelpair` is the built-in byte-level target/draft pair and its training script
(weights in `pair/`). Needs transformers (the `hf` extra) only for the models themselves.
"""

from .loop import GenerationOutput, GenerationStats, generate, speculative_generate

__all__ = ["GenerationOutput", "GenerationStats", "generate", "speculative_generate"]
