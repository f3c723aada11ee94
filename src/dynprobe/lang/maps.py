"""Where a bpftrace program's maps live (issue 21): one region of shared memory per program,
mapped into the target and into the tracer, holding every map as an open-addressing table that
the target's generated code updates in place with atomic instructions (so threads that hit at
once lose no update and the tracer merges nothing; plain ones for a map keyed by `tid` in every
body, whose entries each have one writer) and the tracer reads to print. Maps that only BEGIN,
END and interval bodies write are the tracer's own (lang/tracer.py).

A slot is: the keys' hash (0: free; claimed with `cmpxchg`), a word that says the entry exists
(set once its keys are written, cleared by `delete`), the keys (an integer a word, a string
STRING_WORDS words: its bytes, NUL-padded), then the value words. Keys are
told apart by their hash (63 bits of a mix of them, the lowest set: 0 is a free slot's), as
BPF's stack map tells stacks apart: two distinct keys share an entry with odds of 2^-63 a
pair. A full table (no free slot within `PROBES` of the hash's home) counts the update as
dropped, in the region's header, and the output says so.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import field
from typing import TYPE_CHECKING

from dynprobe.frozen import frozen
from dynprobe.lang import output
from dynprobe.lang import syntax as S
from dynprobe.lang.check import STRING_WORDS, Checked
from dynprobe.lang.target import PrintfRecord, map_key_kinds, map_value_kinds, thread_keyed_maps, tracer_maps

if TYPE_CHECKING:
    import numpy as np
else:
    from dynprobe.deferred import numpy as np

MASK64 = (1 << 64) - 1
HASH_SEED = 0x2545F4914F6CDD1D
HASH_MULTIPLIER = 0x9E3779B97F4A7C15
PROBES = 32  # slots looked at from a key's home before an update is dropped
DEFAULT_SLOTS = 4096  # entries a keyed map holds (a power of two)
SLOT_HASH, SLOT_READY, SLOT_KEYS = 0, 8, 16
HIST_WORDS = 66  # bucket -1 (negative), 0, then 1..64 (values in [2^(k-1), 2^k)), each one word up
INT64_MAX, INT64_MIN = (1 << 63) - 1, 1 << 63  # (as the words hold them)


def key_hash(keys: Sequence[int]) -> int:
    """The hash generated code gives `keys` (64-bit words): never 0, a free slot's."""
    value = HASH_SEED
    for key in keys:
        value = ((value ^ key) * HASH_MULTIPLIER) & MASK64
        value ^= value >> 32
    return value | 1


