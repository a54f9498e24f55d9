"""Triton kernels: optimisations of the PyTorch references with the same inputs, outputs and randomness.

One module per op family. :func:`use_triton` decides, per call, which back end runs:
CUDA tensors run the kernels, other devices the PyTorch reference; the environment variable
``SPECSAMPLER_BACKEND=torch|triton`` forces one (``triton`` on CPU tensors runs the kernels
in the Triton interpreter, which needs ``TRITON_INTERPRET=1`` set before Triton is imported:
this is how the tests run them without a GPU).
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("torch", "triton")


_TRITON = importlib.util.find_spec("triton") is not None  # looked up once: torch.compile cannot trace find_spec


def triton_available() -> bool:
    """Whether Triton can be imported (the ``triton`` extra)."""
    return _TRITON


def backend() -> str | None:
    """The forced back end (``SPECSAMPLER_BACKEND``), or None to choose by device."""
    forced = os.environ.get("SPECSAMPLER_BACKEND", "").strip().lower()
    if not forced:
        return None
    if forced not in BACKENDS:
        raise ValueError(f"SPECSAMPLER_BACKEND: expected one of {BACKENDS}, got {forced!r}")
    return forced


def use_triton(device: torch.device) -> bool:
    """Whether an op on tensors of ``device`` runs its Triton kernel.

    Raises ValueError when ``SPECSAMPLER_BACKEND=triton`` cannot be honoured (Triton missing,
    or CPU tensors without ``TRITON_INTERPRET=1``).
    """
    forced = backend()
    if forced == "torch":
        return False
    if forced is None:
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise ValueError("SPECSAMPLER_BACKEND=triton: expected Triton to be installed (pip install "
                         "'specsampler[triton]'), got no triton module")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"SPECSAMPLER_BACKEND=triton: expected CUDA tensors, or TRITON_INTERPRET=1 to run the "
                         f"kernels in the Triton interpreter, got tensors on {device} without it")
    return True


_MAIN = ("probs", "logits", "target_probs", "target_logits")  # the public ops' first arguments


def runs_kernel(*args, **kwargs) -> bool:
    """Whether a public op with a kernel runs it, given its arguments: :func:`use_triton` of its main tensor's device
    (the first argument, positional or by name)."""
    main = args[0] if args else next((kwargs[k] for k in _MAIN if k in kwargs), None)
    return isinstance(main, torch.Tensor) and use_triton(main.device)
