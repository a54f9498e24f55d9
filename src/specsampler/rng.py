"""Randomness for every stochastic op: ``rng=None | torch.Generator | Philox | Uniforms``.

- ``None``: the global torch generator of the device; a ``torch.Generator``: ``torch.rand`` from it
  (results then depend on the whole batch);
- :class:`Philox` ``(seed, offset=0)``: counter-based streams per request (Philox4x32-10, as Triton's
  ``tl.philox``): request b's results depend on its own inputs, seed and offset alone;
- :class:`Uniforms`: the caller's own uniforms, used as given (drop-in layers whose callers draw them).

The counter layout, the streams and indices of each op, and the draw by inversion are the contract the
kernels follow: docs/design.md, "Randomness". A draw inverts ``floor(u * Z)`` over a row's exact fixed-point masses
(:mod:`specsampler.sampling.masses`), so that it is the same draw whatever the order of the sums: in any batch,
and over a vocabulary split into shards (:mod:`specsampler.parallel`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import constants
from .validation import check_host_or, check_shape, check_tensor, fail

STREAM_SAMPLE = 0
STREAM_ACCEPT = 1

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85



@dataclass(frozen=True)
class Philox:
    """Counter-based per-request random streams (Philox4x32-10).

    Args:
        seed: int, or int64 tensor ``[B]``: request b's key.
        offset: int, or int64 tensor ``[B]``: request b's step counter. Keep it on the device
            of the inputs and advance it in place between steps for CUDA-graph replays (a tensor on the CPU is
            copied to that device; on any other device it is an error).
    """

    seed: int | Tensor
    offset: int | Tensor = 0

    def advance(self, steps: int = 1) -> Philox:
        """The same seeds with ``offset + steps`` (a new object; tensors are not modified)."""
        return Philox(self.seed, self.offset + steps)

    def keys(self, op: str, batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(seed, offset)`` as int64 tensors ``[batch]`` on ``device`` (made from an int: a tensor shared by
        every call, :mod:`specsampler.constants`; read only)."""
        return _per_request(op, "Philox.seed", self.seed, batch, device), _per_request(
            op, "Philox.offset", self.offset, batch, device
        )


_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


@dataclass(frozen=True)
class Uniforms:
    """The caller's uniforms in [0, 1), used as given (NaN read as 0, values outside [0, 1) as the nearer end), laid
    out as the Philox counters are (docs/design.md, "Randomness"): ``sample`` float ``[B, n]`` the draws and
    corrections (``STREAM_SAMPLE``), ``accept`` float ``[B, n]`` the acceptance tests (``STREAM_ACCEPT``; chain draft
    i at index i + 1); ``n`` at least the indices the op reads (K + 1 for a chain, N for a tree). None for a stream
    the op does not read."""

    sample: Tensor | None = None
    accept: Tensor | None = None

    def stream(self, op: str, stream: int, batch: int, count: int, device: torch.device) -> Tensor:
        """float32 ``[batch, count]``: the given uniforms of ``stream`` at indices ``0 .. count-1``."""
        name, t = ("Uniforms.sample", self.sample) if stream == STREAM_SAMPLE else ("Uniforms.accept", self.accept)
        if t is None:
            fail(op, name, f"a float tensor [B, >= {count}] (this op reads it)", "None")
        check_tensor(op, name, t, kind="float", ndim=2)
        if t.shape[0] != batch or t.shape[1] < count:
            fail(op, name, f"shape [B = {batch}, >= {count}]", f"shape {list(t.shape)}")
        check_host_or(op, name, t, device)
        # NaN read as 0 and values outside [0, 1) as the nearer end, for the acceptance tests as for the draws
        return torch.nan_to_num(t[:, :count].to(device=device, dtype=torch.float32), nan=0.0).clamp_(0.0, _BELOW_ONE)


def _per_request(op: str, name: str, v: int | Tensor, batch: int, device: torch.device) -> Tensor:
    if isinstance(v, Tensor):
        check_tensor(op, name, v, kind="int", ndim=(0, 1))
        if v.dim() == 1:
            check_shape(op, name, v, (batch,), "[B]")
        check_host_or(op, name, v, device)
        return v.to(device=device, dtype=torch.int64).expand(batch)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):  # NumPy's integers too
        fail(op, name, "an int or an int64 tensor [B]", repr(v))
    v = int(v)
    if not -(2**63) <= v < 2**63:
        fail(op, name, "a value that fits in int64", v)
    return constants.full(batch, v, torch.int64, device)


