"""One model's state during generation: its KV cache and which cache slots a new token may attend to.

Models are called as transformers causal LMs with a custom 4-D float mask (``0`` = visible, the
dtype's minimum = hidden) and per-token positions. The mask of a call is the committed slots'
additive bias (kept here, one row per request, extended as slots are added) next to the new
tokens' own bias (a tree's ancestor mask, prepared once per layout), so that no call rebuilds it
from booleans. transformers 5 names the cache argument ``cache`` (``past_key_values`` is deprecated
there); older releases take ``past_key_values``: the name each model's ``forward`` declares is used.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor


def cache_argument(model) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` (transformers >= 5.x)
    or ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def attention_window(model) -> int | None:
    """The fewest positions back that a layer of ``model`` attends to, as its transformers config declares a
    sliding window (``sliding_window``, on the layers ``layer_types`` names sliding) or chunked attention
    (``attention_chunk_size``); None where every layer attends to the whole context.

    The custom 4-D mask of :class:`ModelCache` replaces the model's own, windowed layers' included: such a
    model gives its own logits only while every position it is queried at fits in the window.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    sliding, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2-style configs keep an unused window
        sliding = None
    types = getattr(config, "layer_types", None)
    if types is not None:  # per layer: a window counts only where some layer uses it
        sliding = sliding if any("sliding" in t for t in types) else None
        chunk = chunk if any("chunked" in t for t in types) else None
    return min((w for w in (sliding, chunk) if isinstance(w, int) and w > 0), default=None)


def _layers(cache) -> list[Tensor]:
    """The key and value tensors ``[B, H, S, D]`` of a ``DynamicCache``'s filled layers."""
    if hasattr(cache, "layers"):
        kv = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    else:  # transformers before 4.56
        kv = [*cache.key_cache, *cache.value_cache]
    return [t for t in kv if isinstance(t, Tensor) and t.numel()]


class ModelCache:
    """A model, its ``DynamicCache`` over the batch, and the bias of each cache slot.

    ``bias``: ``[B, S]`` in the model's dtype: 0 for a slot holding a committed token of the
    request, the dtype's minimum for the others (left padding, drafts not kept). ``last``: None, or int64
    ``[B]``, each request's last position whose logits can matter; tokens past it (drafts beyond
    ``max_new_tokens``, the tokens of requests that ended) are fed at it, so that they never outrun the model's
    position table (``n_positions``) or window.
    """

    def __init__(self, model, batch: int, device: torch.device, last: Tensor | None = None):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache()
        self.dtype = model.dtype
        self.hidden = torch.finfo(self.dtype).min
        self.bias = torch.zeros(batch, 0, dtype=self.dtype, device=device)
        self._seen, self._unseen = (torch.tensor(v, dtype=self.dtype, device=device) for v in (0.0, self.hidden))
        self.calls = 0
        self.last = None if last is None else last[:, None]
        self._cache_kw = cache_argument(model)

    @property
    def slots(self) -> int:
        return self.bias.shape[1]

    def visible(self, seen: Tensor) -> Tensor:
        """The additive bias of ``seen`` (bool): 0 where True, the dtype's minimum elsewhere."""
        return torch.where(seen, self._seen, self._unseen)

    def forward(self, tokens: Tensor, positions: Tensor, own: Tensor, *, prefix: int | None = None,
                committed: Tensor | None = None) -> Tensor:
        """Run the model on ``tokens`` int64 ``[B, n]`` at ``positions`` ``[B, n]``.

        The new tokens see the first ``prefix`` cache slots (default all) where they hold
        committed tokens, and the slots after them as ``own`` says: an additive bias ``[n, m]``
        or ``[B, n, m]`` over the last ``m`` slots (the new tokens the last ``n`` of them).
        The new slots count as committed where ``committed`` (bool ``[B, n]``) says so.
        Returns float32 logits ``[B, n, V]``.
        """
        B, n = tokens.shape
        prefix = self.slots if prefix is None else prefix
        own = (own[:, None] if own.dim() == 3 else own).expand(B, 1, n, own.shape[-1])
        mask = torch.cat([self.bias[:, None, None, :prefix].expand(B, 1, n, prefix), own], 3)
        if self.last is not None:  # such a token's logits and KV entries reach no output token
            positions = torch.minimum(positions, self.last)
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self._cache_kw: self.cache})
        self.calls += 1
        new = self._unseen.expand(B, n) if committed is None else self.visible(committed)
        self.bias = torch.cat([self.bias, new], 1)
        return out.logits.float()  # float32 logits returned as they are (no copy)

    def prefill(self, input_ids: Tensor, real: Tensor) -> Tensor:
        """Feed the prompts (left-padded; ``real`` bool ``[B, L]``); returns the last row's logits ``[B, V]``."""
        L = real.shape[1]
        positions = (real.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(L, L, dtype=torch.bool, device=real.device).tril()
        # each token sees the real ones up to itself, and always itself, so that every query attends to something
        sees = (causal & real[:, None, :]) | torch.eye(L, dtype=torch.bool, device=real.device)
        own = torch.zeros(sees.shape, dtype=self.dtype, device=real.device).masked_fill_(~sees, self.hidden)
        return self.forward(input_ids, positions, own, committed=real)[:, -1]

    def keep(self, start: int, path: Tensor | None, num: Tensor, num_host: list[int]) -> None:
        """Keep slot ``start + path[b, j]`` as committed slot ``start + j`` for j <= ``num[b]``
        (``path`` int64 ``[B, >= max num + 1]``; None: the identity, as for a chain) and drop
        every slot after the longest kept path. ``num_host``: ``num`` as a list."""
        width = max(num_host) + 1
        dev = num.device
        if path is not None:  # the kept entries move to the front of the tree's slots
            j = torch.arange(width, device=dev)
            src = (start + torch.where(j <= num[:, None], path[:, :width], j))[:, None, :, None]
            index = {}  # the index expanded once per layer shape (the layers of a model share one)
            for t in _layers(self.cache):
                B, H, _, D = t.shape
                at = index.get((H, D))
                if at is None:
                    at = index[H, D] = src.expand(B, H, width, D)
                t[:, :, start: start + width] = t.gather(2, at)
        kept = self.visible(torch.arange(width, device=dev) <= num[:, None])
        self.bias = torch.cat([self.bias[:, :start], kept], 1)
        extra = self.cache.get_seq_length() - self.slots
        if extra > 0:
            self.cache.crop(-extra)  # a negative count removes tokens (transformers 4.x and 5.x)
