"""DYNPROBE_DEBUG=1: the engine's decisions on stderr (for bug reports; never on a hot path)."""

from __future__ import annotations

import os
import sys

ENABLED = bool(os.environ.get("DYNPROBE_DEBUG"))


def debug(message: str) -> None:
    if ENABLED:
        print(f"dynprobe[{os.getpid()}]: {message}", file=sys.stderr, flush=True)
