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

from ..validation import fail


def cache_argument(model) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` (transformers >= 5.x)
    or ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# the layer types whose attention the loop's 4-D mask states and whose keys and values its cache holds (sliding and
# chunked windows: ModelCache, and the loop's window check)
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def _text_config(model):
    """``model``'s transformers config (its text decoder's, for a multimodal one), or None."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return config


def unsupported(model) -> str | None:
    """Why the loop cannot give ``model``'s own logits, or None where it can (docs/design.md, "Speculative
    generation"): a recurrent state (transformers marks such models stateful and refuses them in its own assisted
    generation: a state cannot be taken back to before rejected drafts), layers of another type than attention
    (``layer_types``: convolutions, linear attention, ...), or ALiBi biases (BLOOM, MPT, Falcon with ``alibi``),
    which the model computes from cache slots, not from the positions the loop gives: every tree, and every batch
    whose requests keep different slots, would be scored at other distances than its own."""
    if getattr(model, "_is_stateful", False):
        return "a recurrent state (transformers marks the model stateful): rejected drafts cannot be taken back"
    config = _text_config(model)
    other = sorted({t for t in getattr(config, "layer_types", None) or () if t not in ATTENTION_LAYERS})
    if other:
        return f"layers of type {', '.join(map(repr, other))} (the loop keeps attention layers' keys and values only)"
    attn = getattr(config, "attn_config", None)  # MPT's
    alibi = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    if getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", False) or alibi:
        return "ALiBi attention biases, which the model computes from cache slots, not from the positions given"
    return None


def slot_masks(model) -> tuple[int | None, int | None]:
    """The causal masks ``model`` keeps itself and indexes by cache slot (bool buffers ``[1, 1, M, M]``, GPT-Neo's
    ``bias``): the fewest slots one covers (M; past them the model fails) and the fewest slots back that a windowed
    one lets a query see (GPT-Neo's local layers; a key further back in slots is hidden, though it may be nearer in
    positions, where the loop keeps slots no request uses). None where there is none."""
    table = window = None
    for buf in model.buffers():
        if (buf.dtype == torch.bool and buf.dim() == 4 and buf.shape[:2] == (1, 1) and buf.shape[2] == buf.shape[3]
                and not buf.is_meta):  # an offloaded model's buffers may hold no values here
            M, seen = buf.shape[3], int(buf[0, 0, -1].sum())  # the last query's row: the keys within its window
            table = M if table is None else min(table, M)
            if seen < M:
                window = seen if window is None else min(window, seen)
    return table, window


def attention_windows(model) -> tuple[int | None, int | None]:
    """``model``'s attention windows, as its transformers config declares them: ``(sliding, other)``.

    sliding: the window every layer slides (``sliding_window``, with no ``layer_types`` or all of them sliding),
    which :class:`ModelCache`'s mask applies by position as the model's own would (a query sees the keys fewer than
    ``sliding`` positions back); other: the fewest positions back that some layer attends to where one mask cannot
    say it (sliding layers beside full ones, ``attention_chunk_size``): the loop's custom 4-D mask replaces the
    model's, so such a model gives its own logits only while every position it is queried at fits in that window.
    None: no such window.
    """
    config = _text_config(model)
    if config is None:
        return None, None
    sliding, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    sliding = sliding if isinstance(sliding, int) and sliding > 0 else None
    chunk = chunk if isinstance(chunk, int) and chunk > 0 else None
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2-style configs keep an unused window
        sliding = None
    types = getattr(config, "layer_types", None)
    if types is not None:  # per layer: a window counts only where some layer uses it
        chunk = chunk if any("chunked" in t for t in types) else None
        if not any("sliding" in t for t in types):
            sliding = None
        elif not all("sliding" in t for t in types):  # mixed: a mask for all layers cannot hold both
            return None, min((w for w in (sliding, chunk) if w is not None), default=None)
    return sliding, chunk


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
    position table (``n_positions``) or window. ``window``: the sliding window of every layer
    (:func:`attention_windows`), applied by position in each call's mask; ``pos`` int64 ``[B, S]`` then holds each
    slot's position. ``op``, ``name``: the call and the argument its errors name; ``exact``: the model's own logits
    count (a target's; a draft's only change its proposals). Where the model keeps causal masks indexed by cache
    slot (:func:`slot_masks`), a call past them (past their window, where ``exact``) is a ValueError, and so is
    ``fewest``, the slots the generation takes at least, before the model runs.
    """

    def __init__(self, model, batch: int, device: torch.device, last: Tensor | None = None, *, op: str,
                 name: str, exact: bool = True, fewest: int = 0):
        from transformers import DynamicCache

        self.op, self.name = op, name
        table, window = slot_masks(model)
        self._masks = table, window if exact else None
        self.room = table if self._masks[1] is None else min(table, window)
        if self.room is not None and fewest > self.room:
            self._no_room(fewest)
        self.model = model
        self.cache = DynamicCache()
        self.dtype = model.dtype
        self.hidden = torch.finfo(self.dtype).min
        self.bias = torch.zeros(batch, 0, dtype=self.dtype, device=device)
        self._seen, self._unseen = (torch.tensor(v, dtype=self.dtype, device=device) for v in (0.0, self.hidden))
        self.calls = 0
        self.last = None if last is None else last[:, None]
        self.window = attention_windows(model)[0]
        self.pos = None if self.window is None else torch.zeros(batch, 0, dtype=torch.int64, device=device)
        self._cache_kw = cache_argument(model)

    @property
    def slots(self) -> int:
        return self.bias.shape[1]

    def visible(self, seen: Tensor) -> Tensor:
        """The additive bias of ``seen`` (bool): 0 where True, the dtype's minimum elsewhere."""
        return torch.where(seen, self._seen, self._unseen)

    def _no_room(self, slots: int) -> None:
        fail(self.op, self.name, f"room for the {slots} cache slots the generation reaches (a batch keeps slots that "
             "some request does not use, and each step feeds its drafts after the committed tokens: fewer new "
             "tokens, drafts or requests take fewer)",
             f"a model whose own causal masks index cache slots and cover {self._masks[0]} of them"
             + ("" if self._masks[1] is None else f", some seeing only the last {self._masks[1]}"))

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
        if self.room is not None and self.slots + n > self.room:
            self._no_room(self.slots + n)
        prefix = self.slots if prefix is None else prefix
        own = (own[:, None] if own.dim() == 3 else own).expand(B, 1, n, own.shape[-1])
        mask = torch.cat([self.bias[:, None, None, :prefix].expand(B, 1, n, prefix), own], 3)
        if self.last is not None:  # such a token's logits and KV entries reach no output token
            positions = torch.minimum(positions, self.last)
        if self.window is not None:  # the model's own window, which the custom mask replaces: keys this far back
            self.pos = torch.cat([self.pos, positions], 1)
            far = positions[:, :, None] - self.pos[:, None, :] >= self.window
            mask = mask.masked_fill(far[:, None], self.hidden)
        try:
            out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kw: self.cache})
        except IndexError as e:  # a learned position table shorter than the positions fed
            fail(self.op, self.name, "a model that embeds every position the generation feeds (up to the longest "
                 "prompt + max_new_tokens - 2: fewer new tokens take fewer)",
                 f"an IndexError at positions up to {int(positions.max())} ({e})")
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
            slots = start + torch.where(j <= num[:, None], path[:, :width], j)
            src = slots[:, None, :, None]
            index = {}  # the index expanded once per layer shape (the layers of a model share one)
            for t in _layers(self.cache):
                B, H, _, D = t.shape
                at = index.get((H, D))
                if at is None:
                    at = index[H, D] = src.expand(B, H, width, D)
                t[:, :, start: start + width] = t.gather(2, at)
        if self.pos is not None:
            kept_pos = self.pos[:, start: start + width] if path is None else self.pos.gather(1, slots)
            self.pos = torch.cat([self.pos[:, :start], kept_pos], 1)
        kept = self.visible(torch.arange(width, device=dev) <= num[:, None])
        self.bias = torch.cat([self.bias[:, :start], kept], 1)
        extra = self.cache.get_seq_length() - self.slots
        if extra > 0:
            self.cache.crop(-extra)  # a negative count removes tokens (transformers 4.x and 5.x)
