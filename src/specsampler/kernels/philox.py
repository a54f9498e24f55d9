"""Philox uniforms inside kernels, at the counters documented in :mod:`specsampler.rng`."""

import triton
import triton.language as tl


@triton.jit
def philox_uniform(seed, offset, index, stream: tl.constexpr):
    """float32 uniforms in [0, 1) of request ``(seed, offset)`` (int64 scalars) at draw
    ``index`` (an int tensor or scalar) of ``stream``: the numbers :func:`specsampler.rng.uniform` gives."""
    c0 = (index + tl.zeros((1,), tl.int64)).to(tl.uint32)
    c1 = tl.full(c0.shape, stream, tl.uint32)
    c2 = tl.full(c0.shape, 0, tl.uint32) + (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = tl.full(c0.shape, 0, tl.uint32) + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    w0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return (w0 >> 8).to(tl.float32) * (1.0 / 16777216.0)