@frozen
class MapTable:
    """One map's table: `slots` slots of `slot_bytes`, at `offset` in the region."""

    name: str
    kind: str  # int, string, count, sum, min, max, avg, stats, hist, lhist; comm, func, probe (a word the tracer names)
    key_kinds: tuple[str, ...]  # a key each, as lang/target.py's map_key_kinds says
    slots: int
    offset: int
    index: int  # its dropped updates' counter: the region's word `index` + 1
    lhist: tuple[int, int, int] = (0, 0, 1)  # min, max, step
    one_writer: bool = False  # keyed by the thread that updates it: its values updated without a lock

    @property
    def keys(self) -> int:
        """The key words."""
        return sum(STRING_WORDS if kind == "string" else 1 for kind in self.key_kinds)

    @property
    def value_words(self) -> int:
        if self.kind == "string":
            return STRING_WORDS  # (its bytes, NUL-padded)
        if self.kind in ("avg", "stats"):
            return 2  # count, total
        if self.kind == "hist":
            return HIST_WORDS
        if self.kind == "lhist":
            low, high, step = self.lhist
            return (high - low) // step + 2  # below min, each step, at max and above
        return 1

    @property
    def value_at(self) -> int:
        """Where a slot's value begins."""
        return SLOT_KEYS + 8 * self.keys

    @property
    def slot_bytes(self) -> int:
        return self.value_at + 8 * self.value_words

    @property
    def initial(self) -> int:
        """What each value word holds before any update: min and max start at the far end."""
        return {"min": INT64_MAX, "max": INT64_MIN}.get(self.kind, 0)

    @property
    def dropped_at(self) -> int:
        return 8 * (1 + self.index)

    @property
    def sink(self) -> int:
        """Where a dropped update goes: the slot past the last, which nothing reads."""
        return self.offset + self.slots * self.slot_bytes

    def rows(self, words: np.ndarray) -> np.ndarray:
        """The table's slots in the region's 64-bit `words`, a row each (the sink not among them)."""
        start, step = self.offset // 8, self.slot_bytes // 8
        return words[start : start + self.slots * step].reshape(self.slots, step)

    def clear(self, words: np.ndarray, *, keep_keys: bool) -> None:
        """Every entry's values back to their start (`zero(@m)`), and unless `keep_keys` the
        entries hidden (`clear(@m)`; their slots stay their keys')."""
        rows = self.rows(words)
        if not keep_keys:
            rows[:, SLOT_READY // 8] = 0
        rows[:, self.value_at // 8 :] = self.initial

    def home(self, hash_value: int) -> int:
        return (hash_value >> 1) & (self.slots - 1)


@frozen
class Region:
    """Every map of a program, laid out: a word set once a probe called exit(), the dropped
    counters (one word a map), then the tables (each with its sink slot)."""

    tables: dict[str, MapTable]
    size: int

    def initialize(self, words: np.ndarray) -> None:
        """A fresh region (`words`, its 64-bit words, zeros) given what min and max start at."""
        for table in self.tables.values():
            table.clear(words, keep_keys=True)


def lay_out(checked: Checked, *, slots: int = DEFAULT_SLOTS) -> Region:
    """The region of `checked`'s maps: a map without keys has one slot, a keyed one `slots`; a
    map the tracer's bodies write (lang/tracer.py holds it) one, which nothing uses."""
    tables: dict[str, MapTable] = {}
    offset = (8 * (1 + len(checked.maps)) + 63) & ~63
    key_kinds, value_kinds, thread_keyed = map_key_kinds(checked), map_value_kinds(checked), thread_keyed_maps(checked)
    in_tracer = tracer_maps(checked)
    for index, (name, info) in enumerate(sorted(checked.maps.items())):
        kind = info.value.kind if info.value is not None else "int"
        kind = value_kinds.get(name, kind)  # (a map of comm, func or probe: a word the tracer names)
        keys = key_kinds.get(name, ())
        lhist = checked.lhist.get(name, (0, 0, 1))
        room = slots if keys and name not in in_tracer else 1
        table = MapTable(name, kind, keys, room, offset, index, lhist, one_writer=name in thread_keyed)
        tables[name] = table
        offset += ((table.slots + 1) * table.slot_bytes + 63) & ~63
    return Region(tables, max(offset, 64))


def entries(memory: bytes | memoryview | mmap.mmap, table: MapTable) -> list[output.Entry]:
    """The entries of `table` in a copy of the region (read while the target may still write:
    an entry whose keys are not written yet is left out)."""
    words = memoryview(memory)[table.offset : table.offset + table.slots * table.slot_bytes].cast("Q")
    step = table.slot_bytes // 8
    found: list[output.Entry] = []
    for slot in range(table.slots):
        base = slot * step
        if not words[base] or not words[base + 1]:
            continue
        values = words[base + table.value_at // 8 : base + step]
        found.append((_keys(table, words[base + 2 : base + table.value_at // 8]), value_of(table, values)))
    return found


def _keys(table: MapTable, words: memoryview) -> tuple[output.Key, ...]:
    """An entry's keys from its key words: integers signed, strings up to their first NUL (the
    words the tracer names, as they are)."""
    keys: list[output.Key] = []
    at = 0
    for kind in table.key_kinds:
        if kind == "string":
            keys.append(text_of(words[at : at + STRING_WORDS]))
            at += STRING_WORDS
        else:
            keys.append(as_signed(words[at]) if kind == "int" else int(words[at]))  # (a stack: its slot's address)
            at += 1
    return tuple(keys)


def text_of(words: Sequence[int]) -> str:
    """A string's words (its bytes, NUL-padded, as the target keeps them): up to the first NUL."""
    data = b"".join(int(word).to_bytes(8, "little") for word in words)
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


def words_of(text: str) -> list[int]:
    """`text_of` undone: a string's first STRING_SIZE - 1 bytes, NUL-padded, as words."""
    data = text.encode()[: 8 * STRING_WORDS - 1].ljust(8 * STRING_WORDS, b"\0")
    return [int.from_bytes(data[at : at + 8], "little") for at in range(0, len(data), 8)]


def dropped(memory: bytes | memoryview | mmap.mmap, table: MapTable) -> int:
    return int(memoryview(memory)[table.dropped_at : table.dropped_at + 8].cast("Q")[0])


def as_signed(word: int) -> int:
    """A 64-bit word as a signed integer."""
    return word - (1 << 64) if word >> 63 else word


def value_of(table: MapTable, values: Sequence[int]) -> output.Value:
    """An entry's value, as output prints it, from its value words."""
    if table.kind == "string":
        return text_of(values)
    if table.kind in ("avg", "stats"):
        return int(values[0]), as_signed(values[1])
    if table.kind in ("hist", "lhist"):
        return {bucket - 1: int(count) for bucket, count in enumerate(values) if count}
    return as_signed(values[0])


@frozen
class Clock:
    """nsecs = ticks * mult >> 32, plus `offset` (the tracer's clock at ticks 0); elapsed:
    nsecs less `start`."""

    mult: int
    offset: int
    start: int


@frozen
class LangBody:
    """One probe block of a checked program, placed: its maps' tables at `region` in the
    target, the records of the program's printf() calls."""

    block: S.ProbeBlock
    checked: Checked
    region: int
    tables: dict[str, MapTable]
    clock: Clock
    printfs: dict[S.Call, PrintfRecord] = field(default_factory=dict)

    @property
    def exit_flag(self) -> int:
        """The region's first word: nonzero once a probe called exit()."""
        return self.region
