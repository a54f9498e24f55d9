"""The kernels as torch custom ops (``torch.library``), with fake implementations.

Registered ops are opaque to ``torch.compile`` (which then traces through the Python around
them with ``fullgraph=True``) and are captured whole in CUDA graphs: they allocate their
outputs from shapes only and never synchronise with the host. The fake implementations give
the outputs' shapes and dtypes without running anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import chain as _chain
from . import mlc as _mlc
from . import sampling as _sampling
from . import tree as _tree


@torch.library.custom_op("specsampler::verify_chain", mutates_args=())
def verify_chain(target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None, num_drafts: Tensor,
                 method: str, seed: Tensor | None, offset: Tensor | None, u_accept: Tensor | None,
                 u_sample: Tensor | None) -> tuple[Tensor, Tensor]:
    """:func:`specsampler.kernels.chain.verify_chain`: tokens int64 ``[B, K+1]``, num_accepted int64 ``[B]``."""
    return _chain.verify_chain(target_probs, draft_tokens, draft_probs, num_drafts, method, seed, offset, u_accept,
                               u_sample)


@verify_chain.register_fake
def _(target_probs, draft_tokens, draft_probs, num_drafts, method, seed, offset, u_accept, u_sample):
    B, K1 = target_probs.shape[0], target_probs.shape[1]
    return (target_probs.new_empty((B, K1), dtype=torch.int64), target_probs.new_empty((B,), dtype=torch.int64))


@torch.library.custom_op("specsampler::verify_tree", mutates_args=())
def verify_tree(target_probs: Tensor, draft_tokens: Tensor, first_child: Tensor, next_sibling: Tensor,
                draft_probs: Tensor | None, method: str, draft_sampling: str, max_depth: int, seed: Tensor | None,
                offset: Tensor | None, u_accept: Tensor | None,
                u_sample: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`specsampler.kernels.tree.verify_tree`: path int64 ``[B, D+1]``, num_accepted and y int64 ``[B]``,
    tokens int64 ``[B, D+1]``, last_node int64 ``[B]``."""
    return _tree.verify_tree(target_probs, draft_tokens, first_child, next_sibling, draft_probs, method,
                             draft_sampling, max_depth, seed, offset, u_accept, u_sample)


@verify_tree.register_fake
def _(target_probs, draft_tokens, first_child, next_sibling, draft_probs, method, draft_sampling, max_depth, seed,
      offset, u_accept, u_sample):
    B = target_probs.shape[0]
    new = lambda *shape: target_probs.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, max_depth + 1), new(B), new(B), new(B, max_depth + 1), new(B)


@torch.library.custom_op("specsampler::mlc_batch_spec_verify", mutates_args=("model_probs", "token_tree_parent_ptr"))
def mlc_batch_spec_verify(draft_probs: Tensor, draft_tokens: Tensor, model_probs: Tensor,
                          token_tree_first_child: Tensor, token_tree_next_sibling: Tensor, uniform_samples: Tensor,
                          token_tree_parent_ptr: Tensor) -> None:
    """:func:`specsampler.kernels.mlc.batch_spec_verify`: ``model_probs`` and ``token_tree_parent_ptr`` in place."""
    _mlc.batch_spec_verify(draft_probs, draft_tokens, model_probs, token_tree_first_child, token_tree_next_sibling,
                           uniform_samples, token_tree_parent_ptr)


@mlc_batch_spec_verify.register_fake
def _(draft_probs, draft_tokens, model_probs, token_tree_first_child, token_tree_next_sibling, uniform_samples,
      token_tree_parent_ptr):
    return None


@torch.library.custom_op("specsampler::sample_from_logits", mutates_args=())
def sample_from_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                       vocab_mask: Tensor | None, seed: Tensor | None, offset: Tensor | None, index: Tensor | None,
                       u: Tensor | None) -> tuple[Tensor, Tensor]:
    """:func:`specsampler.kernels.sampling.sample_from_logits`: tokens int64 ``[R]``, logprobs float32 ``[R]``."""
    return _sampling.sample_from_logits(logits, temperature, top_k, top_p, min_p, vocab_mask, seed, offset, index, u)


@sample_from_logits.register_fake
def _(logits, temperature, top_k, top_p, min_p, vocab_mask, seed, offset, index, u):
    R = logits.shape[0]
    return logits.new_empty((R,), dtype=torch.int64), logits.new_empty((R,), dtype=torch.float32)


@torch.library.custom_op("specsampler::sample", mutates_args=())
def sample(probs: Tensor, seed: Tensor | None, offset: Tensor | None, index: Tensor | None,
           u: Tensor | None) -> Tensor:
    """:func:`specsampler.kernels.sampling.sample`: tokens int64 ``[R]``."""
    return _sampling.sample(probs, seed, offset, index, u)


@sample.register_fake
def _(probs, seed, offset, index, u):
    return probs.new_empty((probs.shape[0],), dtype=torch.int64)


@torch.library.custom_op("specsampler::verify_chain_from_logits", mutates_args=())
def verify_chain_from_logits(target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                             num_drafts: Tensor, method: str, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                             min_p: Tensor, vocab_mask: Tensor | None, seed: Tensor | None, offset: Tensor | None,
                             u_accept: Tensor | None, u_sample: Tensor | None) -> tuple[Tensor, Tensor]:
    """:func:`specsampler.kernels.chain.verify_chain_from_logits`: tokens ``[B, K+1]``, num_accepted ``[B]``."""
    return _chain.verify_chain_from_logits(target_logits, draft_tokens, draft_probs, num_drafts, method, temperature,
                                           top_k, top_p, min_p, vocab_mask, seed, offset, u_accept, u_sample)


@verify_chain_from_logits.register_fake
def _(target_logits, draft_tokens, draft_probs, num_drafts, method, temperature, top_k, top_p, min_p, vocab_mask,
      seed, offset, u_accept, u_sample):
    B, K1 = target_logits.shape[0], target_logits.shape[1]
    return (target_logits.new_empty((B, K1), dtype=torch.int64), target_logits.new_empty((B,), dtype=torch.int64))


@torch.library.custom_op("specsampler::verify_tree_from_logits", mutates_args=())
def verify_tree_from_logits(target_logits: Tensor, draft_tokens: Tensor, first_child: Tensor, next_sibling: Tensor,
                            draft_probs: Tensor | None, method: str, draft_sampling: str, max_depth: int,
                            temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                            vocab_mask: Tensor | None, seed: Tensor | None, offset: Tensor | None,
                            u_accept: Tensor | None, u_sample: Tensor | None
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`specsampler.kernels.tree.verify_tree_from_logits`: path ``[B, D+1]``, num_accepted, y ``[B]``,
    tokens ``[B, D+1]``, last_node ``[B]``."""
    return _tree.verify_tree_from_logits(target_logits, draft_tokens, first_child, next_sibling, draft_probs, method,
                                         draft_sampling, max_depth, temperature, top_k, top_p, min_p, vocab_mask, seed,
                                         offset, u_accept, u_sample)


@verify_tree_from_logits.register_fake
def _(target_logits, draft_tokens, first_child, next_sibling, draft_probs, method, draft_sampling, max_depth,
      temperature, top_k, top_p, min_p, vocab_mask, seed, offset, u_accept, u_sample):
    B = target_logits.shape[0]
    new = lambda *shape: target_logits.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, max_depth + 1), new(B), new(B), new(B, max_depth + 1), new(B)
