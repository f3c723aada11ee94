"""Unwind tables (arch/x86_64/unwind.py) kept on disk (symbols/diskcache.py), named by a hash of
the sections they are compiled from: a module's CFI is compiled once (python3's takes a quarter
of a second), then read back in a millisecond by every later run. A file read back must be the
size its header says, with addresses sorted and rows this FORMAT writes, else it is ignored (and
written again).
"""

from __future__ import annotations

import hashlib
import struct
from array import array

from dynprobe.arch.x86_64.unwind import BpRule, CfiSection, Kind, UnwindTable
from dynprobe.symbols import diskcache

FORMAT = 2  # bump when unwind.pack's rows or compile_sections' output change
KIND = f"unwind-{FORMAT}"
MAX_ROWS = 1 << 24  # as the stack walker reads (codegen/stacks.py)
_HEADER = struct.Struct("<8sQQ")  # magic, rows, descriptions skipped
_MAGIC = b"DPUNWIND"


def key_of(sections: list[CfiSection]) -> str:
    """The name a table is kept under: a hash of the sections it is compiled from (their bytes,
    where they are, which kind) and of FORMAT. A file that only claims another's build-id cannot
    put its rows in the other's place: the same name is the same sections, the same rows."""
    digest = hashlib.sha256(f"{FORMAT}:{len(sections)}:".encode())
    for section in sections:
        digest.update(f"{section.vaddr}:{int(section.debug_frame)}:{len(section.data)}:".encode())
        digest.update(section.data)
    return digest.hexdigest()


def load(key: str) -> UnwindTable | None:
    """The table kept under `key` (`key_of`), if there is a good one."""
    data = diskcache.read(KIND, key, most=_HEADER.size + 16 * MAX_ROWS)
    if data is None or len(data) < _HEADER.size:
        return None
    magic, rows, skipped = _HEADER.unpack_from(data)
    if magic != _MAGIC or len(data) != _HEADER.size + 16 * rows:
        return None
    import numpy as np

    starts = np.frombuffer(data, dtype="<u8", count=rows, offset=_HEADER.size)
    packed = np.frombuffer(data, dtype="<i8", count=rows, offset=_HEADER.size + 8 * rows)
    kinds, bp_rules = packed & 7, (packed >> 4) & 3
    if (starts[1:] < starts[:-1]).any() or (kinds > max(Kind)).any() or (bp_rules > max(BpRule)).any() \
            or (packed & 0xFFC0).any():  # fmt: skip
        return None  # (not one this FORMAT wrote)
    return UnwindTable(array("Q", starts.tobytes()), array("q", packed.tobytes()), skipped)


def store(key: str, table: UnwindTable) -> None:
    """`table` kept under `key` (`key_of`; nothing when it cannot be)."""
    if len(table) <= MAX_ROWS:
        diskcache.write(KIND, key, (_HEADER.pack(_MAGIC, len(table), table.skipped), table.starts.tobytes(),
                                    table.rows.tobytes()))  # fmt: skip
