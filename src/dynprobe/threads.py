"""dynprobe's own threads (the consumer, the waker, the upcall server): started with every signal
blocked, and placed on CPUs. Signals
sent to the process (a stop's SIGCHLD, Ctrl-C, SIGTERM) must reach the tracing thread, whose
wait for stops they end; a thread of ours that took one would discard a SIGCHLD or leave a
Ctrl-C unseen. Blocked from birth (a thread inherits its creator's mask), not from its first
line: one could come in between. Our forks hold signals too (`signals_blocked`): a handler that
raises (Ctrl-C, SIGTERM) while `os.fork` runs its at-fork callbacks (logging registers one) has
its exception printed and dropped, and the run would go on as if the signal never came."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def signals_blocked() -> Iterator[set[int | signal.Signals]]:
    """Every signal blocked in the block (pending ones are handled as it ends); gives the mask to
    put back, for a forked child to set before exec (exec keeps the mask)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        yield previous
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_without_signals(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread running `target` with every signal blocked."""
    with signals_blocked():
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    return thread


def place(thread: threading.Thread | None, cpus: set[int]) -> None:
    """Run `thread` (if it runs) on these CPUs."""
    if thread is not None and thread.native_id is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(thread.native_id, cpus)
