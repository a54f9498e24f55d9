"""Vocab-parallel sampling and verification over ``torch.distributed`` (docs/design.md, "Vocab-parallel").

Rank r holds the logits of global ids ``[shard.start, shard.end)`` (:class:`VocabShard`); the ops return the
same results on every rank, equal token for token to the one-device ops on the whole rows (with the same
``Philox`` seeds, at any split), and send only small collectives (:func:`count_collectives` counts them), never
the logits: greedy choices by one ``all_reduce`` of argmax keys (:mod:`.argmax`), sampled rows processed on the
shards (:mod:`.process`) and verified by the one-device walks over :class:`.vocab.ShardVocab`'s exact sums.
"""

from .comms import CollectiveLog, count_collectives
from .ops import sample_from_logits, verify_chain_from_logits, verify_tree_from_logits
from .shard import VocabShard

__all__ = ["CollectiveLog", "VocabShard", "count_collectives", "sample_from_logits", "verify_chain_from_logits",
           "verify_tree_from_logits"]
