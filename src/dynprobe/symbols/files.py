"""File identity (os.stat, the real path), asked once per file while a batch of work may assume
that no file changes under it: placing thousands of probes must not stat the same library, nor
resolve its path, thousands of times."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

_snapshot: dict[str, os.stat_result] | None = None
_real_paths: dict[str, str] = {}  # (within the snapshot's block)


def stat(path: str) -> os.stat_result:
    """os.stat(path), from the snapshot inside `unchanged()`."""
    if _snapshot is None:
        return os.stat(path)
    st = _snapshot.get(path)
    if st is None:
        st = _snapshot[path] = os.stat(path)
    return st


_PROC_ROOT = re.compile(r"/proc/\d+/root(?=/)")


def real_path(path: str) -> str:
    """os.path.realpath, except that a path through another process's root (/proc/PID/root/...,
    see maps.root_of) keeps that root, which realpath would follow to our '/'; the rest is only
    normalized (the kernel resolves its links as that process sees them when it is opened).
    Inside `unchanged()`, once per path."""
    m = _PROC_ROOT.match(path)
    if m:
        return m.group(0) + os.path.normpath(path[m.end() :])
    if _snapshot is None:
        return os.path.realpath(path)
    real = _real_paths.get(path)
    if real is None:
        real = _real_paths[path] = os.path.realpath(path)
    return real


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
        _real_paths.clear()
