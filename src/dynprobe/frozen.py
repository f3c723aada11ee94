"""`@frozen`: value classes whose fields nothing assigns once made, as `@dataclass(frozen=True)`
would keep them, but held to that by mypy (`dataclass_transform`: `make test` runs mypy --strict
over every module) rather than by methods at run time. Python 3.11 compiles each method a
dataclass generates on its own, and a frozen one's three more (`__setattr__`, `__delattr__`, and
an `__init__` that goes through `object.__setattr__`) make it twice the cost to define and
slower to make: most of importing dynprobe was that. Equal fields still mean equal values with
equal hashes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar, dataclass_transform, overload

_T = TypeVar("_T")


@overload
@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def frozen(cls: type[_T], /) -> type[_T]: ...
@overload
def frozen(*, slots: bool = False) -> Callable[[type[_T]], type[_T]]: ...


def frozen(cls: type[_T] | None = None, /, *, slots: bool = False) -> type[_T] | Callable[[type[_T]], type[_T]]:
    def make(cls: type[_T]) -> type[_T]:
        return dataclasses.dataclass(cls, unsafe_hash=True, slots=slots)

    return make if cls is None else make(cls)
