"""The vocabulary a batch of rows covers, and the row operations that depend on it: sums (exact masses), values
at token ids, draws by inversion. :class:`Vocab` is the whole vocabulary on one device; the walks of the
verification methods call only these row operations (the vocabulary-parallel ops run their own walks over
shards, in few collective rounds: :mod:`specsampler.parallel.walks`)."""

from __future__ import annotations

from torch import Tensor

from .masses import divide_by, has_mass, row_mass, sample_by_inversion, sample_with_mass


class Vocab:
    """Rows ``[..., V]`` over the whole vocabulary of ``V`` tokens (columns = token ids)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    @property
    def width(self) -> int:
        """Columns of this device's rows (``V`` here; a shard's size on shards)."""
        return self.vocab_size

    def mass(self, w: Tensor, keepdim: bool = False) -> Tensor:
        """float64 ``[...]``: the exact mass (an integer) of each row of weights ``[..., width]`` in [0, 1]."""
        return row_mass(w, keepdim)

    def has_mass(self, w: Tensor, keepdim: bool = False) -> Tensor:
        """bool ``[...]``: whether each row of weights ``[..., width]`` has a mass above 0 (:meth:`mass` ``> 0``)."""
        return has_mass(w, keepdim)

    def normalise(self, w: Tensor) -> Tensor:
        """Rows divided by their exact sums (a new tensor; rows without mass all 0)."""
        return divide_by(w, self.mass(w, keepdim=True))

    def value(self, w: Tensor, ids: Tensor) -> Tensor:
        """float ``[R]``: ``w[r, ids[r]]`` for rows ``w`` ``[R, width]`` and token ids int64 ``[R]`` in ``[0, V)``."""
        return w.gather(1, ids[:, None])[:, 0]

    def zero_at(self, w: Tensor, ids: Tensor) -> Tensor:
        """``w`` ``[R, width]`` with 0 at token ids int64 ``[R]`` (a new tensor)."""
        return w.scatter(1, ids[:, None], 0.0)

    def draw(self, w: Tensor, u: Tensor) -> Tensor:
        """int64 ``[R]`` token ids: the draw by inversion of ``u`` float32 ``[R]`` over the rows' exact masses
        (:func:`specsampler.sampling.masses.sample_by_inversion`)."""
        return sample_by_inversion(w, u)

    def draw_with_mass(self, w: Tensor, u: Tensor, unit: bool = False) -> tuple[Tensor, Tensor]:
        """:meth:`draw` and :meth:`has_mass` of the same rows (int64 ``[R]``, bool ``[R]``), from one pass where the
        rows are wide. ``unit``: every weight is in [0, 1] or NaN already."""
        return sample_with_mass(w, u, unit)
