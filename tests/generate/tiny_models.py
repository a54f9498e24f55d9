"""Tiny random Llama models for the generation tests (no downloads)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab: int, layers: int, hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).double().eval()


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always: its weights plus noise."""
    draft = LlamaForCausalLM(model.config).double().eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std().clamp(min=1e-3))
    return draft


def sharp_pair(vocab: int = 48, seed: int = 0):
    """A target with sharp next-token distributions and a noisy copy of it as the draft."""
    target = tiny_llama(vocab, 2, 32, seed=seed)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    return target, noisy_copy(target, 0.3, seed=seed + 1)
