"""Drop-in for FlashInfer's sampling API: ``import specsampler.compat.flashinfer as flashinfer``.

The functions are those of ``flashinfer.sampling`` (also importable as
``specsampler.compat.flashinfer.sampling``, like ``flashinfer.sampling``), with FlashInfer's
signatures, defaults, dtypes and error messages, running on specsampler's ops (and its Triton
kernels on CUDA tensors). Differences from FlashInfer: :mod:`specsampler.compat.flashinfer.sampling`.
"""

from . import sampling
from .sampling import (
    chain_speculative_sampling,
    min_p_sampling_from_probs,
    sampling_from_logits,
    sampling_from_probs,
    softmax,
    top_k_mask_logits,
    top_k_renorm_prob,
    top_k_renorm_probs,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_prob,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)

__all__ = [
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sampling",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "top_k_mask_logits",
    "top_k_renorm_prob",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_prob",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]
