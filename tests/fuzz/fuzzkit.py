"""The fuzz suite's kit: hypothesis profiles, back ends, guards, and the error policy's contract.

The contract (docs/design.md, "Error policy") checked on every example:

- the call raises a ``ValueError`` whose message names the op, the argument, what was expected and
  what was found (and, for a bad value, the request), or returns outputs in range (token ids in
  ``[0, V)`` or ``-1``; paths that are paths of the tree; counts consistent with the tokens);
- every input is bit for bit what it was before the call;
- the call ends: a hypothesis ``deadline`` per example and a hard wall-clock guard (SIGALRM);
- with ``validate="full"``, each bad value class (NaN, +-inf, negative probabilities, a distribution
  without mass, ids out of range, a row with no allowed token) in a value that is read raises.

Sizes: CI runs few examples, derandomized when ``CI`` is set (reproducible); ``SPECSAMPLER_FULL_FUZZ=1``
runs ``FULL_FACTOR`` times as many, randomized. Kernels run in the Triton interpreter on CPU tensors
(``SPECSAMPLER_BACKEND=triton``), under :func:`bounds_checked`: every load and store of every launch
must fall inside a tensor argument of that launch.

Bulk values come from a ``torch.Generator`` seeded by hypothesis; hypothesis draws the structure (shapes,
dtypes, which value class lands where), so failures shrink to small shapes and single corruptions.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specsampler as ss

FULL = os.environ.get("SPECSAMPLER_FULL_FUZZ") == "1"
CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
FULL_FACTOR = 20  # examples per test at full size, relative to CI's
BACKENDS = ("torch", "triton")
DEADLINE_MS = {"torch": 20_000, "triton": 120_000}  # per example; generous: the machine is shared
HARD_LIMIT_S = {"torch": 60, "triton": 300}  # the guard against a hang, per example

settings.register_profile(
    "specsampler-fuzz",
    derandomize=CI,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("specsampler-fuzz-full", parent=settings.get_profile("specsampler-fuzz"), derandomize=False)
PROFILE = settings.get_profile("specsampler-fuzz-full" if FULL else "specsampler-fuzz")

# Examples run per (test, back end), recorded for the README's figures (docs/error-policy.md).
EXAMPLES_RUN: dict[str, int] = {}


class _Report:
    """Shows :data:`EXAMPLES_RUN` at the end of a run in one process (``-n 0``; pytest-xdist workers keep
    their own counts). A plugin registered by :func:`fuzz_report`, not a conftest: tests import
    ``conftest`` by name, and a second one on the path would shadow theirs."""

    def pytest_terminal_summary(self, terminalreporter):
        if not EXAMPLES_RUN:
            return
        terminalreporter.section(f"fuzz examples run ({'full size' if FULL else 'CI size'})")
        for name, count in sorted(EXAMPLES_RUN.items()):
            terminalreporter.write_line(f"{name:48s} {count:7d}")
        terminalreporter.write_line(f"{'total':48s} {sum(EXAMPLES_RUN.values()):7d}")


@pytest.fixture(autouse=True, scope="session")
def fuzz_report(pytestconfig):
    """Import into a test module to report its examples (autouse)."""
    if not pytestconfig.pluginmanager.has_plugin("specsampler-fuzz-report"):
        pytestconfig.pluginmanager.register(_Report(), "specsampler-fuzz-report")


def examples(torch_n: int, triton_n: int, backend: str) -> int:
    """Examples for one test on one back end: CI's count, or ``FULL_FACTOR`` times it."""
    n = torch_n if backend == "torch" else triton_n
    return n * FULL_FACTOR if FULL else n


def fuzz(name: str, backend: str, strategy: st.SearchStrategy, body: Callable, *, n: tuple[int, int]) -> None:
    """Run ``body(case)`` on ``examples(*n, backend)`` cases drawn from ``strategy``, on ``backend``,
    each under the deadline, the hard guard and (kernels) the bounds check."""

    def run(case):
        EXAMPLES_RUN[f"{name}[{backend}]"] = EXAMPLES_RUN.get(f"{name}[{backend}]", 0) + 1
        torch.manual_seed(0)  # rng=None draws from the global generator: the same numbers when an example reruns
        with use_backend(backend), hard_limit(HARD_LIMIT_S[backend]), bounds_checked(backend == "triton"):
            body(case)

    run.__name__ = run.__qualname__ = re.sub(r"\W", "_", f"{name}_{backend}")  # its own derandomized seed
    test = settings(PROFILE, max_examples=examples(*n, backend), deadline=DEADLINE_MS[backend])(given(strategy)(run))
    test()


