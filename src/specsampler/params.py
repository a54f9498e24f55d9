"""Per-request sampling parameters, broadcast to the rows they apply to."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import constants
from .validation import check_host_or, check_no_bad, check_shape, check_tensor, fail, values_checkable


def _within(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False):
    """The test of a value against ``[lo, hi]`` (ends open as asked): on a float, or elementwise on a tensor (NaN is
    outside either way)."""
    return lambda v: ((v > lo) if lo_open else (v >= lo)) & ((v < hi) if hi_open else (v <= hi))


# each float field's range, tested on a tensor's values and on a scalar as the float32 it becomes
_WITHIN = {"temperature": _within(0, math.inf, hi_open=True), "top_p": _within(0, 1, lo_open=True),
           "min_p": _within(0, 1)}

# name -> (dtype kind, dtype, rule for bad values, what is expected)
_FIELDS = {
    "temperature": ("float", torch.float32, lambda v: ~_WITHIN["temperature"](v), "a finite value >= 0"),
    "top_k": ("int", torch.int64, None, "an integer"),
    "top_p": ("float", torch.float32, lambda v: ~_WITHIN["top_p"](v), "a value in (0, 1]"),
    "min_p": ("float", torch.float32, lambda v: ~_WITHIN["min_p"](v), "a value in [0, 1]"),
}


# the least positive temperature used: below it (subnormal) log2(e) / T overflows float32, and every weight would be
# NaN; at it the weights are 1 at the row's largest logit and 0 elsewhere, the limit of T -> 0+
MIN_TEMPERATURE = 2.0**-126
_INT64 = (-(2**63), 2**63 - 1)
_FLOAT32_MAX = float.fromhex("0x1.fffffep127")


def _float32(v: float) -> float:
    """``v`` rounded to float32 (to nearest, ties to even; inf past its range), as ``torch.tensor(float(v))`` holds
    it, in Python's float arithmetic: a tensor per check cost ~40 us a SamplingParams, and NumPy's ``errstate`` does
    not trace under torch.compile."""
    if not math.isfinite(v) or v == 0:
        return v
    # float32's step at v: 24 significant bits, none below 2**-149 (its subnormals); v / step is exact (a power of two)
    step = math.ldexp(1.0, max(math.frexp(v)[1], -125) - 24)
    r = math.copysign(round(v / step) * step, v)  # round(): ties to even
    return r if abs(r) <= _FLOAT32_MAX else math.copysign(math.inf, v)


def check_field(op: str, label: str, name: str, v):
    """Field ``name`` of :class:`SamplingParams` (errors naming it ``label``) checked as far as it can be without
    reading a tensor's values; returns it as kept (an integer past int64 as its nearer end, which means the same)."""
    kind, _, _, want = _FIELDS[name]
    if isinstance(v, Tensor):
        check_tensor(op, label, v, kind=kind, ndim=(0, 1))
        return v
    # any real number (NumPy's scalars included), not a bool
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        fail(op, label, "a number or a 1-D tensor [B]", repr(v))
    if kind == "int":
        if not float(v).is_integer():
            fail(op, label, "an integer", repr(v))
        return min(max(int(v), _INT64[0]), _INT64[1])  # top-k past int64: off either way; fits the rows' tensors
    big = isinstance(v, numbers.Integral) and abs(int(v)) >= 2**1024  # an integer past float64: off its range
    v = (math.inf if v > 0 else -math.inf) if big else float(v)
    if not math.isfinite(v) or not _WITHIN[name](_float32(v)):
        # a value inside the range may leave it as the float32 every row holds (past 3.4e38: inf; below 1.4e-45: 0)
        held = f" (float32 holds it as {_float32(v)})" if math.isfinite(v) and _WITHIN[name](v) else ""
        fail(op, label, want, f"{v}{held}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is processed from logits; each field a scalar or a 1-D tensor ``[B]``.

    Args:
        temperature: ``>= 0``; ``0`` means greedy (argmax, ties to the lowest id); below ``2**-126`` (subnormal) it
            acts as ``2**-126``: weight 1 at the row's largest logits, 0 elsewhere.
        top_k: keep the ``k`` most likely tokens (ties to the lower id); ``<= 0`` or ``>= V`` is off.
        top_p: in ``(0, 1]``; keep the smallest prefix of the (probability desc, id asc) order,
            on the top-k-renormalised distribution, whose mass reaches ``top_p``; ``1`` is off.
        min_p: in ``[0, 1]``; keep tokens with probability ``>= min_p * max probability``.

    Order of application (docs/design.md, "Sampling"): vocab mask, temperature, top-k, top-p, min-p,
    renormalise. "Order" means logit desc, id asc: the order of the probabilities, with ties
    broken by the lower id.

    Scalars are checked here; tensors are checked when used (their values only where that
    costs no device sync, or with ``validate="full"``). A tensor is on the inputs' device or the CPU (copied).
    """

    temperature: float | Tensor = 1.0
    top_k: int | Tensor = 0
    top_p: float | Tensor = 1.0
    min_p: float | Tensor = 0.0

    def __post_init__(self):
        for name in _FIELDS:
            v = check_field("SamplingParams", f"SamplingParams.{name}", name, getattr(self, name))
            object.__setattr__(self, name, v)

    def rows(self, op: str, batch: int, per_request: int, device: torch.device, full: bool,
             label: str = "SamplingParams.") -> RowParams:
        """The parameters of each of ``batch * per_request`` rows (request-major), validated (a field's errors name
        it ``label + name``). A parameter given as a scalar is a tensor shared by every call
        (:mod:`specsampler.constants`): read it, never write to it."""
        out = {}
        for name, (_, dtype, bad, want) in _FIELDS.items():
            v = getattr(self, name)
            full_name = label + name
            if isinstance(v, Tensor):
                if v.dim() == 1:
                    check_shape(op, full_name, v, (batch,), "[B]")
                check_host_or(op, full_name, v, device)
                if bad is not None and values_checkable(v, full):
                    check_no_bad(op, full_name, bad(v.to(dtype)), v, want)
                rows = v.to(device=device, dtype=dtype).expand(batch)
                if name == "temperature":  # positive as given, as a scalar is: float64 holds some float32 rounds to 0
                    positive = v.to(device) > 0
                    rows = torch.where(positive & (rows < MIN_TEMPERATURE), MIN_TEMPERATURE, rows)
                out[name] = rows.repeat_interleave(per_request) if per_request != 1 else rows.contiguous()
            else:  # made once per (value, rows, device): no launch per call on a GPU
                if name == "temperature" and 0 < v < MIN_TEMPERATURE:
                    v = MIN_TEMPERATURE
                out[name] = constants.full(batch * per_request, v, dtype, device)
        scalars = not any(isinstance(getattr(self, name), Tensor) for name in _FIELDS)
        return RowParams(**out, shared=self if scalars else None)


@dataclass(frozen=True)
class RowParams:
    """Parameters per row ``[R]``: temperature float32, top_k int64, top_p float32, min_p float32.

    shared: the parameters of every row as host numbers, when they were given as scalars (so
    that processing picks its path without reading the tensors); None when rows may differ.
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    shared: SamplingParams | None = None

    def take(self, rows: Tensor) -> RowParams:
        """The parameters of a subset of rows (int64 indices); views of one row's when ``shared``."""
        fields = (self.temperature, self.top_k, self.top_p, self.min_p)
        if self.shared is not None and self.temperature.numel():
            return RowParams(*(f[:1].expand(rows.numel()) for f in fields), self.shared)
        return RowParams(*(f[rows] for f in fields), self.shared)

    def all_equal(self, name: str, value: float) -> bool:
        """Whether every row's parameter ``name`` is ``value`` (from ``shared`` when known, else
        read from the tensor: a device sync)."""
        if self.shared is not None:
            return getattr(self.shared, name) == value
        return bool((getattr(self, name) == value).all())
