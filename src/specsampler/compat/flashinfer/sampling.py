"""FlashInfer's sampling API (``flashinfer.sampling``, FlashInfer 0.7.4) on specsampler's ops.

Every function keeps FlashInfer's signature, defaults, output dtypes and tuple returns, and maps onto one
public specsampler op (named in its docstring). What stays as in FlashInfer (dtypes, ``indices``, NaN rows,
parameter, seed and softmax-temperature checks, one seed/offset pair per output) and where it differs (an
output's stream keyed by its seed and offset alone, not its position; exact top-k ties; parameters read at
the input row; no C++ errors): docs/design.md, "Drop-in compatibility per peer", ``compat.flashinfer``.
"""

from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor

from specsampler import (
    Philox,
    SamplingParams,
    logits_to_probs,
    min_p_renorm,
    sample,
    sample_from_logits,
    top_k_renorm,
    top_p_renorm,
    verify_chain,
)
from specsampler.rng import STREAM_ACCEPT, STREAM_SAMPLE, uniform
from specsampler.sampling.filters import masked_logits
from specsampler.validation import ValidationError, check_device, check_shape, check_tensor, fail, values_checkable

__all__ = [
    "chain_speculative_sampling",
    "min_p_sampling_from_probs",
    "sampling_from_logits",
    "sampling_from_probs",
    "softmax",
    "top_k_mask_logits",
    "top_k_renorm_prob",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_prob",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]

Rng = torch.Generator | Philox | None
Seed = int | Tensor | None

_TOP_P_MIN = torch.finfo(torch.float32).tiny  # top_p 0: the prefix reaching any mass is the most likely token
# top_k_mask_logits keeps the top-k set of logits_to_probs at this temperature: a power of two scales the
# logits exactly (their order and ties unchanged) and leaves every kept weight far from underflow.
_ORDER_TEMPERATURE = 2.0**20
_ROWS_PER_INVERSION = 1 << 24  # elements of the float64 cumulative sums inverted at once with ``indices``
# FlashInfer 0.7.4 reads ``top_k_max`` only where its "top_k_first" fast path runs: a bound of at most this k
# on rows of at least this many tokens (outside them it ignores the argument).
_TOP_K_MAX_MAX_K = 256
_TOP_K_MAX_MIN_VOCAB = 65536


# ----------------------------------------------------------------------------- validation and conversion


def _check_param(param: object, rows: int) -> None:
    """FlashInfer's ``check_tensor_param``: a tensor parameter is 1-D with one value per input row."""
    if not isinstance(param, Tensor):
        return
    if param.dim() == 0:
        raise ValidationError("Expected a 1D tensor of shape (batch_size,) or scalar for the sampling parameter, "
                              "but got a 0-dimensional tensor.")
    if param.dim() > 1:
        raise ValidationError("Expected a 1D tensor or scalar for the sampling parameter, "
                              f"but got a {param.dim()}D tensor.")
    if param.size(0) != rows:
        raise ValidationError(f"Sampling parameter tensor batch size mismatch: expected length {rows} to match the "
                              f"reference tensor batch size, but got length {param.size(0)}.")


_SOFTMAX_TEMPERATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _softmax_temperature(logits: Tensor, temperature: object) -> float | Tensor:
    """FlashInfer 0.7.2's checks of ``softmax``'s temperature, in its order and with its messages: None (1),
    a real scalar (not a bool), or a float tensor ``[B]`` on the logits' device; returns it as specsampler's
    ``SamplingParams`` takes it."""
    if temperature is None:
        return 1.0
    if isinstance(temperature, Tensor):
        if temperature.ndim != 1:
            raise ValueError("temperature tensor must be 1D with one value per logits row, "
                             f"got shape {tuple(temperature.shape)}")
        rows = logits.size(0)
        if temperature.size(0) != rows:
            raise ValueError(f"temperature tensor length must equal logits.size(0) ({rows}), "
                             f"got {temperature.size(0)}")
        if temperature.device != logits.device:
            raise ValueError(f"temperature tensor must be on the same device as logits ({logits.device}), "
                             f"got {temperature.device}")
        if temperature.dtype not in _SOFTMAX_TEMPERATURE_DTYPES:
            raise ValueError("temperature tensor must have dtype float16, bfloat16, float32, or float64, "
                             f"got {temperature.dtype}")
        return temperature.float()
    if isinstance(temperature, bool) or not isinstance(temperature, Real):
        raise TypeError("temperature must be None, a real scalar, or a 1D floating-point tensor with one value "
                        "per logits row")
    return float(temperature)


def _top_k(top_k: int | Tensor, rows: int) -> int | Tensor:
    _check_param(top_k, rows)
    return top_k.long() if isinstance(top_k, Tensor) else int(top_k)


def _top_p(top_p: float | Tensor, rows: int) -> float | Tensor:
    _check_param(top_p, rows)
    if isinstance(top_p, Tensor):
        return top_p.float().clamp(_TOP_P_MIN, 1.0)
    return min(max(float(top_p), _TOP_P_MIN), 1.0)


def _top_k_first_bound(top_k: int | Tensor, top_k_max: object, x: Tensor) -> int | Tensor:
    """``top_k`` as FlashInfer 0.7.4's "top_k_first" samples it given ``top_k_max``.

    Where it reads the bound (``top_k`` a tensor ``[U]`` of the ``[U, V]`` input, ``0 < top_k_max <= 256``,
    ``top_k_max < V``, ``V >= 65536``) row k becomes ``min(k, top_k_max)``, with ``k < 0`` ("no top-k") as
    ``top_k_max`` and ``k = 0`` as 1; elsewhere ``top_k`` as given (``top_k_max`` ignored, as FlashInfer).
    """
    V = x.size(-1)
    if (not isinstance(top_k, Tensor) or top_k.shape != (x.size(0),) or top_k_max is None
            or not 0 < top_k_max <= _TOP_K_MAX_MAX_K or top_k_max >= V or V < _TOP_K_MAX_MIN_VOCAB):
        return top_k
    k = top_k.long()
    # its radix top-k selects top_k_max entries and masks each row past its own k, so no row keeps more
    return torch.where(k < 0, top_k_max, k.clamp(1, top_k_max))


def _min_p(min_p: float | Tensor, rows: int) -> float | Tensor:
    _check_param(min_p, rows)
    if isinstance(min_p, Tensor):
        return min_p.float().clamp(0.0, 1.0)
    return min(max(float(min_p), 0.0), 1.0)


def _check_nan(check_nan: bool, x: Tensor, what: str = "probs") -> None:
    if check_nan and bool(torch.isnan(x).any()):
        raise ValueError(f"Input {what} contains NaN.")


def _softmax_has_nan(logits: Tensor) -> bool:
    """Whether ``torch.softmax(logits, -1)`` has a NaN (FlashInfer checks the probabilities it makes)."""
    bad = torch.isnan(logits).any() | (logits == float("inf")).any()
    return bool(bad | (logits == float("-inf")).all(-1).any())


def _rows(op: str, name: str, x: Tensor) -> int:
    """The number of input rows of a FlashInfer ``(batch_size, num_classes)`` tensor."""
    check_tensor(op, name, x, kind="float", ndim=2)
    return x.shape[0]


def _outputs(op: str, indices: Tensor | None, rows: int) -> int:
    """The number of outputs: one per input row, or one per entry of ``indices``."""
    if indices is None:
        return rows
    check_tensor(op, "indices", indices, kind="int", ndim=1)
    if indices.dtype not in (torch.int32, torch.int64):
        fail(op, "indices", "an int32 or int64 tensor", indices.dtype)
    if values_checkable(indices, False):
        bad = (indices < 0) | (indices >= rows)
        if bool(bad.any()):
            fail(op, "indices", f"row indices in [0, {rows})", int(indices[bad][0]))
    return indices.numel()


def _as_int64(v: int | Tensor, batch: int) -> Tensor | int:
    """A seed or offset as specsampler takes it: an int64 tensor ``[batch]`` (uint64 bits kept), or an int."""
    if isinstance(v, Tensor):
        v = v.view(torch.int64) if v.dtype == torch.uint64 else v
        return v.expand(batch)
    return (int(v) + 2**63) % 2**64 - 2**63  # FlashInfer takes a uint64: keep its 64 bits


def _rng(seed: Seed, offset: Seed, generator: torch.Generator | None, device: torch.device, batch: int) -> Rng:
    """FlashInfer's seed/offset rules mapped onto specsampler's ``rng=`` (one stream per output)."""
    if seed is None or offset is None:
        return generator
    if isinstance(seed, Tensor) != isinstance(offset, Tensor):
        raise ValidationError("seed and offset must both be tensors or both be scalars")
    for name, v in (("seed", seed), ("offset", offset)):
        if isinstance(v, Tensor):
            if v.device != device:
                raise ValidationError(f"{name} tensor must be on {device}")
            if v.dtype not in (torch.int64, torch.uint64):
                raise ValidationError(f"{name} tensor must be int64/uint64")
            if v.ndim != 1:
                raise ValidationError(f"{name} tensor must be 1D")
            if v.size(0) not in (1, batch):
                raise ValidationError(f"{name} tensor length must be 1 or {batch}")
    per_row = any(isinstance(v, Tensor) and v.size(0) > 1 for v in (seed, offset))
    seed, offset = _as_int64(seed, batch), _as_int64(offset, batch)
    if not per_row:  # one seed for the call: output i on its own stream, as FlashInfer's curand subsequence i
        position = torch.arange(batch, dtype=torch.int64, device=device) << 32
        seed = torch.as_tensor(seed, dtype=torch.int64, device=device) ^ position
    return Philox(seed, offset)


# ----------------------------------------------------------------------------- drawing


def _positive(probs: Tensor) -> Tensor:
    """float32 probabilities with NaN and negative entries zeroed (FlashInfer never samples them). Rows whose
    least entry is at least 0 (no NaN: it would make that minimum NaN) are returned as they are: two reductions
    instead of a comparison and a select over every value, which cost 10x a reduction on CPU."""
    p = probs.float()
    return p if p.shape[-1] == 0 or bool((p.amin(-1) >= 0).all()) else torch.where(p > 0, p, 0.0)


def _invert_rows(dist: Tensor, rows: Tensor, u: Tensor) -> Tensor:
    """For each output i, the first token of row ``rows[i]`` of ``dist`` whose cumulative probability
    exceeds ``u[i]`` times the row's total: the rule of :func:`specsampler.sample`, without gathering rows.

    Rows are stacked into one sorted float64 sequence (row r's normalised cumulative sums shifted by 2r)
    and every output is located by one binary search; a token of probability 0 adds nothing to the
    cumulative sum and is never found. dist: float32 ``[U, V]``; rows: int64 ``[N]``; u: float32 ``[N]``.
    Returns int64 ``[N]`` in ``[0, V)``.
    """
    U, V = dist.shape
    out = torch.zeros(rows.shape, dtype=torch.int64, device=dist.device)
    step = max(1, _ROWS_PER_INVERSION // V)
    for r0 in range(0, U, step):
        cum = dist[r0 : r0 + step].double().cumsum(-1)
        inf = cum[:, -1] == float("inf")  # a row holding +inf: read as 0 there, as sample reads it (and a NaN
        if bool(inf.any()):  # quotient would leave the stacked sequence unsorted, misplacing other rows' outputs)
            cum[inf] = dist[r0 : r0 + step][inf].double().nan_to_num(posinf=0.0).cumsum(-1)
        cum = torch.where(cum[:, -1:] > 0, cum / cum[:, -1:], 0.0)
        shift = 2.0 * torch.arange(cum.shape[0], dtype=torch.float64, device=dist.device)
        flat = (cum + shift[:, None]).reshape(-1)
        mine = ((rows >= r0) & (rows < r0 + cum.shape[0])).nonzero()[:, 0] if step < U else None
        local = rows - r0 if mine is None else rows[mine] - r0
        pos = torch.searchsorted(flat, 2.0 * local + (u if mine is None else u[mine]).double(), right=True)
        tokens = (pos - local * V).clamp_(0, V - 1)
        if mine is None:
            return tokens
        out[mine] = tokens
    return out


def _draw(op: str, dist: Tensor, indices: Tensor | None, rng: Rng, out_dtype: torch.dtype,
          return_valid: bool) -> Tensor | tuple[Tensor, Tensor]:
    """One token per output from the processed rows ``dist`` (float32 ``[U, V]``, no NaN).

    Without indices: :func:`specsampler.sample` (the kernel on CUDA). With indices: one uniform per
    output (the one ``sample`` would draw for it), inverted on its row.
    """
    # dist holds no NaN: any(dist > 0) is its maximum above 0, one reduction (a comparison costs 10x one on CPU)
    row_valid = dist.amax(-1) > 0 if dist.shape[-1] else torch.zeros(dist.shape[0], dtype=torch.bool,
                                                                        device=dist.device)
    if indices is None:
        tokens, valid = sample(dist, rng), row_valid
    else:
        rows = indices.long()
        u = uniform(rng, op, rows.numel(), 1, STREAM_SAMPLE, dist.device).reshape(-1)
        tokens, valid = _invert_rows(dist, rows, u), row_valid[rows]
    tokens = torch.where(valid, tokens, 0).to(out_dtype)
    return (tokens, valid) if return_valid else tokens


def _out_dtype(indices: Tensor | None) -> torch.dtype:
    return torch.int32 if indices is None else indices.dtype


def _from_probs(op: str, probs: Tensor, filt, indices, generator, check_nan, seed, offset, return_valid):
    """The shared body of the ``*_from_probs`` functions: ``filt(positive probs)``, then one draw per output."""
    _check_nan(check_nan, probs)
    rows = _rows(op, "probs", probs)
    batch = _outputs(op, indices, rows)
    rng = _rng(seed, offset, generator, probs.device, batch)
    return _draw(op, filt(_positive(probs), rows), indices, rng, _out_dtype(indices), return_valid)


# ----------------------------------------------------------------------------- public functions


def softmax(
    logits: Tensor,
    temperature: Tensor | float | None = None,
    enable_pdl: bool | None = None,
) -> Tensor:
    """``softmax(logits / temperature)`` per row: :func:`specsampler.logits_to_probs` with
    ``SamplingParams(temperature=...)``.

    logits: float ``[B, V]``; temperature: None (1), a real scalar or a float16/bfloat16/float32/float64
    tensor ``[B]`` on the logits' device, checked as FlashInfer 0.7.2 checks it (``TypeError`` for a bool
    or a non-number, its ``ValueError`` messages for a tensor of another rank, length, device or dtype).
    Returns float32 ``[B, V]``. Differences: temperature 0 gives the one-hot argmax row (FlashInfer
    divides by 0); a row without a finite logit is all 0 (FlashInfer and torch give NaN); a negative
    temperature raises ``ValueError``; CPU logits work (FlashInfer requires CUDA). ``enable_pdl`` has no
    effect.
    """
    _rows("flashinfer.softmax", "logits", logits)
    return logits_to_probs(logits, SamplingParams(temperature=_softmax_temperature(logits, temperature)))


def sampling_from_probs(
    probs: Tensor,
    indices: Tensor | None = None,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
    seed: Seed = None,
    offset: Seed = None,
    return_valid: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Category sampling: :func:`specsampler.sample`.

    probs: float ``[U, V]`` (need not be normalised); indices: int32/int64 ``[N]``, output i draws from
    ``probs[indices[i]]``. Returns int32 ``[U]`` (``indices.dtype`` ``[N]``), and bool ``valid`` with
    ``return_valid``. Differences (seeds): docs/design.md, "Drop-in compatibility per peer".
    """
    return _from_probs("flashinfer.sampling_from_probs", probs, lambda p, rows: p, indices, generator,
                       check_nan, seed, offset, return_valid)


def sampling_from_logits(
    logits: Tensor,
    indices: Tensor | None = None,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
    seed: Seed = None,
    offset: Seed = None,
) -> Tensor:
    """Sample from ``softmax(logits)``: :func:`specsampler.sample_from_logits` (with ``indices``:
    :func:`specsampler.logits_to_probs` on each row once, then one draw per output).

    logits: float ``[U, V]``; indices: int32/int64 ``[N]``. Returns int32 ``[U]`` (``indices.dtype`` ``[N]``).
    Differences: FlashInfer draws by the Gumbel-max trick, we by inversion of the same distribution.
    """
    op = "flashinfer.sampling_from_logits"
    _check_nan(check_nan, logits, "logits")
    return _sample_logits(op, logits, SamplingParams(), indices, generator, seed, offset)


def _sample_logits(op: str, logits: Tensor, params: SamplingParams, indices, generator, seed, offset) -> Tensor:
    rows = _rows(op, "logits", logits)
    batch = _outputs(op, indices, rows)
    rng = _rng(seed, offset, generator, logits.device, batch)
    if indices is None:
        return sample_from_logits(logits, params, rng).tokens.to(torch.int32)
    return _draw(op, logits_to_probs(logits, params), indices, rng, indices.dtype, False)


def top_p_sampling_from_probs(
    probs: Tensor,
    top_p: Tensor | float,
    indices: Tensor | None = None,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
    seed: Seed = None,
    offset: Seed = None,
    return_valid: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Nucleus sampling: :func:`specsampler.top_p_renorm` then :func:`specsampler.sample`.

    top_p: a float or a float tensor ``[U]`` (one per probs row). Otherwise as :func:`sampling_from_probs`.
    """
    return _from_probs("flashinfer.top_p_sampling_from_probs", probs,
                       lambda p, rows: top_p_renorm(p, _top_p(top_p, rows)),
                       indices, generator, check_nan, seed, offset, return_valid)


def top_k_sampling_from_probs(
    probs: Tensor,
    top_k: Tensor | int,
    indices: Tensor | None = None,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
    seed: Seed = None,
    offset: Seed = None,
    return_valid: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Top-k sampling: :func:`specsampler.top_k_renorm` then :func:`specsampler.sample`.

    top_k: an int or an int tensor ``[U]``. Exactly k tokens are kept (ties to the lower id).
    Otherwise as :func:`sampling_from_probs`.
    """
    return _from_probs("flashinfer.top_k_sampling_from_probs", probs,
                       lambda p, rows: top_k_renorm(p, _top_k(top_k, rows)),
                       indices, generator, check_nan, seed, offset, return_valid)


def min_p_sampling_from_probs(
    probs: Tensor,
    min_p: Tensor | float,
    indices: Tensor | None = None,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
    seed: Seed = None,
    offset: Seed = None,
    return_valid: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Min-p sampling (keep probabilities ``>= min_p * max``): :func:`specsampler.min_p_renorm` then
    :func:`specsampler.sample`.

    min_p: a float or a float tensor ``[U]``. Otherwise as :func:`sampling_from_probs`.
    """
    return _from_probs("flashinfer.min_p_sampling_from_probs", probs,
                       lambda p, rows: min_p_renorm(p, _min_p(min_p, rows)),
                       indices, generator, check_nan, seed, offset, return_valid)


def _joint(p: Tensor, top_k: int | Tensor, top_p: float | Tensor) -> Tensor:
    """FlashInfer's "joint" filter: the tokens in both the top-k and the top-p set of ``p`` itself."""
    keep = (top_k_renorm(p, top_k) > 0) & (top_p_renorm(p, top_p) > 0)
    return p * keep


def top_k_top_p_sampling_from_probs(
    probs: Tensor,
    top_k: Tensor | int,
    top_p: Tensor | float,
    indices: Tensor | None = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
    seed: Seed = None,
    offset: Seed = None,
    return_valid: bool = False,
    top_k_max: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Top-k and top-p sampling from probabilities, then :func:`specsampler.sample`.

    ``filter_apply_order="top_k_first"``: :func:`specsampler.top_k_renorm`, then
    :func:`specsampler.top_p_renorm` on the renormalised top-k (specsampler's own order of filters).
    ``"joint"``: the tokens in both the top-k and the top-p set of the original probabilities.
    top_k: int or int tensor ``[U]``; top_p: float or float tensor ``[U]``; ``top_k_max``: FlashInfer 0.7.4's
    unchecked bound on a ``top_k`` tensor, read with ``"top_k_first"`` as it reads it (see
    ``_top_k_first_bound``: rows above it, "no top-k" rows included, keep ``top_k_max`` tokens). Otherwise
    as :func:`sampling_from_probs`; another order raises ``ValueError("Invalid filter_apply_order: ...")``.
    """
    op = "flashinfer.top_k_top_p_sampling_from_probs"
    if filter_apply_order == "top_k_first":
        def filt(p, rows):
            k = _top_k_first_bound(top_k, top_k_max, p)
            return top_p_renorm(top_k_renorm(p, _top_k(k, rows)), _top_p(top_p, rows))
    elif filter_apply_order == "joint":
        def filt(p, rows):
            return _joint(p, _top_k(top_k, rows), _top_p(top_p, rows))
    else:
        raise ValueError(f"Invalid filter_apply_order: {filter_apply_order}")
    return _from_probs(op, probs, filt, indices, generator, check_nan, seed, offset, return_valid)


def top_k_top_p_sampling_from_logits(
    logits: Tensor,
    top_k: Tensor | int,
    top_p: Tensor | float,
    indices: Tensor | None = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
    seed: Seed = None,
    offset: Seed = None,
    top_k_max: int | None = None,
) -> Tensor:
    """Top-k and top-p sampling from logits.

    ``"top_k_first"``: :func:`specsampler.sample_from_logits` with ``SamplingParams(top_k=, top_p=)``
    (top-p on the renormalised top-k: the kernel on CUDA; with ``indices``,
    :func:`specsampler.logits_to_probs` on each row once). ``"joint"``: as FlashInfer,
    ``torch.softmax`` then :func:`top_k_top_p_sampling_from_probs` (``"joint"``), so both entry points
    draw the same tokens from the same generator state. ``check_nan`` checks the softmax, as FlashInfer
    (``"Input probs contains NaN."``). ``top_k_max`` as in :func:`top_k_top_p_sampling_from_probs`.
    Returns int32 ``[U]`` (``indices.dtype`` ``[N]``).
    """
    op = "flashinfer.top_k_top_p_sampling_from_logits"
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ValueError(f"Invalid filter_apply_order: {filter_apply_order}")
    if check_nan and _softmax_has_nan(logits):
        raise ValueError("Input probs contains NaN.")
    if filter_apply_order == "joint":
        return top_k_top_p_sampling_from_probs(torch.softmax(logits, dim=-1), top_k, top_p, indices, "joint",
                                               deterministic, generator, False, seed, offset)
    rows = _rows(op, "logits", logits)
    top_k = _top_k_first_bound(top_k, top_k_max, logits)
    params = SamplingParams(top_k=_top_k(top_k, rows), top_p=_top_p(top_p, rows))
    return _sample_logits(op, logits, params, indices, generator, seed, offset)


def top_p_renorm_probs(
    probs: Tensor,
    top_p: Tensor | float,
    is_deterministic: bool = False,
) -> Tensor:
    """Keep the top-p nucleus and renormalise: :func:`specsampler.top_p_renorm`.

    probs: float ``[B, V]``; top_p: float or float tensor ``[B]``. Returns float32 ``[B, V]``.
    The nucleus is the smallest prefix of the (probability desc, id asc) order whose mass reaches
    ``top_p``; FlashInfer's threshold search keeps the same set but may differ at exact ties.
    """
    rows = _rows("flashinfer.top_p_renorm_probs", "probs", probs)
    return top_p_renorm(probs, _top_p(top_p, rows))


top_p_renorm_prob = top_p_renorm_probs


def top_k_renorm_probs(
    probs: Tensor,
    top_k: Tensor | int,
    is_deterministic: bool = False,
) -> Tensor:
    """Keep the k most likely tokens and renormalise: :func:`specsampler.top_k_renorm`.

    probs: float ``[B, V]``; top_k: int or int tensor ``[B]``. Returns ``[B, V]`` in ``probs.dtype``.
    Exactly k tokens are kept, ties at the k-th value to the lower id (FlashInfer's radix select may
    keep some or all ties). ``is_deterministic`` (FlashInfer 0.7.2: bitwise-reproducible sums) has no
    effect: the result here is the same on every call.
    """
    rows = _rows("flashinfer.top_k_renorm_probs", "probs", probs)
    return top_k_renorm(probs, _top_k(top_k, rows)).to(probs.dtype)


top_k_renorm_prob = top_k_renorm_probs


def top_k_mask_logits(logits: Tensor, top_k: Tensor | int) -> Tensor:
    """Set every logit outside the top k to ``-inf``: the top-k set of :func:`specsampler.logits_to_probs`.

    logits: float ``[B, V]``; top_k: int or int tensor ``[B]``. Returns ``[B, V]`` in ``logits.dtype``.
    Exactly k logits stay (ties to the lower id); ``top_k <= 0`` or ``>= V`` keeps all.
    """
    rows = _rows("flashinfer.top_k_mask_logits", "logits", logits)
    params = SamplingParams(temperature=_ORDER_TEMPERATURE, top_k=_top_k(top_k, rows))
    keep = logits_to_probs(logits, params) > 0
    return masked_logits(logits, keep)


def chain_speculative_sampling(
    draft_probs: Tensor,
    draft_token_ids: Tensor,
    target_probs: Tensor,
    maybe_output_accepted_token_num: Tensor | None = None,
    maybe_output_emitted_draft_token_num: Tensor | None = None,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    seed: Seed = None,
    offset: Seed = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Chain speculative sampling: :func:`specsampler.verify_chain` with ``method="token"`` (lossless).

    Args:
        draft_probs: float ``[B, K, V]``; draft_token_ids: integer ``[B, K]``;
        target_probs: float ``[B, K+1, V]``.
        maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num: integer ``[B]``
            counters, incremented in place (``+=``) when given.
    Returns:
        ``(output_token_ids, output_accepted_token_num, output_emitted_draft_token_num)``:
        int32 ``[B, K+1]`` (accepted drafts, one correction or bonus token, then -1), and the two
        counters (new int32 tensors when not given). Emitted = the accepted drafts; accepted, by
        FlashInfer's definition, also counts the drafts after the first rejection that would pass
        the test ``u * q < p`` on their own (fresh uniforms), a measure of draft-target agreement.

    Differences: counters of any integer dtype are incremented in place (FlashInfer writes into an
    int32 copy of a non-int32 counter); a draft id outside ``[0, V)`` is rejected.
    """
    op = "flashinfer.chain_speculative_sampling"
    check_tensor(op, "draft_probs", draft_probs, kind="float", ndim=3)
    B, K, _ = draft_probs.shape
    dev = draft_probs.device
    accepted = maybe_output_accepted_token_num
    emitted = maybe_output_emitted_draft_token_num
    for name, counter in (("maybe_output_accepted_token_num", accepted), ("maybe_output_emitted_draft_token_num",
                                                                        emitted)):
        if counter is not None:  # written in place: entries of no request, or a broadcast after the work, never
            check_tensor(op, name, counter, kind="int", ndim=1)
            check_shape(op, name, counter, (B,), "[B]")
            check_device(op, name, counter, dev)
    rng = _rng(seed, offset, generator, dev, B)
    result = verify_chain(target_probs, draft_token_ids, draft_probs, method="token", rng=rng)
    n = result.num_accepted
    if accepted is None:
        accepted = torch.zeros(B, dtype=torch.int32, device=dev)
    if emitted is None:
        emitted = torch.zeros(B, dtype=torch.int32, device=dev)
    accepted += (n + _passes_after(op, draft_probs, draft_token_ids, target_probs, n, rng)).to(accepted.dtype)
    emitted += n.to(emitted.dtype)
    return result.tokens.to(torch.int32), accepted, emitted


def _passes_after(op: str, q: Tensor, x: Tensor, p: Tensor, n: Tensor, rng: Rng) -> Tensor:
    """int64 ``[B]``: drafts at positions ``>= n`` that pass ``u * q(x) < p(x)`` with a fresh uniform each.

    Philox streams: ``STREAM_ACCEPT`` indices ``K+1 .. 2K`` (verification uses ``1 .. K``).
    """
    B, K, V = q.shape
    if K == 0:
        return torch.zeros(B, dtype=torch.int64, device=q.device)
    xs = x.long()
    ok = (xs >= 0) & (xs < V)
    xs = xs.clamp(0, V - 1)[..., None]
    p_x = p[:, :K].gather(2, xs)[..., 0].float()
    q_x = q.gather(2, xs)[..., 0].float()
    if isinstance(rng, Philox):
        u = uniform(rng, op, B, 2 * K + 1, STREAM_ACCEPT, q.device)[:, K + 1 :]
    else:
        u = uniform(rng, op, B, K, STREAM_ACCEPT, q.device)
    after = torch.arange(K, device=q.device) >= n[:, None]
    return ((u * q_x < p_x) & (p_x > 0) & ok & after).sum(1)  # the verification's test: no draft of p 0
