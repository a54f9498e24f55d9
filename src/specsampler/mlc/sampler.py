"""MLC-LLM's Sampler (``cpp/serve/sampler/sampler.h``): draws tokens from probabilities and verifies draft
trees, a batch per call, on :func:`specsampler.top_k_renorm`, :func:`specsampler.top_p_renorm`,
:func:`specsampler.min_p_renorm`, :func:`specsampler.sample` and :func:`specsampler.verify_tree`.

Its contract: docs/design.md, "Upstream entry points (MLC-LLM, LongSpec)".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from ..rng import Philox
from ..sampling.ops import min_p_renorm, sample, top_k_renorm, top_p_renorm
from ..sampling.processing import ordered_prefix
from ..validation import check_mode, check_shape, check_tensor, fail, shape_str
from ..verify.token_tree import TokenTree
from ..verify.tree import DRAFT_SAMPLING, METHODS, verify_tree
from .checks import _check_cum, _checked_list, _draft_tokens, _host_ints, _is_int, _parent_ptr
from .config import GenerationConfig, RandomGenerator, _is_greedy
from .results import SampleResult
from .trace import EventTraceRecorder


def _philox(rngs: list[RandomGenerator], device: torch.device) -> Philox:
    """The streams of one call (rng i at its offset, int64 tensors ``[n]`` on ``device``); advances each rng."""
    seeds, offsets = [], []
    for r in rngs:
        seeds.append((r.seed + 2**63) % 2**64 - 2**63)
        offsets.append(r.offset)
        r.offset += 1
    return Philox(torch.tensor(seeds, dtype=torch.int64, device=device),
                  torch.tensor(offsets, dtype=torch.int64, device=device))


def _num_top(cfg: GenerationConfig) -> int:
    return cfg.top_logprobs if cfg.logprobs else 0


def _filter(rows: Tensor, cfgs: list[GenerationConfig], validate: str) -> Tensor:
    """Each config's top-k (1 for greedy configs), top-p and min-p on its row, renormalised.

    docs/design.md's order ("Sampling"), one call of each renorm op for the batch. rows: float32 ``[n, V]``.
    Returns float32 ``[n, V]`` (greedy rows one-hot at the argmax, ties to the lower id).
    """
    dev, V = rows.device, rows.shape[1]
    top_k = [1 if _is_greedy(c) else max(0, min(c.top_k, V)) for c in cfgs]
    out = top_k_renorm(rows, torch.tensor(top_k, dtype=torch.int64, device=dev), validate=validate)
    out = top_p_renorm(out, torch.tensor([c.top_p for c in cfgs], dtype=torch.float32, device=dev),
                       validate=validate)
    return min_p_renorm(out, torch.tensor([c.min_p for c in cfgs], dtype=torch.float32, device=dev),
                        validate=validate)


def _top_tokens(probs: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens of ``probs[rows]`` (prob desc, id asc).

    probs: float ``[R, V]``; rows: int64 ``[n]``. Returns ids int64 and probabilities float32,
    ``[n, min(k, V)]``.
    """
    if k == 0:
        return rows.new_zeros(rows.shape[0], 0), probs.new_zeros(rows.shape[0], 0, dtype=torch.float32)
    values, ids = ordered_prefix(probs[rows].float(), k)
    return ids, values


def _to_host(*parts: Tensor) -> list[Tensor]:
    """2-D tensors ``[n, w_i]`` on the host, in ONE transfer: packed as float64 (token ids below
    2**53 and float32 probabilities exactly), split again on the host."""
    host = torch.cat([p.double() for p in parts], 1).cpu()
    return list(host.split([p.shape[1] for p in parts], 1))


def _top_list(ids: list[int], probs: list[float], count: int) -> list[tuple[int, float]]:
    return [(int(t), p) for t, p in zip(ids[:count], probs[:count])]


