"""Vocab-parallel sampling and verification over ``torch.distributed`` (docs/design.md, "Vocab-parallel").

Rank r holds the logits of global ids ``[shard.start, shard.end)`` (:class:`VocabShard`); the ops return the
same results on every rank, equal token for token to the one-device ops on the whole rows (with the same
``Philox`` seeds, at any split). Two strategies: ``shard`` sends only small collectives, in a few rounds
(:func:`count_collectives` counts them), never the logits: greedy choices by one ``all_reduce`` of argmax keys
(:mod:`.argmax`), sampled rows processed on the shards (:mod:`.process`, :mod:`.nucleus`) and verified
(:mod:`.walks`), every round one ``all_gather`` that every step shares (:mod:`.rounds`); ``gather`` all-gathers
the rows and runs the one-device op. ``auto`` picks by a latency-bandwidth model of the link (:class:`Link`,
:data:`LINKS`, :mod:`.cost`). Every rank passes the same arguments but its shard's columns; the first round checks
that the shards tile the vocabulary and the arguments agree (:meth:`.rounds.Layout.check`), on every rank alike.
"""

from . import cost
from .comms import CollectiveLog, count_collectives
from .cost import LINKS, Link
from .ops import sample_from_logits, verify_chain_from_logits, verify_tree_from_logits
from .shard import VocabShard

__all__ = ["LINKS", "CollectiveLog", "Link", "VocabShard", "cost", "count_collectives", "sample_from_logits",
           "verify_chain_from_logits", "verify_tree_from_logits"]