def check_rng(op: str, rng: object) -> None:
    if rng is not None and not isinstance(rng, (torch.Generator, Philox, Uniforms)):
        fail(op, "rng", "None, a torch.Generator, specsampler.Philox or specsampler.Uniforms", type(rng).__name__)


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of ``a * b`` for a 32-bit constant and 32-bit values in int64."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    p_lo, p_hi = a * b_lo, a * b_hi  # each < 2**48: no overflow in int64
    s = p_lo + ((p_hi & 0xFFFF) << 16)
    return ((p_hi >> 16) + (s >> 32)) & _MASK32, s & _MASK32


def philox4x32(counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[Tensor, Tensor], rounds: int = 10):
    """Philox4x32 on int64 tensors holding 32-bit words; returns the four output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_ROUND_A, c0)
        hi1, lo1 = _mulhilo(_ROUND_B, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def philox4x32_numpy(counter: tuple, key: tuple, rounds: int = 10):
    """:func:`philox4x32` on numpy uint64 arrays of 32-bit words (broadcastable shapes; exact products: the CPU
    path). At a batch's sizes numpy's cost is per operation, not per number, so the words are stacked in pairs
    that share every operation of a round: ``(c0, c2)`` multiplied by ``(A, B)`` at once, then each product's
    high word xored with ``(c1, c3)`` and the round keys (all rounds' keys made at once, at the keys' own shape:
    a request's, not each of its draws')."""
    shape = np.broadcast_shapes(*(np.shape(w) for w in counter))
    key_shape = np.broadcast_shapes(*(np.shape(w) for w in key))
    mask, s32 = np.uint64(_MASK32), np.uint64(32)
    x = np.empty((2, *shape), np.uint64)  # (c0, c2)
    y = np.empty_like(x)  # (c1, c3)
    x[0], y[0], x[1], y[1] = counter
    keys = np.empty((rounds, 2, *key_shape), np.uint64)
    keys[:, 0], keys[:, 1] = key
    keys += np.arange(rounds, dtype=np.uint64).reshape(rounds, 1, *(1,) * len(key_shape)) * np.array(
        [_KEY_A, _KEY_B], np.uint64).reshape(2, *(1,) * len(key_shape))
    keys &= mask
    factors = np.array([_ROUND_B, _ROUND_A], np.uint64).reshape(2, *(1,) * len(shape))
    for r in range(rounds):
        p = x[::-1] * factors  # (c2 B, c0 A): the products the new (c0, c2) take their high words from
        x = (p >> s32) ^ y ^ keys[r]
        y = p & mask
    return x[0], y[0], x[1], y[1]


def philox_uniform(seed: Tensor, offset: Tensor, index: Tensor, stream: int | Tensor) -> Tensor:
    """Uniforms in [0, 1) at the documented counters.

    Args:
        seed, offset: int64 ``[B]``.
        index: int64 ``[B, n]``: the draw index of each uniform within its request.
        stream: ``STREAM_SAMPLE`` or ``STREAM_ACCEPT``, or int64 ``[n]``: each column's.
    Returns:
        float32 ``[B, n]`` (on the CPU computed with numpy, elsewhere and while torch.compile traces with torch
        ops: the same numbers).
    """
    if index.device.type != "cpu" or torch.compiler.is_compiling():  # NumPy's uint64 words do not trace
        return _uniform_torch(seed, offset, index, stream)
    return (_uniform_python if index.numel() <= _FEW_UNIFORMS else _uniform_numpy)(seed, offset, index, stream)


_FEW_UNIFORMS = 16  # uniforms this few are computed in Python integers: numpy's 40-odd operations cost more


def _uniform_python(seed: Tensor, offset: Tensor, index: Tensor, stream: int | Tensor) -> Tensor:
    """:func:`_uniform_numpy` in Python integers, for a few uniforms (an op on a few requests seeded by a Philox):
    the same words (products of 32-bit words are exact; ``& _MASK32`` of a negative int64 is its two's
    complement's low word, as numpy's uint64 view gives): some 30 us a call and 5 us a uniform, against numpy's
    130 us a call whatever the count."""
    streams = [stream] * index.shape[-1] if isinstance(stream, int) else stream.tolist()
    out = []
    for s, o, row in zip(seed.tolist(), offset.tolist(), index.tolist()):
        keys = [((s + r * _KEY_A) & _MASK32, ((s >> 32) + r * _KEY_B) & _MASK32) for r in range(10)]
        for i, c1 in zip(row, streams):
            c0, c2, c3 = i & _MASK32, o & _MASK32, (o >> 32) & _MASK32
            for k0, k1 in keys:
                p0, p1 = _ROUND_A * c0, _ROUND_B * c2
                c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
            out.append((c0 >> 8) * 2.0**-24)
    return torch.tensor(out, dtype=torch.float32).view(index.shape)


def _uniform_numpy(seed: Tensor, offset: Tensor, index: Tensor, stream: int | Tensor) -> Tensor:
    u64 = lambda t: t.numpy().view(np.uint64)  # noqa: E731  (two's complement: the low 64 bits; no copy)
    mask, s32 = np.uint64(_MASK32), np.uint64(32)
    s, o = u64(seed)[:, None], u64(offset)[:, None]
    streams = u64(stream) if isinstance(stream, Tensor) else np.uint64(stream)
    word = philox4x32_numpy((u64(index) & mask, streams, o & mask, o >> s32), (s & mask, s >> s32))[0]
    u = (word >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)
    return torch.from_numpy(u.reshape(index.shape))


def _uniform_torch(seed: Tensor, offset: Tensor, index: Tensor, stream: int) -> Tensor:
    shape = index.shape
    k0 = (seed & _MASK32)[:, None].expand(shape)
    k1 = ((seed >> 32) & _MASK32)[:, None].expand(shape)
    c0 = index & _MASK32
    c1 = stream.expand(shape) if isinstance(stream, Tensor) else torch.full_like(c0, stream)
    c2 = (offset & _MASK32)[:, None].expand(shape)
    c3 = ((offset >> 32) & _MASK32)[:, None].expand(shape)
    word = philox4x32((c0, c1, c2, c3), (k0, k1))[0]
    return (word >> 8).to(torch.float32) * (2.0**-24)


def uniform(rng, op: str, batch: int, count: int, stream: int, device: torch.device) -> Tensor:
    """``count`` uniforms per request, float32 ``[batch, count]`` in [0, 1), at indices 0..count-1."""
    if isinstance(rng, Philox):
        seed, offset = rng.keys(op, batch, device)
        index = constants.index_in_request(1, count, device).expand(batch, count)
        return philox_uniform(seed, offset, index, stream)
    if isinstance(rng, Uniforms):
        return rng.stream(op, stream, batch, count, device)
    if isinstance(rng, torch.Generator):
        return torch.rand((batch, count), generator=rng, device=rng.device).to(device)
    return torch.rand((batch, count), device=device)


def planned(rng, op: str, batch: int, plan: tuple[tuple[int, int], ...], device: torch.device):
    """``draw(stream, count)`` for an op whose draws are ``plan`` ((stream, count) pairs, each stream once): the
    uniforms ``uniform(rng, op, batch, count, stream, device)`` gives. A :class:`Philox`'s planned streams come
    from one evaluation (at a batch's sizes its cost is per call, not per number); any other rng is drawn from
    when asked, in the op's own order."""
    if not isinstance(rng, Philox) or len(plan) < 2:
        return lambda stream, count: uniform(rng, op, batch, count, stream, device)
    seed, offset = rng.keys(op, batch, device)
    index, streams = constants.plan_counters(plan, device)
    u = philox_uniform(seed, offset, index.expand(batch, -1), streams).split([count for _, count in plan], 1)
    ready = {s: part for (s, _), part in zip(plan, u)}

    def draw(stream: int, count: int) -> Tensor:
        have = ready.get(stream)
        if have is None or have.shape[1] < count:
            return uniform(rng, op, batch, count, stream, device)
        return have[:, :count].contiguous()  # a Philox number depends on its counter, not on the count drawn

    return draw


def kernel_randomness(rng, op: str, batch: int, count: int, streams: tuple[int, ...],
                      device: torch.device) -> tuple[Tensor | None, Tensor | None, list[Tensor | None]]:
    """What a kernel needs to draw the numbers its PyTorch reference draws.

    With a :class:`Philox` rng: its keys ``(seed, offset)`` int64 ``[batch]`` (the kernel computes
    the uniforms at the documented counters) and no uniforms. Otherwise no keys, and the
    uniforms of each of ``streams`` (float32 ``[batch, count]``), drawn in that order: the
    order the reference draws them in, so that a ``torch.Generator`` gives both the same numbers.
    """
    if isinstance(rng, Philox):
        seed, offset = rng.keys(op, batch, device)
        return seed, offset, [None] * len(streams)
    return None, None, [uniform(rng, op, batch, count, s, device) for s in streams]
