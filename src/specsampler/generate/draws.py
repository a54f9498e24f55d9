"""A generation's random draws: call k takes the stream a public op would get from ``rng.advance(k)``.

Generation makes its random calls in a fixed order (the first token's draw; then in every step
each draft level's draws and the verification's), each call with its own offset of a
:class:`Philox` rng. The counters of many steps are therefore known in advance: their uniforms are
computed in one pass per block of steps (one NumPy Philox evaluation on the CPU, a few tensor ops
elsewhere) instead of one per call. A ``torch.Generator`` (or None) is drawn from call by call, in
the order the public ops draw, so that every rng gives the tokens the public ops would give.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..rng import Philox, philox4x32, philox4x32_numpy, uniform

# One call's draws: (stream, count) pairs, in the order the call's op draws them.
Draws = tuple[tuple[int, int], ...]
# A step's calls, in order.
Plan = tuple[Draws, ...]

_MASK32 = 0xFFFFFFFF
_BLOCK_STEPS = 16  # steps whose uniforms are computed in one pass


class Call:
    """One random call (the ``k``-th of ``streams``): its uniforms, and ``rng`` as the public op
    would receive it."""

    __slots__ = ("_streams", "_k", "_pre", "_batch", "_device", "_op")

    def __init__(self, streams: Streams, k: int, pre: dict[int, Tensor] | None):
        self._streams, self._k, self._pre = streams, k, pre
        self._batch, self._device, self._op = streams.batch, streams.device, streams.op

    @property
    def rng(self):
        """``rng.advance(k)`` for a :class:`Philox` (made when asked: the kernels' input), else the rng."""
        return self._streams.rng_at(self._k)

    def uniform(self, stream: int, count: int) -> Tensor:
        """float32 ``[B, count]``: the uniforms ``uniform(rng, .., count, stream, ..)`` would give
        (precomputed: the first ``count`` of those planned; else drawn now)."""
        if self._pre is not None:
            u = self._pre[stream]
            return u if u.shape[1] == count else u[:, :count].contiguous()
        return uniform(self.rng, self._op, self._batch, count, stream, self._device)


class Streams:
    """The random calls of one generation, in call order.

    ``rng``: None, a ``torch.Generator`` or a :class:`Philox` (seeds and offsets validated here,
    once). ``horizon``: the most steps a generation can take (bounds the precomputed blocks).
    """

    def __init__(self, rng, batch: int, device: torch.device, op: str, horizon: int):
        self.rng, self.batch, self.device, self.op = rng, batch, device, op
        self.calls = 0  # calls made so far: the next call's offset
        self.horizon = horizon
        self._keys = rng.keys(op, batch, device) if isinstance(rng, Philox) else None
        self._plan: Plan | None = None
        self._ready: list[list[Call]] = []

    def rng_at(self, k: int):
        return Philox(self._keys[0], self._keys[1] + k) if self._keys is not None else self.rng

    def call(self, draws: Draws) -> Call:
        """The next call alone (its uniforms computed now)."""
        self._ready = []  # precomputed steps would start one offset too early now
        (calls,) = self._compute((draws,), 1) if self._keys is not None else [[self._live(self.calls)]]
        self.calls += 1
        return calls[0]

    def step(self, plan: Plan) -> list[Call]:
        """The next step's calls (``plan``: each call's draws), with Philox uniforms computed a block
        of steps at a time."""
        if self._keys is None:
            calls = [self._live(self.calls + j) for j in range(len(plan))]
            self.calls += len(plan)
            return calls
        if plan != self._plan:
            self._plan, self._ready = plan, []
        if not self._ready:
            steps = max(1, min(_BLOCK_STEPS, self.horizon))
            self._ready = self._compute(plan, steps)
        self.horizon -= 1
        self.calls += len(plan)
        return self._ready.pop(0)

    def _live(self, k: int) -> Call:
        return Call(self, k, None)

    def _compute(self, plan: Plan, steps: int) -> list[list[Call]]:
        """The calls of ``steps`` steps from the current offset, their uniforms from one Philox pass."""
        index, stream, call = [], [], []
        for s in range(steps):
            for j, draws in enumerate(plan):
                for st, count in draws:
                    index += range(count)
                    stream += [st] * count
                    call += [self.calls + s * len(plan) + j] * count
        u = self._uniforms(np.array(index, dtype=np.uint64), np.array(stream, dtype=np.uint64),
                           np.array(call, dtype=np.uint64))
        out, at = [], 0
        for s in range(steps):
            calls = []
            for j, draws in enumerate(plan):
                pre = {}
                for st, count in draws:
                    pre[st] = u[:, at: at + count].contiguous()  # as uniform() returns them
                    at += count
                calls.append(Call(self, self.calls + s * len(plan) + j, pre))
            out.append(calls)
        return out

    def _uniforms(self, index: np.ndarray, stream: np.ndarray, call: np.ndarray) -> Tensor:
        """float32 ``[B, T]``: the uniform at draw ``index[t]`` of ``stream[t]`` at offset ``+ call[t]``
        (:func:`specsampler.rng.philox_uniform`'s counters and arithmetic)."""
        seed, offset = self._keys
        if self.device.type == "cpu":
            u64 = lambda t: t.numpy().astype(np.uint64)  # noqa: E731  (two's complement: the low 64 bits)
            mask, s32 = np.uint64(_MASK32), np.uint64(32)
            s, o = u64(seed)[:, None], u64(offset)[:, None] + call[None, :]  # wraps modulo 2**64, as int64 does
            shape = o.shape
            counter = (np.broadcast_to(index & mask, shape), np.broadcast_to(stream, shape), o & mask, o >> s32)
            word = philox4x32_numpy(counter, (s & mask, s >> s32))[0]
            u = (word >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)
            return torch.from_numpy(np.ascontiguousarray(u))
        t = lambda a: torch.from_numpy(a.astype(np.int64)).to(self.device)  # noqa: E731
        o = offset[:, None] + t(call)[None, :]
        shape = o.shape
        c0, c1 = (t(index) & _MASK32).expand(shape), t(stream).expand(shape)
        key = ((seed & _MASK32)[:, None].expand(shape), ((seed >> 32) & _MASK32)[:, None].expand(shape))
        word = philox4x32((c0, c1, o & _MASK32, (o >> 32) & _MASK32), key)[0]
        return (word >> 8).to(torch.float32) * (2.0**-24)
