"""specsampler: token sampling and lossless speculative-decoding verification on PyTorch.

The public API is the contract of docs/design.md ("Public API"); every name below is documented with its shapes and
dtypes. ``import specsampler`` loads the core (sampling, verification, the kernels' dispatch);
``mlc``, ``longspec``, ``oracle``, ``generate``, ``compat`` and ``parallel`` load when first used.
Where things live: ARCHITECTURE.md.
"""

import importlib as _importlib

from . import _legacy
from .kernels.warmup import warmup
from .params import SamplingParams
from .rng import Philox, Uniforms
from .sampling import (
    SampleOutput,
    logits_to_probs,
    min_p_renorm,
    sample,
    sample_from_logits,
    top_k_renorm,
    top_p_renorm,
)
from .validation import ValidationError
from .verify import (
    ChainResult,
    TokenTree,
    TreeResult,
    compact_kv,
    verify_chain,
    verify_chain_from_logits,
    verify_tree,
    verify_tree_from_logits,
)

_legacy.install()

_LAZY = {"longspec", "mlc", "oracle", "generate", "compat", "parallel"}


def __getattr__(name: str):
    # ``specsampler.mlc`` etc. as attributes without importing them with the core.
    if name in _LAZY:
        return _importlib.import_module(f"{__name__}.{name}")
    if f"{__name__}.{name}" in _legacy.MOVED:  # ``specsampler.chain`` etc., the flat layout's modules
        return _importlib.import_module(_legacy.MOVED[f"{__name__}.{name}"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


# the core's names: a star import loads nothing more (the subpackages load when first used, as attributes;
# generate needs the optional transformers)
__all__ = [
    "ChainResult",
    "Philox",
    "SampleOutput",
    "SamplingParams",
    "TokenTree",
    "TreeResult",
    "Uniforms",
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
    "warmup",
]
__version__ = "0.1.0"
