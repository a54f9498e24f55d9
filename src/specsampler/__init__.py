"""specsampler: token sampling and lossless speculative-decoding verification on PyTorch.

The public API is the contract of DESIGN.md; every name below is documented with its
shapes and dtypes.
"""

from . import longspec, mlc, oracle
from .chain import ChainResult, verify_chain, verify_chain_from_logits
from .kv import compact_kv
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
from .treeverify import TreeResult, verify_tree, verify_tree_from_logits
from .validation import ValidationError

__all__ = [
    "ChainResult",
    "longspec",
    "mlc",
    "oracle",
    "Philox",
    "SampleOutput",
    "SamplingParams",
    "TokenTree",
    "TreeResult",
    "ValidationError",
    "compact_kv",
    "logits_to_probs",
    "min_p_renorm",
    "sample",
    "sample_from_logits",
    "top_k_renorm",
    "top_p_renorm",
    "verify_chain",
    "verify_chain_from_logits",
    "verify_tree",
    "verify_tree_from_logits",
]
__version__ = "0.1.0"
