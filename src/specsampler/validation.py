"""Input validation shared by every op (docs/design.md, "Error policy").

``validate="structure"`` (default): shapes, dtypes, devices, parameter ranges and tree structure, with no
device synchronisation (values only of CPU tensors and Python scalars). ``"full"``: also every value
(NaN/inf, negative probabilities, token ids in range), at the cost of a pass and a host sync. A violation
raises :class:`ValidationError` (a ``ValueError``) naming the op, the argument, what was expected, what
was found and, for values, the first offending request.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

MODES = ("structure", "full")


class ValidationError(ValueError):
    """Bad input to a specsampler op; the message names argument, expected, actual, request."""


def fail(op: str, name: str, expected: str, actual: object, request: int | None = None) -> None:
    """Raise the one error format of the library."""
    where = f" (request {request})" if request is not None else ""
    raise ValidationError(f"{op}: {name}: expected {expected}, got {actual}{where}")


def as_integer(value: object, one_value_tensors: bool = False) -> int | None:
    """``value`` as a Python int where it is one integer (an int, a NumPy integer, a 0-d integer tensor, or with
    ``one_value_tensors`` an integer tensor of one value of any rank: what ``operator.index`` takes), never a bool;
    else None."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, Tensor) and (
            value.dtype == torch.bool or value.dim() and not one_value_tensors):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_integer(op: str, name: str, value: object, low: int | None = None) -> int:
    """``value`` (see :func:`as_integer`) as an int, at least ``low`` where given; else a ValueError naming ``name``."""
    n = as_integer(value)
    if n is None or low is not None and n < low:
        fail(op, name, "an int" if low is None else f"an int >= {low}", repr(value))
    return n


def check_mode(op: str, validate: str) -> bool:
    """Check ``validate`` and return True for ``"full"``."""
    if validate not in MODES:
        fail(op, "validate", f"one of {MODES}", repr(validate))
    return validate == "full"


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_tensor(op: str, name: str, t: object, *, kind: str, ndim: int | tuple[int, int] | None = None) -> Tensor:
    """Check that ``t`` is a tensor of dtype kind ``"float"``, ``"int"`` or ``"bool"`` and rank ``ndim``.

    ``ndim`` is an exact rank or an inclusive ``(min, max)`` range.
    """
    if not isinstance(t, Tensor):
        fail(op, name, f"a torch.Tensor ({kind})", type(t).__name__)
    ok = {
        "float": t.dtype.is_floating_point,
        "int": not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool,
        "bool": t.dtype == torch.bool,
    }[kind]
    if not ok:
        want = {"float": "a floating-point tensor", "int": "an integer tensor", "bool": "a bool tensor"}[kind]
        fail(op, name, want, t.dtype)
    if ndim is not None:
        lo, hi = (ndim, ndim) if isinstance(ndim, int) else ndim
        if not lo <= t.dim() <= hi:
            want = f"{lo} dimensions" if lo == hi else f"{lo} to {hi} dimensions"
            fail(op, name, want, f"shape {shape_str(t.shape)}")
    return t


def check_readable(op: str, name: str, t: Tensor) -> None:
    """An op's main input (the one whose device the others must share) holds values: not on the 'meta' device,
    whose tensors are shapes only (reading them raised torch's errors, or an op returned a meta "result")."""
    if t.device.type == "meta":
        fail(op, name, "a tensor holding values", "a tensor on the 'meta' device")


def check_shape(op: str, name: str, t: Tensor, expected: Sequence[int], dims: str) -> None:
    """Check ``t.shape == expected``; ``dims`` names the dimensions, e.g. ``"[B, K+1, V]"``."""
    if tuple(t.shape) != tuple(int(e) for e in expected):
        fail(op, name, f"shape {dims} = {shape_str(expected)}", shape_str(t.shape))


