"""File identity (os.stat), asked once per file while a batch of work may assume that no file
changes under it: placing thousands of probes must not stat the same library thousands of times."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_snapshot: dict[str, os.stat_result] | None = None


def stat(path: str) -> os.stat_result:
    """os.stat(path), from the snapshot inside `unchanged()`."""
    if _snapshot is None:
        return os.stat(path)
    st = _snapshot.get(path)
    if st is None:
        st = _snapshot[path] = os.stat(path)
    return st


@contextlib.contextmanager
def unchanged() -> Iterator[None]:
    """Within the block, each file is stat'ed once (nested blocks share the outer snapshot)."""
    global _snapshot
    if _snapshot is not None:
        yield
        return
    _snapshot = {}
    try:
        yield
    finally:
        _snapshot = None
