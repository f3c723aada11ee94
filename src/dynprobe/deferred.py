"""Modules imported at the first use of one of their names rather than when dynprobe is: numpy is
most of a short command's start-up, and `count`, `list` or `--version` never need it.

A module that defers one names it as `if TYPE_CHECKING: import numpy as np` / `else: from
dynprobe.deferred import numpy as np`. Its names then cost a dict lookup, as a module's do: the
first use copies them in.
"""

from __future__ import annotations

import importlib
import threading
import types
from typing import Any


class _Deferred(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._importing = threading.Lock()  # two threads' first uses import it once

    def __getattr__(self, name: str) -> Any:
        # Only names not copied in yet come here: after the first use, none of the module's own.
        with self._importing:
            module = importlib.import_module(self.__name__)
            self.__dict__.update(module.__dict__)
        return getattr(module, name)


numpy = _Deferred("numpy")