def _check_flat_probs(op: str, name: str, probs: Tensor, read: Tensor | None, cum: Tensor) -> None:
    """``validate="full"``'s checks of ``probs`` float ``[num_nodes, V]`` at the rows ``read`` (bool ``[num_nodes]``;
    None: all), quoting the first bad value at its ``[row, token]`` and its request (``cum``: int64 ``[B + 1]``)."""
    p = probs.float()
    for bad, expected in ((~torch.isfinite(p), "finite probabilities"), (p < 0, "probabilities >= 0")):
        if read is not None:
            bad &= read.to(p.device)[:, None]
        if bool(bad.any()):
            g, t = torch.nonzero(bad)[0].tolist()
            fail(op, name, expected, f"{p[g, t].item()} at index [{g}, {t}]",
                 request=int(torch.searchsorted(cum, torch.tensor([g]), right=True)[0]) - 1)


class Sampler:
    """MLC-LLM's sampler: draws tokens from probabilities and verifies draft trees, a batch per call.

    Make one with :meth:`create_cpu_sampler` or :meth:`create_gpu_sampler`. Both run the same
    code with the same semantics, on specsampler's ops (top-k/top-p/min-p renorm, ``sample``,
    ``verify_tree``; the vectorized PyTorch path, whose ops dispatch to Triton kernels on CUDA):

    - the CPU sampler moves its inputs to the CPU and returns CPU tensors;
    - the GPU sampler keeps everything on its device (inputs must be there) and checks its
      capacity, ``max_num_sample`` and ``vocab_size``.

    Every method works on the whole batch at once: one call of each op for all samples, with
    the per-sample parameters as tensors, and the results (token ids, probabilities, top
    tokens, accepted counts) move to the host in one transfer, from which the Python lists of
    :class:`SampleResult` are built.

    Inputs are probabilities after MLC's LogitProcessor (temperature, penalties, logit bias
    applied); of a :class:`GenerationConfig` the sampler applies only top-k, top-p, min-p and
    greedy (``temperature < 1e-5``), and reads ``logprobs`` / ``top_logprobs``.

    Randomness: sample i draws from ``rngs[i]`` (a :class:`RandomGenerator`: its Philox stream
    at its offset, advanced after the call). A sample's result depends only on its own row,
    config and generator state: not on batch size, position or neighbours.

    With a ``trace_recorder`` (:class:`EventTraceRecorder`), every call records
    ``"start <method name>"`` and ``"finish <method name>"`` for each of its request ids.

    Every ``batch_*`` method also takes ``validate="structure"`` (default) or ``"full"``
    (also checks the probability values; :mod:`specsampler.validation`).

    Attributes:
        device: ``torch.device`` where the work runs and tensor outputs live (the CPU for the
            CPU sampler).
        on_device: False for the CPU sampler (inputs are moved to the CPU), True for the GPU
            sampler (inputs must already be on ``device``).
        max_num_sample, vocab_size: the GPU sampler's capacity (None for the CPU sampler).
        trace_recorder: the :class:`EventTraceRecorder` or None.
    """

    def __init__(self, device: torch.device, on_device: bool, max_num_sample: int | None, vocab_size: int | None,
                 trace_recorder: EventTraceRecorder | None):
        """Use :meth:`create_cpu_sampler` or :meth:`create_gpu_sampler`."""
        if trace_recorder is not None and not isinstance(trace_recorder, EventTraceRecorder):
            fail("Sampler", "trace_recorder", "None or an EventTraceRecorder", type(trace_recorder).__name__)
        self.device = device
        self.on_device = on_device
        self.max_num_sample = max_num_sample
        self.vocab_size = vocab_size
        self.trace_recorder = trace_recorder

    def __repr__(self) -> str:
        if not self.on_device:
            return "Sampler(cpu)"
        return f"Sampler({self.device}, max_num_sample={self.max_num_sample}, vocab_size={self.vocab_size})"

    # ------------------------------------------------------------------------- factories

    @staticmethod
    def create_cpu_sampler(trace_recorder: EventTraceRecorder | None = None) -> Sampler:
        """A sampler that moves its inputs to the CPU (any device in) and returns CPU tensors."""
        return Sampler(torch.device("cpu"), False, None, None, trace_recorder)

    @staticmethod
    def create_gpu_sampler(max_num_sample: int, vocab_size: int, device: str | torch.device,
                           trace_recorder: EventTraceRecorder | None = None) -> Sampler:
        """A sampler whose inputs, work and tensor outputs stay on ``device``.

        Args:
            max_num_sample: ``>= 1``: the most rows of ``probs`` a renormalisation takes, or draft-tree nodes a
                verification call (``cum_verify_lengths[-1]``), as MLC's GPU sampler; a sampling call takes any
                number of samples (MLC's draws them in chunks of that many).
            vocab_size: ``>= 1``: the most columns ``V`` of the probabilities.
            device: a ``torch.device`` or a device string. Any device is accepted, so the GPU
                path can be tested on the CPU (``"cpu"``); an engine creates it where
                :meth:`supports_gpu_sampler` says so.
            trace_recorder: ``None`` or an :class:`EventTraceRecorder`.
        Calls past those limits, or with more columns, raise ``ValueError`` (:class:`~specsampler.ValidationError`).
        """
        op = "Sampler.create_gpu_sampler"
        for name, v in (("max_num_sample", max_num_sample), ("vocab_size", vocab_size)):
            if not _is_int(v) or v < 1:
                fail(op, name, "an int >= 1", repr(v))
        if not isinstance(device, (str, torch.device)):
            fail(op, "device", "a torch.device or a device string", type(device).__name__)
        try:
            device = torch.empty(0, device=device).device  # with its index ("cuda" -> "cuda:0")
        except (RuntimeError, AssertionError, NotImplementedError) as err:  # what torch raises for each case
            fail(op, "device", "a device torch can allocate on", f"{device!r} ({err})")
        return Sampler(device, True, int(max_num_sample), int(vocab_size), trace_recorder)

    @staticmethod
    def supports_gpu_sampler(device: str | torch.device) -> bool:
        """Whether the engine should use the GPU sampler on ``device``: True for CUDA devices
        (ROCm builds of torch name theirs ``"cuda"`` too; ``"hip"`` is accepted as well), False
        for the CPU, MPS, meta and the rest (MLC's Vulkan and Metal sampler kernels have no
        counterpart here)."""
        if isinstance(device, torch.device):
            kind = device.type
        elif isinstance(device, str):
            kind = device.split(":")[0].strip().lower()
        else:
            fail("Sampler.supports_gpu_sampler", "device", "a torch.device or a device string", type(device).__name__)
        return kind in ("cuda", "hip")

    # ------------------------------------------------------------------------- checks

    def _probs(self, op: str, name: str, probs: object) -> Tensor:
        """A float ``[rows, V]`` tensor on the sampler's device (the CPU sampler moves it there)."""
        check_tensor(op, name, probs, kind="float", ndim=2)
        if probs.shape[1] == 0:
            fail(op, name, "shape [rows, V] with V >= 1", shape_str(probs.shape))
        if not self.on_device:
            return probs.cpu()
        if probs.device != self.device:
            fail(op, name, f"a tensor on the sampler's device {self.device}", f"one on {probs.device}")
        if probs.shape[1] > self.vocab_size:
            fail(op, name, f"at most vocab_size = {self.vocab_size} columns", shape_str(probs.shape))
        return probs

    def _check_capacity(self, op: str, name: str, count: int, what: str) -> None:
        if self.max_num_sample is not None and count > self.max_num_sample:
            fail(op, name, f"at most max_num_sample = {self.max_num_sample} {what}", f"{count} {what}")

    def _samples(self, op: str, probs: Tensor, sample_indices, request_ids,
                 generation_cfg) -> tuple[Tensor, list[str], list[GenerationConfig]]:
        """Validated sample indices (CPU int64 ``[n]``), request ids and configs, one per sample."""
        idx = _host_ints(op, "sample_indices", sample_indices)
        n, rows = idx.numel(), probs.shape[0]
        bad = ((idx < 0) | (idx >= rows)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            fail(op, f"sample_indices[{i}]", f"a row index of probs in [0, {rows})", int(idx[i]), request=i)
        request_ids = _checked_list(op, "request_ids", request_ids, n, "one per sample", str)
        cfgs = _checked_list(op, "generation_cfg", generation_cfg, n, "one per sample", GenerationConfig)
        return idx, request_ids, cfgs

    @contextmanager
    def _traced(self, method: str, request_ids: list[str]) -> Iterator[None]:
        """Record ``start <method>`` / ``finish <method>`` for every request around the block."""
        recorder = self.trace_recorder
        if recorder is not None:
            recorder.add_event_batch(request_ids, f"start {method}")
        try:
            yield
        finally:
            if recorder is not None:
                recorder.add_event_batch(request_ids, f"finish {method}")

    # ------------------------------------------------------------------------- sampling

    def batch_renormalize_probs_by_top_p(self, probs: Tensor, sample_indices: Sequence[int],
                                         request_ids: Sequence[str], generation_cfg: Sequence[GenerationConfig],
                                         *, validate: str = "structure") -> Tensor:
        """``probs`` with each row ``sample_indices[i]`` filtered by ``generation_cfg[i]``, as MLC returns them: all
        ``R`` rows, the others as given, so that the engine reads the result by the same ``sample_indices`` (or, in
        its verification, by every draft node's row).

        Each config's top-k, top-p and min-p are applied in docs/design.md's order (top-p on the
        top-k-renormalised distribution, then min-p) and the row renormalised; greedy configs
        (``temperature < 1e-5``) give a one-hot row at the argmax (ties to the lower id). Top-p keeps the
        shortest prefix of the (probability desc, id asc) order reaching ``top_p`` of the row's exact mass (the
        library's rule: MLC keeps every token tied with the last and reaches ``top_p - 1e-5``). A row listed
        more than once is filtered once (MLC's GPU sampler; its CPU one filters it again for each): its samples
        must share one config.

        Args:
            probs: float ``[R, V]``, the distributions (after the logit processor).
            sample_indices: n ints in ``[0, R)`` (a sequence or a 1-D integer tensor).
            request_ids: n strs, the request of each sample (for the trace).
            generation_cfg: n :class:`GenerationConfig`.
        Returns:
            float32 ``[R, V]``, a new tensor on the sampler's device (the CPU for the CPU sampler); ``probs`` is
            not modified (MLC's CPU sampler writes the filtered rows into it).
        """
        name = "batch_renormalize_probs_by_top_p"
        op = f"Sampler.{name}"
        check_mode(op, validate)
        probs = self._probs(op, "probs", probs)
        self._check_capacity(op, "probs", probs.shape[0], "rows")  # MLC's GPU sampler renormalises them all
        idx, request_ids, cfgs = self._samples(op, probs, sample_indices, request_ids, generation_cfg)
        config_of: dict[int, GenerationConfig] = {}
        for i, (row, cfg) in enumerate(zip(idx.tolist(), cfgs)):
            if config_of.setdefault(row, cfg) != cfg:
                fail(op, f"generation_cfg[{i}]", f"the config of the other samples of row {row} (a row is filtered "
                     "once)", cfg, request=i)
        rows = list(config_of)
        with self._traced(name, request_ids):
            out = probs.to(torch.float32, copy=True)
            if rows:
                at = torch.tensor(rows, dtype=torch.int64, device=probs.device)
                out[at] = _filter(out[at], list(config_of.values()), validate)
            return out

    def batch_sample_tokens_with_prob_before_top_p(
        self, probs: Tensor, sample_indices: Sequence[int], request_ids: Sequence[str],
        generation_cfg: Sequence[GenerationConfig], rngs: Sequence[RandomGenerator], *, validate: str = "structure",
    ) -> list[SampleResult]:
        """Sample i: filter row ``sample_indices[i]`` by ``generation_cfg[i]`` and draw from it with ``rngs[i]``.

        The filters are those of :meth:`batch_renormalize_probs_by_top_p` (top-k, top-p,
        min-p; greedy for ``temperature < 1e-5``), applied here before sampling.

        Args:
            probs: float ``[R, V]``, unfiltered distributions (after the logit processor).
            sample_indices: n ints in ``[0, R)``; rows may repeat (e.g. parallel samples).
            request_ids: n strs. generation_cfg: n :class:`GenerationConfig`.
            rngs: n :class:`RandomGenerator`; each is advanced by 1 per use.
        Returns:
            n :class:`SampleResult`: ``sampled_token_id = (token, p)`` with ``p`` the token's
            probability in the input row (before filtering); ``top_prob_tokens``: the
            ``top_logprobs`` most likely tokens of the input row when ``logprobs`` is on.
        """
        return self._sample("batch_sample_tokens_with_prob_before_top_p", probs, sample_indices, request_ids,
                            generation_cfg, rngs, False, validate)

    def batch_sample_tokens_with_prob_after_top_p(
        self, probs: Tensor, sample_indices: Sequence[int], request_ids: Sequence[str],
        generation_cfg: Sequence[GenerationConfig], rngs: Sequence[RandomGenerator], *, validate: str = "structure",
    ) -> list[SampleResult]:
        """Sample i: draw from row ``sample_indices[i]`` as it is (already filtered) with ``rngs[i]``.

        ``probs`` are distributions already filtered, typically by
        :meth:`batch_renormalize_probs_by_top_p` (which makes greedy rows one-hot); no filter
        is applied here. Rows need not be normalised.

        Args, returns: as :meth:`batch_sample_tokens_with_prob_before_top_p`; the probability
        in ``sampled_token_id`` and ``top_prob_tokens`` are those of the given (filtered) row.
        """
        return self._sample("batch_sample_tokens_with_prob_after_top_p", probs, sample_indices, request_ids,
                            generation_cfg, rngs, True, validate)

    def _sample(self, name: str, probs, sample_indices, request_ids, generation_cfg, rngs, filtered: bool,
                validate: str) -> list[SampleResult]:
        op = f"Sampler.{name}"
        check_mode(op, validate)
        probs = self._probs(op, "probs", probs)
        idx, request_ids, cfgs = self._samples(op, probs, sample_indices, request_ids, generation_cfg)
        rngs = _checked_list(op, "rngs", rngs, idx.numel(), "one per sample", RandomGenerator)
        counts = [_num_top(c) for c in cfgs]
        with self._traced(name, request_ids):
            idx = idx.to(probs.device)
            rows = probs[idx].float()
            dist = rows if filtered else _filter(rows, cfgs, validate)
            tokens = sample(dist, _philox(rngs, probs.device), validate=validate)[:, None]
            top_ids, top_probs = _top_tokens(probs, idx, max(counts, default=0))
            tok, prob, ids, tps = _to_host(tokens, rows.gather(1, tokens), top_ids, top_probs)
            tok, prob, ids, tps = tok[:, 0].long().tolist(), prob[:, 0].tolist(), ids.long().tolist(), tps.tolist()
            return [SampleResult((tok[i], prob[i]), _top_list(ids[i], tps[i], c)) for i, c in enumerate(counts)]

    # ------------------------------------------------------------------------- verification

    def batch_verify_draft_tokens_with_prob_after_top_p(
        self, probs: Tensor, request_ids: Sequence[str], cum_verify_lengths: Sequence[int],
        generation_cfg: Sequence[GenerationConfig], rngs: Sequence[RandomGenerator],
        draft_output_tokens: Sequence[Sequence[SampleResult]], token_tree_parent_ptr: Sequence[int],
        draft_probs: Tensor | None, *, method: str = "rrs", draft_sampling: str = "iid", validate: str = "structure",
    ) -> tuple[list[list[SampleResult]], list[int]]:
        """Verify one draft tree (or chain) per request against the target's filtered probabilities.

        Request i has ``n_i = cum_verify_lengths[i+1] - cum_verify_lengths[i]`` nodes, node 0
        its root (the last committed token); its node j is global row
        ``g = cum_verify_lengths[i] + j`` of every per-node input. Trees of any shapes and sizes,
        chains included, mix in one call. All requests are verified by ONE
        :func:`specsampler.verify_tree` call on trees padded to the largest ``n_i``.

        Args:
            probs: float ``[num_nodes, V]``, ``num_nodes = cum_verify_lengths[-1]``: row g = the
                target distribution after node j (for its children, or the correction/bonus
                token), already filtered (top-p etc.; greedy requests' rows one-hot, as
                :meth:`batch_renormalize_probs_by_top_p` makes them). Used as it is.
            request_ids: B strs.
            cum_verify_lengths: B + 1 ints, ``0 = c_0 < c_1 < ... < c_B = num_nodes``.
            generation_cfg: B :class:`GenerationConfig` (``logprobs`` / ``top_logprobs``).
            rngs: B :class:`RandomGenerator`, each advanced by 1.
            draft_output_tokens: B lists; ``draft_output_tokens[i][j]`` is the
                :class:`SampleResult` of node j+1 (its token id is read; ``n_i - 1`` entries).
            token_tree_parent_ptr: num_nodes ints (a sequence or 1-D integer tensor); entry g =
                node j's request-local parent: -1 for the root (j = 0), else in ``[0, j)``.
                Siblings are tried in increasing node index.
            draft_probs: float ``[num_nodes, V]``: row g = the distribution node j's token was
                drawn from (roots' rows unused); required by ``rrs`` and ``traversal``, ignored
                (may be None) by ``target_only`` and ``greedy``.
            method: ``"rrs"`` (default; SpecInfer's recursive rejection sampling), ``"traversal"``,
                ``"target_only"`` or ``"greedy"`` (see :func:`specsampler.verify_tree`).
            draft_sampling: ``"iid"`` (default) or ``"without_replacement"``: how sibling drafts
                were drawn from draft_probs (rrs, traversal).

        Losslessness: the default (``rrs``, ``iid``) emits tokens distributed exactly as the target
        when every node's token was drawn independently from its draft_probs row. For siblings
        drawn without replacement pass ``draft_sampling="without_replacement"``. A caller whose
        children are chosen deterministically (top-k, beam search, n-gram) gets the only
        lossless rule for them, target-only verification (draw from the target, descend to the
        child carrying the draw), with ``method="target_only"`` (draft_probs may then be None):
        MLC's i.i.d. rule on such children is off the target distribution.

        Returns:
            ``(sample_results, last_accepted_tree_node)``: per request, the :class:`SampleResult`
            of each accepted draft followed by exactly one correction or bonus token; and the
            request-local index of the last accepted node (0 when none). Probabilities: an
            accepted draft token's is its target probability at its parent's row; the final
            token's is its target probability at the last accepted node's row (the row it is
            drawn from in the all-accepted case, NOT the residual a rejection samples from:
            the residual depends on the random path, the target row is the model's view).
            ``top_prob_tokens``: the ``top_logprobs`` most likely tokens of that same target row
            when ``logprobs`` is on.
        """
        name = "batch_verify_draft_tokens_with_prob_after_top_p"
        op = f"Sampler.{name}"
        check_mode(op, validate)
        probs = self._probs(op, "probs", probs)
        num_nodes, V = probs.shape
        request_ids = _checked_list(op, "request_ids", request_ids, None, "", str)
        B = len(request_ids)
        cum = _host_ints(op, "cum_verify_lengths", cum_verify_lengths)
        lengths = _check_cum(op, cum, B, num_nodes)
        self._check_capacity(op, "cum_verify_lengths", num_nodes, "nodes")
        cfgs = _checked_list(op, "generation_cfg", generation_cfg, B, "one per request", GenerationConfig)
        rngs = _checked_list(op, "rngs", rngs, B, "one per request", RandomGenerator)
        drafts = _draft_tokens(op, draft_output_tokens, lengths, V)
        parents = _parent_ptr(op, token_tree_parent_ptr, cum, lengths)
        if method not in METHODS:
            fail(op, "method", f"one of {METHODS}", repr(method))
        if draft_sampling not in DRAFT_SAMPLING:
            fail(op, "draft_sampling", f"one of {DRAFT_SAMPLING}", repr(draft_sampling))
        sampled = method in ("rrs", "traversal")
        if draft_probs is not None:
            draft_probs = self._probs(op, "draft_probs", draft_probs)
            check_shape(op, "draft_probs", draft_probs, (num_nodes, V), "[num_nodes, V] (as probs)")
        elif sampled:
            fail(op, "draft_probs", f"a tensor [num_nodes, V] for method {method!r}", "None")
        if B == 0:
            return [], []
        if validate == "full":  # named in the caller's flat layout (verify_tree sees the rows padded per request)
            _check_flat_probs(op, "probs", probs, None, cum)
            if sampled:  # a root's draft row is never read
                _check_flat_probs(op, "draft_probs", draft_probs, torch.ones(num_nodes, dtype=torch.bool).index_fill_(
                    0, cum[:-1].clamp(max=max(num_nodes - 1, 0)), False), cum)
        counts = [_num_top(c) for c in cfgs]
        with self._traced(name, request_ids):
            dev, N = probs.device, int(lengths.max())
            j = torch.arange(N)
            present = j < lengths[:, None]  # [B, N]
            rows = cum[:-1, None] + torch.where(present, j, 0)  # global row of each node (absent: the root's)
            tree_parents = torch.full((B, N), -1, dtype=torch.int64)
            tree_parents[present] = parents
            tokens = torch.zeros(B, N, dtype=torch.int64)
            tokens[present & (j > 0)] = drafts
            tree = TokenTree.from_parents(tree_parents)
            if tree.device != dev:
                tree = tree.to(dev)
            rows, tokens = rows.to(dev), tokens.to(dev)
            uniform_sizes = bool((lengths == N).all())  # then the rows are already [B, N, V]: no copy

            def per_node(t: Tensor) -> Tensor:
                return t.reshape(B, N, V) if uniform_sizes else t[rows]

            res = verify_tree(per_node(probs), tokens, tree, per_node(draft_probs) if sampled else None,
                              method=method, draft_sampling=draft_sampling, rng=_philox(rngs, dev), validate=validate)
            drawn_at = rows.gather(1, res.path.clamp(min=0))  # [B, D+1]: global row each emitted token is drawn at
            emitted = res.tokens.clamp(min=0)
            top_ids, top_probs = _top_tokens(probs, drawn_at.view(-1), max(counts))
            K = top_ids.shape[1]
            tok, prob, n, last, ids, tps = _to_host(res.tokens, probs[drawn_at, emitted].float(),
                                                    res.num_accepted[:, None], res.last_node[:, None],
                                                    top_ids.view(B, -1), top_probs.view(B, -1))
            D1 = tok.shape[1]
            tok, prob, n, last = tok.long().tolist(), prob.tolist(), n[:, 0].long().tolist(), last[:, 0].long().tolist()
            ids, tps = ids.long().view(B, D1, K).tolist(), tps.view(B, D1, K).tolist()
            results = [[SampleResult((tok[b][k], prob[b][k]), _top_list(ids[b][k], tps[b][k], counts[b]))
                        for k in range(n[b] + 1)] for b in range(B)]
            return results, last