def check_device(op: str, name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        fail(op, name, f"a tensor on {device} (the device of the first input)", f"one on {t.device}")


def check_host_or(op: str, name: str, t: Tensor, device: torch.device) -> None:
    """Check that ``t`` (a parameter or key the op copies to ``device``) is on ``device`` or the CPU."""
    if t.device != device and t.device.type != "cpu":
        fail(op, name, f"a tensor on {device} (the device of the first input) or the CPU", f"one on {t.device}")


def values_checkable(t: Tensor, full: bool) -> bool:
    """Whether value checks run for ``t``: always in full mode, otherwise only where free: on the CPU, and not
    while ``torch.compile`` traces (a check's branch on values would break the graph there)."""
    return full or (t.device.type == "cpu" and not torch.compiler.is_compiling())


def first_request(bad: Tensor) -> int | None:
    """Index of the first request (dim 0) in which ``bad`` is True anywhere, or None."""
    if bad.numel() == 0:
        return None
    if bad.dim() == 0:  # one value for every request: the first is the first offending
        return 0 if bool(bad) else None
    per_request = bad.reshape(bad.shape[0], -1).any(dim=1) if bad.dim() > 1 else bad
    idx = torch.nonzero(per_request)
    return int(idx[0, 0]) if idx.numel() else None


def check_no_bad(op: str, name: str, bad: Tensor, values: Tensor, expected: str) -> None:
    """Fail on the first True of ``bad`` (same shape as ``values``), quoting the offending value."""
    if bad.dim() == 0:  # a 0-d value (e.g. a parameter given as a scalar tensor) serves every request
        if bool(bad):
            fail(op, name, expected, values.item())
        return
    b = first_request(bad)
    if b is None:
        return
    at = torch.nonzero(bad[b])[0].tolist()  # the first offending index inside the request (row-major)
    pos = "" if values.dim() <= 1 else f" at index {at}"
    fail(op, name, expected, f"{values[b][tuple(at)].item()}{pos}", request=b)


def check_probs_values(op: str, name: str, probs: Tensor, whole_rows: bool = True) -> None:
    """Probabilities: finite, >= 0, and each distribution (last dim) with a positive sum that float32 holds
    (finite values can sum past its largest: no such row can be normalised). ``whole_rows=False``: the values only
    (a vocabulary shard's columns, whose sums say nothing of their rows')."""
    p = probs.float()
    check_no_bad(op, name, ~torch.isfinite(p), p, "finite probabilities")
    check_no_bad(op, name, p < 0, p, "probabilities >= 0")
    if not whole_rows:
        return
    sums = p.sum(-1)
    check_no_bad(op, f"{name} (row sum)", ~((sums > 0) & torch.isfinite(sums)), sums,
                 "each distribution to have a positive sum (finite in float32)")


def check_logits_values(op: str, name: str, logits: Tensor) -> None:
    """Logits: no NaN and no +inf (-inf is a masked token)."""
    x = logits.float()
    check_no_bad(op, name, torch.isnan(x) | (x == float("inf")), x, "logits without NaN or +inf")


def check_token_values(op: str, name: str, tokens: Tensor, vocab_size: int, allow_pad: bool = False) -> None:
    """Token ids in [0, V) (or -1 where ``allow_pad``)."""
    lo = -1 if allow_pad else 0
    bad = (tokens < lo) | (tokens >= vocab_size)
    want = f"token ids in [0, {vocab_size})" + (" or -1" if allow_pad else "")
    check_no_bad(op, name, bad, tokens, want)


def check_method(op: str, method: str, methods: tuple[str, ...], sampled: tuple[str, ...], draft_probs: object,
                 shape: tuple[int, ...], dims: str, device) -> tuple[str, Tensor | None]:
    """Resolve ``method`` (``"auto"``: the first of ``sampled`` with draft_probs, else
    ``"target_only"``) and check ``draft_probs`` against it: required (``shape``, float, on
    ``device``) by the ``sampled`` methods, None for ``target_only``. Returns the method and
    the draft probabilities as float32 (or None)."""
    if method not in (*methods, "auto"):
        fail(op, "method", f"one of {('auto', *methods)}", repr(method))
    if method == "auto":
        method = sampled[0] if draft_probs is not None else "target_only"
    if method in sampled and draft_probs is None:
        fail(op, "draft_probs", f"a tensor {dims} for method {method!r}", "None")
    if method == "target_only" and draft_probs is not None:
        fail(op, "draft_probs", "None for method 'target_only' (drafts chosen deterministically)", "a tensor")
    if draft_probs is None:
        return method, None
    check_tensor(op, "draft_probs", draft_probs, kind="float", ndim=len(shape))
    check_shape(op, "draft_probs", draft_probs, shape, dims)
    check_device(op, "draft_probs", draft_probs, device)
    return method, draft_probs.float()
