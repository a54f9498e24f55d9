"""Hugging Face transformers' speculative sampling on specsampler.

- :func:`speculative_sampling`: transformers' ``generation.utils._speculative_sampling``, same arguments
  and return, mapped onto :func:`specsampler.verify_chain` (``method="token"``);
- :func:`patched`: a context manager under which transformers' own assisted generation verifies with
  specsampler, by ``method="token"`` or ``"block"``.

transformers is imported only inside :func:`patched`. The versions tested and the differences from
transformers: docs/design.md, "Drop-in compatibility per peer", ``compat.hf``.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from specsampler import Uniforms, verify_chain
from specsampler.validation import as_integer, check_mode, check_no_bad, check_tensor, fail

__all__ = ["patched", "speculative_sampling"]

METHODS = ("token", "block")
OP = "speculative_sampling"


def speculative_sampling(
    candidate_input_ids: Tensor,
    candidate_logits: Tensor,
    candidate_length: int,
    new_logits: Tensor,
    assistant_ensemble_weight: float | None = None,
    *,
    is_done_candidate: bool | Tensor = False,
    validate: str = "structure",
) -> tuple[Tensor, Tensor]:
    """Verify the assistant's candidates against the target (Leviathan et al., algorithm 1).

    Maps onto :func:`specsampler.verify_chain` with ``method="token"``: lossless. The signature is that of
    transformers 5.18 to 5.24 (the newest): ``assistant_ensemble_weight`` fifth. Of the older releases' calls,
    ``is_done_candidate`` fifth (4.56 to 5.13) and by keyword work (a bool or bool tensor in fifth place is read
    as it: no weight is a bool); 5.14 to 5.17's positional ``(..., is_done_candidate, assistant_ensemble_weight)``
    does not fit this signature (:func:`patched` installs the order of the release it finds).

    Args:
        candidate_input_ids: int64 ``[1, L + candidate_length]``: the sequence with the candidates last.
        candidate_logits: float ``[1, candidate_length, V]``: the assistant's processed logits, whose
            softmax each candidate was drawn from.
        candidate_length: the number of candidates, ``K``.
        new_logits: float ``[1, K + 1, V]``: the target's processed logits after each prefix.
        assistant_ensemble_weight: transformers' static ensemble verification (DIVERSED, from 5.14): with a
            weight ``w`` in (0, 1) the candidates are verified against ``w * p + (1 - w) * q`` — LOSSY, the
            output no longer follows the target. Reproduced as transformers defines it (``torch.rand_like``
            uniforms, ``u <= 1 - w + w p / q``, the residual ``max(p - q, 0)`` (``p`` where it has no mass)
            drawn by ``torch.multinomial``). None or 1: lossless (``w = 1`` verifies against ``p`` itself).
            Other values raise a ValueError (transformers' ``GenerationConfig`` allows (0, 1)).
        is_done_candidate: (transformers up to 5.17) the last candidate ends generation: when all are
            accepted, no bonus token is drawn and the last candidate is not counted as a match (with no
            candidate, the bonus token is drawn).
        validate: ``"structure"`` (types and shapes) or ``"full"``: also NaN or ``+inf`` logits, rows without a
            finite logit and candidates outside the vocabulary raise a ValueError (transformers fails on them
            too); with ``"structure"`` they give a token in range, as every op of the library.
    Returns:
        ``(valid_tokens, n_matches)``: int64 ``[1, n_matches + 1]`` (the accepted candidates, then the
        correction or bonus token) and a 0-dim int64 tensor, the accepted count.
    """
    weight, done = _weight_and_done(assistant_ensemble_weight, is_done_candidate)
    return _verify(candidate_input_ids, candidate_logits, candidate_length, new_logits, done, weight, "token",
                   check_mode(OP, validate))


def _weight_and_done(fifth: object, is_done_candidate: bool | Tensor) -> tuple[float | None, bool | Tensor]:
    """The ensemble weight and ``is_done_candidate`` of a call: a bool (or bool tensor) in fifth place is an
    older release's positional ``is_done_candidate``."""
    if isinstance(fifth, bool) or (isinstance(fifth, Tensor) and fifth.dtype == torch.bool):
        return None, fifth
    if fifth is None:
        return None, is_done_candidate
    real = isinstance(fifth, numbers.Real) or (isinstance(fifth, Tensor) and fifth.numel() == 1
                                               and not fifth.dtype.is_complex)
    w = float(fifth) if real else float("nan")
    if not 0.0 < w <= 1.0:
        fail(OP, "assistant_ensemble_weight", "a weight in (0, 1] or None", repr(fifth))
    return (None if w == 1.0 else w), is_done_candidate


def _verify(candidate_input_ids: Tensor, candidate_logits: Tensor, candidate_length: int, new_logits: Tensor,
            is_done_candidate: bool, weight: float | None, method: str, full: bool = False) -> tuple[Tensor, Tensor]:
    op = OP
    check_tensor(op, "candidate_input_ids", candidate_input_ids, kind="int", ndim=2)
    check_tensor(op, "candidate_logits", candidate_logits, kind="float", ndim=3)
    check_tensor(op, "new_logits", new_logits, kind="float", ndim=3)
    for name, t in (("candidate_input_ids", candidate_input_ids), ("candidate_logits", candidate_logits),
                    ("new_logits", new_logits)):
        if t.shape[0] != 1:
            fail(op, name, "batch size 1 (as transformers' assisted generation)", t.shape[0])
    V = new_logits.shape[2]
    if candidate_logits.shape[2] != V:
        fail(op, "candidate_logits", f"the vocabulary of new_logits ({V} logits a row)", candidate_logits.shape[2])
    K = as_integer(candidate_length, one_value_tensors=True)  # not a bool, a float or a wider tensor
    if K is None:
        fail(op, "candidate_length", "an integer", repr(candidate_length))
    if not 0 <= K <= min(candidate_input_ids.shape[1], candidate_logits.shape[1], new_logits.shape[1] - 1):
        fail(op, "candidate_length", "at most the candidates in candidate_input_ids and candidate_logits, "
             "with K + 1 rows of new_logits", K)
    drafts = candidate_input_ids[:, candidate_input_ids.shape[1] - K:]
    if full:
        for name, t in (("candidate_logits", candidate_logits[:, :K]), ("new_logits", new_logits[:, :K + 1])):
            check_no_bad(op, name, t.isnan() | (t == float("inf")), t, "logits without NaN or +inf")
            check_no_bad(op, name, (t == float("-inf")).all(-1), t.amax(-1),
                         "rows holding a finite logit (all -inf has no distribution)")
        check_no_bad(op, "candidate_input_ids", (drafts < 0) | (drafts >= V), drafts,
                     f"candidates in [0, {V}) (the vocabulary of the logits)")
    if weight is not None:
        if method != "token":
            fail(op, "assistant_ensemble_weight", f"None or 1 with method {method!r} (the ensemble is "
                 "defined for token verification)", weight)
        # transformers' arithmetic, in the logits' dtype
        return _ensemble(drafts, candidate_logits[:, :K].softmax(-1), new_logits[:, :K + 1].softmax(-1),
                         is_done_candidate and K > 0, weight)
    # float32 distributions and uniforms: a bfloat16 uniform has 2**-8 steps in [0.5, 1), too coarse to draw the
    # correction token by inversion (transformers' generate casts to float32 before calling too)
    q = candidate_logits[:, :K].float().softmax(-1)
    p = new_logits[:, :K + 1].float().softmax(-1)
    res = verify_chain(p, drafts, q, method=method, rng=_transformers_uniforms(p, K))
    n = res.num_accepted[0]
    if is_done_candidate and K > 0 and int(n) == K:
        return drafts.clone(), n - 1
    return res.tokens[:, : int(n) + 1], n


def _transformers_uniforms(p: Tensor, K: int) -> Uniforms:
    """Uniforms from transformers' own source, ``torch.rand_like``: the acceptance tests' of the K drafts (as
    transformers draws them; draft i tests index i + 1), and one for the correction or bonus token, which a
    chain draws once (at the first rejection, or at K), so every index holds it. Mocks of ``rand_like`` in
    transformers' tests then pin our acceptance tests too (a one-value result serves every draft, as
    transformers' comparison broadcasts it); we call it twice, transformers once (its correction is a
    ``torch.multinomial``)."""
    u_accept = torch.rand_like(p[0, :K, 0]).reshape(-1).float()
    u_accept = u_accept.expand(K) if u_accept.numel() == 1 else u_accept[:K]
    u_draw = torch.rand_like(p[0, :1, 0]).reshape(-1)[:1].float()
    return Uniforms(sample=u_draw.expand(K + 1)[None], accept=torch.cat([u_accept.new_zeros(1), u_accept])[None])


def _ensemble(drafts: Tensor, q: Tensor, p: Tensor, is_done_candidate: bool, w: float) -> tuple[Tensor, Tensor]:
    """transformers' static ensemble verification (lossy), with its draws."""
    K = drafts.shape[1]
    at = torch.arange(K, device=drafts.device)
    q_x, p_x = q[0, at, drafts[0]], p[0, at, drafts[0]]
    ratio = 1.0 - w + w * (p_x / q_x)
    accepted = torch.rand_like(ratio) <= ratio
    n = ((~accepted).cumsum(-1) < 1).sum()
    if is_done_candidate and int(n) == K:
        return drafts.clone(), n - 1
    row = p[:, int(n)]
    if int(n) < K:
        # max(v - q, 0) = w * max(p - q, 0): the same normalised residual.
        residual = (row - q[:, int(n)]).clamp(min=0)
        total = residual.sum()
        row = row if total <= torch.finfo(residual.dtype).tiny else residual / total
    t = torch.multinomial(row, num_samples=1).squeeze(1)[None, :]
    return torch.cat((drafts[:, : int(n)], t), dim=-1), n


@contextmanager
def patched(method: str = "token") -> Iterator[None]:
    """Make transformers' assisted generation verify with specsampler inside the block.

    ``model.generate(..., assistant_model=draft, do_sample=True)`` then verifies each round of
    candidates by :func:`specsampler.verify_chain` with ``method`` (``"token"`` or ``"block"``);
    everything else (drafting, caches, stopping, the greedy path of ``do_sample=False``) stays
    transformers'. On exit, exception or not, transformers' own function is back. The patch is
    process-wide (a module attribute of ``transformers.generation.utils``): not for concurrent use.

    Args:
        method: ``"token"`` (Leviathan / Chen rejection sampling) or ``"block"`` (Sun et al. 2024). transformers'
            static ensemble (``assistant_ensemble_weight`` in (0, 1)) is defined for token verification: with
            ``"block"`` such a generation raises a ValueError at its first verification.
    """
    if method not in METHODS:
        fail("patched", "method", f"one of {METHODS}", repr(method))
    from transformers.generation import utils

    original = utils._speculative_sampling

    def verify(candidate_input_ids, candidate_logits, candidate_length, new_logits, assistant_ensemble_weight=None,
               *, is_done_candidate=False):
        weight, done = _weight_and_done(assistant_ensemble_weight, is_done_candidate)
        return _verify(candidate_input_ids, candidate_logits, candidate_length, new_logits, done, weight, method)

    def verify_before_5_18(candidate_input_ids, candidate_logits, candidate_length, new_logits,
                           is_done_candidate=False, assistant_ensemble_weight=None):
        return verify(candidate_input_ids, candidate_logits, candidate_length, new_logits, assistant_ensemble_weight,
                      is_done_candidate=is_done_candidate)

    # the installed release's order: up to 5.17 transformers passes is_done_candidate fifth, by position
    before_5_18 = "is_done_candidate" in inspect.signature(original).parameters
    utils._speculative_sampling = verify_before_5_18 if before_5_18 else verify
    try:
        yield
    finally:
        utils._speculative_sampling = original
