"""The compiled walk behind `report` and `dump --flame` (callwalk.c): each thread's open calls,
per function its calls and times, per call path its self time. pip builds callwalk.c with the
package (an extension module, empty: its functions are called through ctypes).

Why C: an exit's call is the one its thread's earlier entries left on top, a dependency from
event to event that numpy can only work around in many passes; the loop in C reads a trace
several times faster than uftrace does, start-up included.
"""

from __future__ import annotations

import ctypes
import functools
from types import TracebackType

import numpy as np

from dynprobe.errors import DynprobeError
from dynprobe.tracefile import Chunk

NO_CALL = 1 << 62  # the shortest time of a function with no call yet
STATS = ("calls", "total", "self_time", "spent", "shortest", "longest", "least_self", "most_self")  # rows, in order

_POINTER = ctypes.c_void_p
_INT = ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL:
    try:
        from dynprobe.output import _callwalk  # type: ignore[attr-defined]
    except ImportError:
        raise DynprobeError(
            "dynprobe's compiled call walk (output/callwalk.c) is not built: reinstall dynprobe with a C compiler "
            "present (pip install builds it)"
        ) from None
    lib = ctypes.CDLL(_callwalk.__file__)
    lib.walk_new.argtypes, lib.walk_new.restype = [_INT, _INT, ctypes.c_int, _POINTER], _POINTER
    lib.walk_thread.argtypes, lib.walk_thread.restype = [_POINTER], _POINTER
    lib.walk_free.argtypes, lib.walk_free.restype = [_POINTER], None
    lib.walk_events.argtypes = [_POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT, ctypes.c_int]
    lib.walk_events.restype = ctypes.c_int
    lib.walk_forget.argtypes, lib.walk_forget.restype = [_POINTER], None
    lib.walk_paths.argtypes, lib.walk_paths.restype = [_POINTER, _POINTER, _POINTER, _POINTER], _INT
    return lib


class CallWalk:
    """One walk over a trace's chunks, thread by thread (a context manager: the C side's memory
    is freed on exit). `stats`: a row per STATS name, a column per function id; exits of
    function ids past `functions` close their calls but are not counted, and calls shorter
    than `threshold_ns` are not counted (their time still is their caller's)."""

    def __init__(self, functions: int, *, threshold_ns: int = 0, folded: bool = False) -> None:
        self._lib = _library()
        self.stats = np.zeros((len(STATS), max(functions, 1)), dtype=np.int64)
        self.stats[STATS.index("shortest")] = NO_CALL
        self.stats[STATS.index("least_self")] = NO_CALL
        self._walk = self._lib.walk_new(functions, threshold_ns, int(folded), self.stats.ctypes.data)
        if not self._walk:
            raise MemoryError("the call walk")
        self._threads: dict[int, int] = {}

    def __enter__(self) -> CallWalk:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._lib.walk_free(self._walk)
        self._walk = None

    def _thread(self, tid: int) -> int:
        thread = self._threads.get(tid)
        if thread is None:
            thread = self._threads[tid] = self._lib.walk_thread(self._walk)
            if not thread:
                raise MemoryError("the call walk")
        return thread

    def feed(self, chunk: Chunk, *, entries_only: bool = False) -> None:
        """Walks a chunk's events (`entries_only`: each opens a call, as the calls a forked
        child's thread began inside do)."""
        columns = (
            np.ascontiguousarray(chunk.kind, dtype=np.uint16),
            np.ascontiguousarray(chunk.frame, dtype=np.uint16),
            np.ascontiguousarray(chunk.func, dtype=np.uint32),
            np.ascontiguousarray(chunk.time_ns, dtype=np.int64),
        )
        pointers = (column.ctypes.data for column in columns)
        if self._lib.walk_events(self._walk, self._thread(chunk.tid), *pointers, len(chunk.kind), int(entries_only)):
            raise MemoryError("the call walk")

    def forget(self, tid: int) -> None:
        """Drops a thread's open calls (the events that follow come after a gap)."""
        self._lib.walk_forget(self._thread(tid))

    def paths(self) -> dict[tuple[int, ...], int]:
        """Self time per call path (function ids, outermost first), for the paths that have any."""
        nodes = self._lib.walk_paths(self._walk, None, None, None)
        caller, func, own = (np.zeros(nodes, dtype=np.int64) for _ in range(3))
        self._lib.walk_paths(self._walk, caller.ctypes.data, func.ctypes.data, own.ctypes.data)
        callers, funcs = caller.tolist(), func.tolist()
        paths = {}
        for node in np.flatnonzero(own).tolist():
            path, at = [], node
            while at:
                path.append(funcs[at])
                at = callers[at]
            paths[tuple(reversed(path))] = int(own[node])
        return paths
