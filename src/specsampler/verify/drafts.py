"""What chain and tree inputs share: the drafts as given, and what the PyTorch paths derive from them on first use
(the kernels take the drafts as given; at a small batch each derived tensor would be a launch on a GPU)."""

from __future__ import annotations

from torch import Tensor

from ..lazy import cached_property
from ..sampling.vocab import Vocab


class Drafts:
    """Mixed into :class:`~specsampler.verify.chain.ChainInputs` and :class:`~specsampler.verify.walks.TreeInputs`
    (frozen dataclasses with the fields ``V``, ``x_raw`` int64 ``[B, n]``, ``columns`` and ``given_usable``)."""

    V: int
    x_raw: Tensor
    columns: Vocab | None
    given_usable: Tensor | None

    @cached_property
    def x(self) -> Tensor:
        """int64 ``[B, n]``: the drafts clamped into ``[0, V)``."""
        return self.x_raw.clamp(0, self.V - 1)

    @cached_property
    def usable(self) -> Tensor:
        """bool ``[B, n]``: the drafts that may be accepted (``given_usable``, else :meth:`_usable`)."""
        return self.given_usable if self.given_usable is not None else self._usable()

    def _usable(self) -> Tensor:
        raise NotImplementedError

    @property
    def vocab(self) -> Vocab:
        """The columns the rows hold (the whole vocabulary unless ``columns``)."""
        return self.columns or Vocab(self.V)
