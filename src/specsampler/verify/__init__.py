"""Verification of draft chains and trees against the target, and the proof that it is exact.

`chain` (token, block, target_only, greedy), `token_tree` (the `TokenTree` structure), `tree` (the tree
walks: rrs, traversal, target_only, greedy), `reference` (one plain loop per request for each method),
`oracle` (exact output distributions), `exactness` (Monte Carlo of the real code against the oracle),
`kv` (moving the accepted path's KV entries). Algorithms: docs/design.md, "Algorithms".
"""

from .chain import ChainResult, verify_chain, verify_chain_from_logits
from .kv import compact_kv
from .token_tree import TokenTree
from .tree import TreeResult, verify_tree, verify_tree_from_logits

__all__ = ["ChainResult", "TokenTree", "TreeResult", "compact_kv", "verify_chain", "verify_chain_from_logits",
           "verify_tree", "verify_tree_from_logits"]
