"""Hooked return addresses in a thread's stack, as the tracer and the guardian put them back.

A shadow-stack entry k (layout.py) names a frame's return-address slot and the original return
address; while the return is hooked, the slot holds trampoline entry point k. The tracer puts
the originals back (and the entry points again) around unwinding and at detach; the guardian
puts them back when the tracer died, reading the entries from the target's memory itself.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable

from dynprobe.ringbuf import layout as L

_SLOT_AND_RET = struct.Struct("<QQ")
assert L.ENTRY_RET == L.ENTRY_SLOT + 8


def swap_slots(
    entries: Iterable[tuple[int, int, int, int]], read_u64: Callable[[int], int], write_u64: Callable[[int, int], None]
) -> set[int]:
    """For each entry (k, slot, old, new) whose slot holds `old`, write `new` there. Several
    return probes of one call chain through each other (the first hooked address is the
    original of the next), so this goes round until nothing changes. Returns the entries done;
    a slot that cannot be read or written is left."""
    pending = list(entries)
    done: set[int] = set()
    changed = True
    while changed:
        changed = False
        for k, slot, old, new in pending:
            if k in done:
                continue
            try:
                if read_u64(slot) == old:
                    write_u64(slot, new)
                    done.add(k)
                    changed = True
            except OSError:
                continue
    return done


def entries_in(shadow: bytes) -> list[tuple[int, int, int]]:
    """(number, slot, original return address) of the entries in use in a shadow stack's bytes
    (entries [0, top) of it)."""
    out = []
    for k in range(min(len(shadow) // L.SHADOW_ENTRY, L.SHADOW_CAPACITY)):
        slot, original = _SLOT_AND_RET.unpack_from(shadow, k * L.SHADOW_ENTRY + L.ENTRY_SLOT)
        if slot:
            out.append((k, slot, original))
    return out


def trampoline_point(points: int, k: int) -> int:
    """Entry point k of a return trampoline whose entry point 0 is at `points`."""
    return points + k * L.TRAMPOLINE_STRIDE


def through_entry_points(ret: int, points: int, original: Callable[[int], int]) -> tuple[set[int], int]:
    """Where a hooked return goes in the end, and the entries it goes through: `ret`, or, when
    that is entry point k of the trampoline (entry point 0 at `points`: a return probe of the
    same call hooked it before), entry k's original return address (`original(k)`), and so on.
    Each entry once: a chain the target scribbled into a loop ends."""
    entries: set[int] = set()
    while True:
        k, rest = divmod(ret - points, L.TRAMPOLINE_STRIDE)
        if rest or not 0 <= k < L.SHADOW_CAPACITY or k in entries:
            return entries, ret
        entries.add(k)
        ret = original(k)
