"""Drop-in replacements for peers' sampling and verification entry points.

Swap one import (``import specsampler.compat.flashinfer as flashinfer``) and a peer's calls run on
specsampler's ops: the peer's signatures, dtypes, in-place writes and error messages, with our
exactness, per-request seeds and (on CUDA tensors) our kernels. One module per peer:
``flashinfer``, ``sglang``, ``vllm``, ``hf``, ``tokenspeed``. Each function's docstring names the
specsampler op it maps to and where its behaviour differs from the peer's.
"""
