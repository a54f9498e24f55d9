"""specsampler: token sampling and lossless speculative-decoding verification on PyTorch.

The public API is the contract of DESIGN.md; every name below is documented with its
shapes and dtypes.
"""

from .chain import ChainResult, verify_chain, verify_chain_from_logits
from .params import SamplingParams
from .rng import Philox
from .sampling import (
    SampleOutput,
    logits_to_probs,
    min_p_renorm,
    sample,
    sample_from_logits,
    top_k_renorm,
    top_p_renorm,
)
from .tree import TokenTree
from .validation import ValidationError

__all__ = [
    "ChainResult",
    "Philox",
    "SampleOutput",
    "SamplingParams",
    "TokenTree",
    "ValidationError",
    "logits_to_probs",
    "min_p_renorm",
    "sample",
    "sample_from_logits",
    "top_k_renorm",
    "top_p_renorm",
    "verify_chain",
    "verify_chain_from_logits",
]
__version__ = "0.1.0"
