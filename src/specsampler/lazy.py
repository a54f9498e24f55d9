"""``cached_property`` that torch.compile traces on every Python the package supports.

``functools.cached_property`` takes a lock before Python 3.12, which dynamo refuses (``Unsupported context manager
RLock``), so an op reading one inside ``torch.compile(fullgraph=True)`` failed on 3.10 and 3.11. The inputs' derived
tensors are computed once per call on one thread: no lock is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class cached_property:  # noqa: N801  (named as the functools one it stands in for)
    """A read-only attribute computed by ``fn(obj)`` on first access, then kept in the instance's ``__dict__``."""

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)  # found there from now on (this is a non-data descriptor)
        return value
