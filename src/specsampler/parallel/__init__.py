"""Vocab-parallel sampling and verification over ``torch.distributed`` (docs/design.md, "Vocab-parallel").

Rank r holds the logits of global ids ``[shard.start, shard.end)`` (:class:`VocabShard`); the ops return the
same results on every rank, equal to the one-device ops on the whole rows, and send only small collectives
(:func:`count_collectives` counts them), never the logits. Today: the greedy paths; sampled rows wait for the
shard-invariant draw recipe (:mod:`.ops`).
"""

from .comms import CollectiveLog, count_collectives
from .ops import sample_from_logits, verify_chain_from_logits, verify_tree_from_logits
from .shard import VocabShard

__all__ = ["CollectiveLog", "VocabShard", "count_collectives", "sample_from_logits", "verify_chain_from_logits",
           "verify_tree_from_logits"]
