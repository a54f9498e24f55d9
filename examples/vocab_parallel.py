"""Verification on vocabulary shards: ``torchrun --nproc-per-node 2 examples/vocab_parallel.py``.

Each rank holds the logits of its slice of the vocabulary (as a vocab-parallel LM head leaves them); the ranks
agree on the accepted tokens with small collectives, without gathering the logits (``strategy="shard"``; the
default ``"auto"`` gathers where a latency-bandwidth model of the link says it is cheaper), and every rank prints
the same result as the one-device op on the whole rows: greedy verification (one all_reduce), then token
verification of sampled drafts with temperature 0.8 and top-p 0.9 (exact integer masses across the shards, at most
5 rounds).
"""

import torch
import torch.distributed as dist

import specsampler as ss
from specsampler import parallel

dist.init_process_group("gloo")
B, K, V = 4, 5, 128256
g = torch.Generator().manual_seed(0)
logits = torch.randn(B, K + 1, V, generator=g)  # every rank makes the same full rows, then keeps its slice
drafts = logits[:, :K].argmax(-1)
drafts[1, 2] = 7  # request 1 diverges at its third draft

shard = parallel.VocabShard.even(V)
with parallel.count_collectives() as log:
    res = parallel.verify_chain_from_logits(logits[..., shard.start:shard.end], drafts, method="greedy", shard=shard,
                                            strategy="shard")
one_device = ss.verify_chain_from_logits(logits, drafts, method="greedy")
assert torch.equal(res.tokens, one_device.tokens)
print(f"rank {dist.get_rank()} holds ids [{shard.start}, {shard.end}): accepted {res.num_accepted.tolist()}, "
      f"{log.rounds} collective of {log.bytes} bytes (the logits are {logits.numel() * 4 // 2**20} MiB)")

params, rng = ss.SamplingParams(temperature=0.8, top_p=0.9), ss.Philox(torch.arange(B), 1)
q = torch.softmax(logits[:, :K] / 0.7, -1)  # a draft model's distributions; its drafts drawn from them
drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
with parallel.count_collectives() as log:
    res = parallel.verify_chain_from_logits(logits[..., shard.start:shard.end], drafts, params,
                                            draft_probs=q[..., shard.start:shard.end], method="token", rng=rng,
                                            shard=shard, strategy="shard")
one_device = ss.verify_chain_from_logits(logits, drafts, params, draft_probs=q, method="token", rng=rng)
assert torch.equal(res.tokens, one_device.tokens)
print(f"rank {dist.get_rank()}: sampled drafts: emitted {res.tokens.tolist()}, {log.rounds} collectives of "
      f"{log.bytes} bytes in all")
dist.destroy_process_group()