# ----------------------------------------------------------------------------- back ends and guards


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """``SPECSAMPLER_BACKEND=name`` for the block (``triton`` on CPU tensors: the interpreter)."""
    old = os.environ.get("SPECSAMPLER_BACKEND")
    os.environ["SPECSAMPLER_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["SPECSAMPLER_BACKEND"]
        else:
            os.environ["SPECSAMPLER_BACKEND"] = old


class Hung(Exception):
    """An op ran past the hard guard (raised by SIGALRM in the main thread)."""


@contextlib.contextmanager
def hard_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`Hung` if the block runs longer than ``seconds`` (main thread only: elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def alarm(signum, frame):
        raise Hung(f"no result after {seconds} s: an op hangs")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class OutOfBounds(AssertionError):
    """A kernel loaded or stored outside every tensor argument of its launch."""


_allowed: list[list[tuple[int, int, str]]] = []  # per active launch: (first byte, end byte, argument)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a strided tensor spans: [first, end)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st > 0)
    first = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st < 0)
    size = t.element_size()
    return t.data_ptr() + first * size, t.data_ptr() + (last + 1) * size


@contextlib.contextmanager
def bounds_checked(on: bool = True) -> Iterator[None]:
    """Check, in the Triton interpreter, that every load and store of a launch in the block falls inside
    a tensor argument of the launch (its strided extent); else :class:`OutOfBounds`."""
    if not on:
        yield
        return
    from triton.runtime import interpreter as interp

    builder, executor = interp.InterpreterBuilder, interp.GridExecutor
    load, store, init_args = builder.create_masked_load, builder.create_masked_store, executor._init_args_hst
    names = {}

    def checked(kind: str, ptrs, mask) -> None:
        if not _allowed:
            return
        addrs = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
        on_lanes = np.broadcast_to(mask.data, addrs.shape)
        addrs = addrs[on_lanes].astype(np.uint64)
        if addrs.size == 0:
            return
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addrs.shape, dtype=bool)
        for lo, hi, _ in _allowed[-1]:
            inside |= (addrs >= np.uint64(lo)) & (addrs + np.uint64(size) <= np.uint64(hi))
        if not inside.all():
            bad = int(addrs[~inside][0])
            near = min(_allowed[-1], key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])))
            raise OutOfBounds(f"{names.get('kernel', 'a kernel')}: {kind} of {size} bytes at {bad:#x}, outside "
                              f"every tensor argument (nearest: {near[2]} at [{near[0]:#x}, {near[1]:#x}))")

    # the interpreter's further parameters (cache and eviction policies, volatility) differ between Triton releases
    def masked_load(self, ptrs, mask, *rest):
        checked("load", ptrs, mask)
        return load(self, ptrs, mask, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        checked("store", ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges = []
        arg_names = list(self.arg_names)
        for i, a in enumerate([*args_hst, *kwargs_hst.values()]):
            t = getattr(a, "base", a)  # TensorWrapper
            if isinstance(t, torch.Tensor):
                lo, hi = _extent(t)
                ranges.append((lo, hi, arg_names[i] if i < len(arg_names) else f"argument {i}"))
        _allowed.append(ranges)
        names["kernel"] = getattr(self.fn, "__name__", "a kernel")
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        try:
            return executor_call(self, *args, **kwargs)
        finally:
            if _allowed:
                _allowed.pop()

    executor_call = executor.__call__
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    executor._init_args_hst, executor.__call__ = init_args_hst, call
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        executor._init_args_hst, executor.__call__ = init_args, executor_call
        _allowed.clear()


# ----------------------------------------------------------------------------- the contract

MESSAGE = re.compile(r"^(?P<op>[\w.\[\]]+): (?P<arg>.+?): expected (?P<expected>.+), got (?P<actual>.+)$", re.S)


def check_message(err: BaseException, *, value_error: bool = False) -> None:
    """``err`` is a ValidationError naming op, argument, expected and actual (and, for a bad value
    in a batched tensor, the request)."""
    assert isinstance(err, ss.ValidationError), f"{type(err).__name__} instead of a ValidationError: {err}"
    m = MESSAGE.match(str(err))
    assert m, f"message not in the form 'op: argument: expected ..., got ...': {err}"
    if value_error:
        assert "(request " in str(err) or "[" in m["arg"], f"a bad value's message without its request: {err}"


def snapshot(values: Sequence) -> list:
    """Copies of every tensor among ``values`` (nested in lists, tuples and dicts), to compare after a call."""
    return [(t, t.detach().clone()) for t in tensors_in(values)]


def tensors_in(values) -> Iterator[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, dict):
        for v in values.values():
            yield from tensors_in(v)
    elif isinstance(values, (list, tuple)):
        for v in values:
            yield from tensors_in(v)
    elif isinstance(values, ss.SamplingParams):
        yield from tensors_in([values.temperature, values.top_k, values.top_p, values.min_p])
    elif isinstance(values, ss.Philox):
        yield from tensors_in([values.seed, values.offset])
    elif isinstance(values, ss.TokenTree):
        yield from tensors_in([values.parents, values.first_child, values.next_sibling, values.depth])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_unchanged(snap: list) -> None:
    for t, before in snap:
        assert t.shape == before.shape and t.dtype == before.dtype, "an input's shape or dtype changed"
        assert torch.equal(bits(t), bits(before)), f"an input {tuple(t.shape)} {t.dtype} was modified by the call"


@dataclass
class Outcome:
    """What a call did: its result, or the ValueError it raised."""

    result: object = None
    error: ValueError | None = None


def call_contract(fn: Callable[[], object], inputs: Sequence, *, must_raise: bool = False, must_pass: bool = False,
                  value_error: bool = False) -> Outcome:
    """Call ``fn``; a ValueError must be a well-formed ValidationError; ``inputs`` must be unchanged.

    must_raise: a ValueError is required (a bad value under ``validate="full"``; a bad parameter).
    must_pass: a ValueError is a false rejection (every input is valid).
    value_error: the expected error is about a value (its message must name the request).
    """
    snap = snapshot(inputs)
    try:
        out = Outcome(result=fn())
    except ValueError as err:
        check_message(err, value_error=value_error and must_raise)
        assert not must_pass, f"valid inputs rejected: {err}"
        out = Outcome(error=err)
    else:
        assert not must_raise, "no ValueError for a bad input (a bad parameter, or a bad value under validate='full')"
    assert_unchanged(snap)
    return out


# ----------------------------------------------------------------------------- values

PROB_CLASSES = ("clean", "clean", "clean", "unnormalised", "huge", "tiny", "zero_row", "nan", "inf", "-inf",
                "negative")
LOGIT_CLASSES = ("clean", "clean", "clean", "masked", "masked_row", "huge", "nan", "inf")
BAD_PROB = {"zero_row", "nan", "inf", "-inf", "negative"}  # what validate="full" rejects in probabilities
BAD_LOGIT = {"nan", "inf"}  # in logits (-inf masks a token)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class Values:
    """How a float tensor is made: seed, dtype, value class and where it lands."""

    seed: int
    dtype: torch.dtype
    kind: str
    where: str  # "one" (one entry), "some" (a random subset), "row" (a whole last-dim row), "all"
    layout: str = "contiguous"  # or "strided" (rows inside wider rows of NaN), "swapped" (dims 0 and 1 in memory)


LAYOUTS = ("contiguous", "contiguous", "strided", "swapped")


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another memory layout: a view into a wider buffer padded with NaN (a kernel reading
    past a row reads NaN), or with the first two dims swapped in memory."""
    if layout == "strided" and t.dim():
        buf = torch.full((*t.shape[:-1], t.shape[-1] + 3), float("nan"), dtype=t.dtype)
        buf[..., 1 : t.shape[-1] + 1] = t
        return buf[..., 1 : t.shape[-1] + 1]
    if layout == "swapped" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


def values_strategy(classes: Sequence[str], dtypes: Sequence[torch.dtype] = (torch.float32,)) -> st.SearchStrategy:
    return st.builds(Values, st.integers(0, 2**31 - 1), st.sampled_from(dtypes), st.sampled_from(classes),
                     st.sampled_from(("one", "some", "row", "all")), st.sampled_from(LAYOUTS))


def garbage_strategy(classes: Sequence[str], dtypes: Sequence[torch.dtype] = (torch.float32,)) -> st.SearchStrategy:
    """Values of a bad (or extreme) class only, over much of the tensor: for examples that hunt for
    out-of-range outputs rather than for rejections."""
    bad = [c for c in classes if c not in ("clean", "unnormalised", "masked")]
    return st.builds(Values, st.integers(0, 2**31 - 1), st.sampled_from(dtypes), st.sampled_from(bad),
                     st.sampled_from(("some", "row", "all")), st.sampled_from(LAYOUTS))


def _where(g: torch.Generator, shape: tuple[int, ...], where: str) -> torch.Tensor:
    """A bool mask of the entries a value class lands on (at least one entry when there are any)."""
    n = math.prod(shape)
    out = torch.zeros(n, dtype=torch.bool)
    if n == 0:
        return out.view(shape)
    if where == "all":
        return torch.ones(shape, dtype=torch.bool)
    if where == "one":
        out[int(torch.randint(n, (1,), generator=g))] = True
    elif where == "some":
        out = torch.rand(n, generator=g) < 0.3
        out[int(torch.randint(n, (1,), generator=g))] = True
    else:
        V = shape[-1]
        row = int(torch.randint(n // V, (1,), generator=g))
        out[row * V : (row + 1) * V] = True
    return out.view(shape)


def make_probs(v: Values, shape: tuple[int, ...]) -> torch.Tensor:
    """Probabilities of ``shape`` (distributions over the last dim, some sparse) with ``v.kind`` applied."""
    g = torch.Generator().manual_seed(v.seed)
    p = torch.rand(shape, generator=g) ** 3
    p = torch.where(torch.rand(shape, generator=g) < 0.3, 0.0, p)
    if p.numel():  # at least one token of mass per row
        first = torch.randint(shape[-1], (*shape[:-1], 1), generator=g)
        p.scatter_(-1, first, 0.5)
    p = p / p.sum(-1, keepdim=True)
    at = _where(g, shape, v.where)
    big = torch.finfo(v.dtype).max
    if v.kind == "unnormalised":
        p = p * float(torch.tensor([1e-30, 1e-3, 7.0, 1e30])[int(torch.randint(4, (1,), generator=g))])
    elif v.kind == "tiny":
        p = torch.where(p > 0, torch.finfo(torch.float32).tiny / 4, 0.0)  # denormals
    elif v.kind == "zero_row":
        p = p.masked_fill(_where(g, shape, "row"), 0.0)
    p = p.to(v.dtype)
    fill = {"huge": big, "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "negative": -0.25}
    if v.kind in fill:
        p = p.masked_fill(at, fill[v.kind])
    return relayout(p, v.layout)


def make_logits(v: Values, shape: tuple[int, ...]) -> torch.Tensor:
    """Logits of ``shape`` (some ties) with ``v.kind`` applied."""
    g = torch.Generator().manual_seed(v.seed)
    x = torch.randn(shape, generator=g) * 3
    x = torch.where(torch.rand(shape, generator=g) < 0.2, x.round(), x)  # ties
    x = x.to(v.dtype)
    at = _where(g, shape, v.where)
    big = torch.finfo(v.dtype).max
    if v.kind == "masked":
        x = x.masked_fill(at, float("-inf"))
    elif v.kind == "masked_row":
        x = x.masked_fill(_where(g, shape, "row"), float("-inf"))
    elif v.kind == "huge":
        x = torch.where(at, torch.where(torch.rand(shape, generator=g) < 0.5, big, -big).to(v.dtype), x)
    elif v.kind in ("nan", "inf"):
        x = x.masked_fill(at, float(v.kind))
    return relayout(x, v.layout)


def bad_probs(p: torch.Tensor, live: torch.Tensor | None = None) -> bool:
    """Whether validate="full" must reject probabilities ``p``: a non-finite or negative entry, or a row
    without mass or whose sum overflows float32, among the rows where ``live`` (``p.shape[:-1]``) is True."""
    x = p.float()
    sums = x.sum(-1)
    rows = (~torch.isfinite(x) | (x < 0)).any(-1) | ~(sums > 0) | ~torch.isfinite(sums)
    return bool((rows if live is None else rows & live).any())


def bad_logits(x: torch.Tensor, live: torch.Tensor | None = None) -> bool:
    """Whether validate="full" must reject logits ``x``: a NaN or +inf among the live rows."""
    f = x.float()
    rows = (f.isnan() | (f == float("inf"))).any(-1)
    return bool((rows if live is None else rows & live).any())


@dataclass(frozen=True)
class Ids:
    seed: int
    dtype: torch.dtype
    bad: str  # "none", or where out-of-range ids land: "one" / "some"


def ids_strategy(garbage: bool = False) -> st.SearchStrategy:
    where = ("some", "all") if garbage else ("none", "none", "one", "some")
    return st.builds(Ids, st.integers(0, 2**31 - 1), st.sampled_from(INT_DTYPES), st.sampled_from(where))


def make_ids(i: Ids, shape: tuple[int, ...], V: int) -> torch.Tensor:
    """Token ids in ``[0, V)``, with out-of-range ids (negative, ``V``, beyond, the dtype's extremes) at ``i.bad``."""
    g = torch.Generator().manual_seed(i.seed)
    x = torch.randint(V, shape, generator=g)
    if i.bad != "none" and x.numel():
        at = _where(g, shape, i.bad)
        info = torch.iinfo(i.dtype)
        choices = torch.tensor([-1, -2, V, V + 1, 2 * V + 7, info.min, info.max])
        x = torch.where(at, choices[torch.randint(len(choices), shape, generator=g)], x)
    return x.to(i.dtype)


# ----------------------------------------------------------------------------- sampling parameters

GOOD_PARAMS = {
    "temperature": (1.0, 0.0, 0.5, 2.0, 1e-4),
    "top_k": (0, 1, 2, 3, -1, 10**6),
    "top_p": (1.0, 0.9, 0.5, 1e-6),
    "min_p": (0.0, 0.1, 0.5, 1.0),
}
BAD_PARAMS = {"temperature": (-1.0, float("nan"), float("inf")), "top_p": (0.0, 1.5, float("nan"), -0.1),
              "min_p": (-0.1, 1.5, float("nan"))}


@dataclass(frozen=True)
class Params:
    """Sampling parameters: per field a value per request (``None``: the default), scalar or tensor form."""

    values: dict
    form: dict  # field -> "scalar" | "tensor" | "0-d"
    bad: bool


@st.composite
def params_strategy(draw, B: int, allow_bad: bool = True) -> Params:
    values, form, bad = {}, {}, False
    for name, good in GOOD_PARAMS.items():
        if not draw(st.booleans()):
            continue
        f = draw(st.sampled_from(("scalar", "tensor", "0-d")))
        n = B if f == "tensor" else 1
        pool = good + (BAD_PARAMS.get(name, ()) if allow_bad and draw(st.integers(0, 5)) == 0 else ())
        vals = [draw(st.sampled_from(pool)) for _ in range(n)]
        bad |= any(v not in good for v in vals)  # NaN is in no pool of good values
        values[name], form[name] = vals, f
    return Params(values, form, bad)


def build_params(p: Params) -> ss.SamplingParams:
    """The :class:`SamplingParams` (raises ValidationError for a bad scalar, as the op would)."""
    kw = {}
    for name, vals in p.values.items():
        dtype = torch.int64 if name == "top_k" else torch.float32
        if p.form[name] == "scalar":
            kw[name] = vals[0]
        elif p.form[name] == "0-d":
            kw[name] = torch.tensor(vals[0], dtype=dtype)
        else:
            kw[name] = torch.tensor(vals, dtype=dtype)
    return ss.SamplingParams(**kw)


# ----------------------------------------------------------------------------- shapes, rngs, vocab masks


def vocab(backend: str) -> st.SearchStrategy:
    """V down to 1; on the PyTorch path also the sizes where processing changes strategy."""
    big = (64, 300, 1024, 2048, 4096) if backend == "torch" else (64, 130)
    return st.one_of(st.integers(1, 9), st.sampled_from(big))


@dataclass(frozen=True)
class Rng:
    kind: str  # "none", "generator", "philox", "philox_tensor", "philox_bad_shape", "bad_type"
    seed: int


def rng_strategy() -> st.SearchStrategy:
    kinds = ("none", "generator", "philox", "philox_tensor", "philox_tensor", "philox_bad_shape", "bad_type")
    return st.builds(Rng, st.sampled_from(kinds), st.integers(-(2**63), 2**63 - 1))


def build_rng(r: Rng, B: int):
    if r.kind == "generator":
        return torch.Generator().manual_seed(r.seed % 2**63)
    if r.kind == "philox":
        return ss.Philox(r.seed, offset=3)
    if r.kind == "philox_tensor":
        return ss.Philox(torch.arange(B, dtype=torch.int64) + r.seed % 2**62, torch.arange(B))
    if r.kind == "philox_bad_shape":
        return ss.Philox(torch.zeros(B + 1, dtype=torch.int64))
    if r.kind == "bad_type":
        return r.seed
    return None


@dataclass(frozen=True)
class Mask:
    kind: str  # "none", "full", "vocab", "empty_row", "bad_dtype", "bad_shape"
    seed: int


def mask_strategy() -> st.SearchStrategy:
    return st.builds(Mask, st.sampled_from(("none", "none", "full", "vocab", "empty_row", "bad_dtype", "bad_shape")),
                     st.integers(0, 2**31 - 1))


def build_mask(m: Mask, shape: tuple[int, ...]) -> torch.Tensor | None:
    if m.kind == "none":
        return None
    g = torch.Generator().manual_seed(m.seed)
    V = shape[-1]
    if m.kind == "vocab":
        mask = torch.rand(V, generator=g) < 0.7
        mask[int(torch.randint(V, (1,), generator=g))] = True
        return mask
    if m.kind == "bad_shape":
        return torch.ones(V + 1, dtype=torch.bool)
    mask = torch.rand(shape, generator=g) < 0.7
    if mask.numel():
        mask.scatter_(-1, torch.randint(V, (*shape[:-1], 1), generator=g), True)
        if m.kind == "empty_row":
            mask.view(-1, V)[int(torch.randint(mask.numel() // V, (1,), generator=g))] = False
    return mask.to(torch.uint8) if m.kind == "bad_dtype" else mask


def mask_is_structurally_bad(m: Mask, shape) -> bool:
    return m.kind in ("bad_dtype", "bad_shape")


def mask_has_empty_row(mask: torch.Tensor | None, shape, live: torch.Tensor | None = None) -> bool:
    """Whether a (well-formed) vocab mask leaves some row (where ``live``) without an allowed token."""
    if mask is None or mask.dtype != torch.bool or mask.shape[-1] != shape[-1]:
        return False
    empty = ~mask.expand(shape).any(-1)
    return bool((empty if live is None else empty & live).any())



# ----------------------------------------------------------------------------- trees


@st.composite
def parents_strategy(draw, B: int, N: int) -> list[list[int]]:
    """Valid parent arrays ``[B][N]``: node 0 the root, ``0 <= parent < i`` or -1 (absent); children of an
    absent node are absent. Shrinks towards chains (parent i - 1)."""
    rows = []
    for _ in range(B):
        row = [-1]
        for i in range(1, N):
            back = draw(st.integers(0, i))  # 0 -> parent i-1 (a chain), i -> absent
            p = i - 1 - back if back < i else -1
            if p > 0 and row[p] == -1:
                p = -1
            row.append(p)
        rows.append(row)
    return rows


def tree_from(rows: list[list[int]], how: str) -> ss.TokenTree:
    """The tree of parent arrays, built by ``how``: "parents", "links" (first child / next sibling) or "mask"."""
    ref = ss.TokenTree.from_parents(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1))
    if how == "links":
        return ss.TokenTree.from_first_child_next_sibling(ref.first_child, ref.next_sibling)
    if how == "mask":
        return ss.TokenTree.from_mask(ref.mask())
    return ref


# ----------------------------------------------------------------------------- output checks


def assert_ids(t: torch.Tensor, V: int, *, pad: bool, what: str) -> None:
    assert t.dtype == torch.int64, f"{what}: dtype {t.dtype}, expected int64"
    lo = -1 if pad else 0
    bad = (t < lo) | (t >= V)
    assert not bool(bad.any()), f"{what}: ids outside [{lo}, {V}): {t[bad][:8].tolist()}"


def check_chain_result(res, draft_tokens: torch.Tensor, num_drafts: torch.Tensor | None, V: int) -> None:
    """Tokens ``[B, K+1]``: the first ``n`` drafts (in range), one token in ``[0, V)``, then -1; ``n`` in
    ``[0, num_drafts]``; ``expected_accepted`` computable, ``[B]``."""
    B, K = draft_tokens.shape
    tok, n = res.tokens, res.num_accepted
    assert tok.shape == (B, K + 1) and n.shape == (B,), f"shapes {tuple(tok.shape)}, {tuple(n.shape)}"
    assert n.dtype == torch.int64
    limit = torch.full((B,), K) if num_drafts is None else num_drafts.long().cpu()
    n = n.cpu()
    assert bool(((n >= 0) & (n <= limit)).all()), f"num_accepted {n.tolist()} outside [0, {limit.tolist()}]"
    tok = tok.cpu()
    assert_ids(tok, V, pad=True, what="ChainResult.tokens")
    pos = torch.arange(K + 1)
    drafts = torch.nn.functional.pad(draft_tokens.long().cpu(), (0, 1), value=-1)
    accepted = pos < n[:, None]
    assert torch.equal(tok[accepted], drafts[accepted]), "accepted tokens differ from the drafts"
    assert bool((tok.gather(1, n[:, None]) >= 0).all()), "no correction or bonus token after the accepted drafts"
    assert bool((tok[pos > n[:, None]] == -1).all()), "tokens after the emitted one are not -1"
    exp = res.expected_accepted
    assert exp.shape == (B,)


def check_tree_result(res, tree: ss.TokenTree, draft_tokens: torch.Tensor, V: int) -> None:
    """``path`` a path of the tree from the root, -1 after; tokens the path's drafts, one token in
    ``[0, V)``, -1 after; ``num_accepted`` and ``last_node`` consistent."""
    B, D = tree.batch_size, tree.max_depth
    path, tok, n, last = (t.cpu() for t in (res.path, res.tokens, res.num_accepted, res.last_node))
    assert path.shape == (B, D + 1) and tok.shape == (B, D + 1) and n.shape == (B,) and last.shape == (B,)
    assert path.dtype == torch.int64 and n.dtype == torch.int64 and last.dtype == torch.int64
    assert bool(((n >= 0) & (n <= D)).all()), f"num_accepted {n.tolist()} outside [0, {D}]"
    assert_ids(tok, V, pad=True, what="TreeResult.tokens")
    parents, depth = tree.parents.cpu(), tree.depth.cpu()
    x = draft_tokens.long().cpu()
    for b in range(B):
        k = int(n[b])
        p = path[b].tolist()
        assert p[0] == 0, f"request {b}: path {p} does not start at the root"
        for j in range(1, k + 1):
            node = p[j]
            assert 0 < node < tree.size and depth[b, node] == j and parents[b, node] == p[j - 1], (
                f"request {b}: path {p} is not a path of the tree (parents {parents[b].tolist()})")
            assert tok[b, j - 1] == x[b, node], f"request {b}: token {j - 1} is not node {node}'s draft"
        assert all(v == -1 for v in p[k + 1 :]), f"request {b}: path {p} not -1 after {k} accepted"
        assert tok[b, k] >= 0 and all(v == -1 for v in tok[b, k + 1 :].tolist()), f"request {b}: tokens {tok[b]}"
        assert int(last[b]) == p[k], f"request {b}: last_node {int(last[b])} is not the path's end {p[k]}"
