"""What symbols/elf.py reads out of an ELF file (its headers and symbols, where its branches
land), kept on disk (symbols/diskcache.py) so that later runs neither parse the file again nor
load pyelftools: libc's symbols and branch scan take tens of milliseconds, reading them back
about one.

An entry is named by a hash of what it was worked out from (the file's bytes, or a separate
debug file's identity: `key_of`) and of FORMAT; it holds a JSON object, arrays of 64-bit
integers (signed or not) and lists of strings (tens of thousands of names: JSON parses them ten
times slower), behind a SHA-256 of them all. One read back whose hash is not that of what
follows, or that does not parse as such, whatever the reason, is ignored (and written again):
what elf.py searches in order is in the order it was written in.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from array import array
from typing import Any

from dynprobe.symbols import diskcache

FORMAT = 2  # bump when what elf.py keeps changes
KIND = f"elf-{FORMAT}"
MOST = 1 << 30  # bytes an entry may have
_HEADER = struct.Struct("<8sQ32s")  # magic, bytes of JSON, SHA-256 of all that follows
_MAGIC = b"DPELF\0\0\1"
_TYPECODES = ("q", "Q")  # arrays of 64-bit integers, signed or not


def key_of(*parts: object) -> str:
    """The name of what was worked out from `parts` (a file's SHA-256, what was asked of it) by
    this version of the code that works it out (`_code`)."""
    return hashlib.sha256(":".join(map(str, (FORMAT, _code(), *parts))).encode()).hexdigest()


@functools.cache
def _code() -> str | None:
    """A hash of the modules whose work is kept (symbols/elf.py, symbols/elfparse.py): what an
    older dynprobe worked out is never taken for this one's (the branch scan of an older one
    may have found fewer targets). None where their source cannot be read (installed as .pyc
    alone): nothing is kept then, or taken."""
    digest = hashlib.sha256()
    for name in ("elf.py", "elfparse.py"):
        try:
            with open(os.path.join(os.path.dirname(__file__), name), "rb") as source:
                digest.update(source.read())
        except OSError:
            return None
    return digest.hexdigest()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number kept here")


Kept = tuple[dict[str, Any], dict[str, "array[int]"], dict[str, list[str]]]


def load(key: str) -> Kept | None:
    """The object, arrays and lists of strings kept under `key`, if a good entry is there."""
    data = diskcache.read(KIND, key, most=MOST) if _code() is not None else None
    if data is None or len(data) < _HEADER.size:
        return None
    magic, size, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC or _HEADER.size + size > len(data):
        return None
    if hashlib.sha256(memoryview(data)[_HEADER.size :]).digest() != digest:
        return None
    try:
        found = json.loads(data[_HEADER.size : _HEADER.size + size], parse_constant=_no_constant)
        meta, counts, lengths = found["meta"], found["arrays"], found["strings"]
        if not isinstance(meta, dict) or not isinstance(counts, dict) or not isinstance(lengths, dict):
            return None
        arrays: dict[str, array[int]] = {}
        at = _HEADER.size + size
        for name, (typecode, count) in counts.items():
            if typecode not in _TYPECODES or not isinstance(count, int) or count < 0 or at + 8 * count > len(data):
                return None
            arrays[name] = array(typecode, data[at : at + 8 * count])
            at += 8 * count
        strings: dict[str, list[str]] = {}
        for name, (count, length) in lengths.items():
            if not isinstance(length, int) or length < 0 or at + length > len(data):
                return None
            strings[name] = data[at : at + length].decode().split("\0") if count else []
            if len(strings[name]) != count:
                return None
            at += length
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    return (meta, arrays, strings) if at == len(data) else None


def store(key: str, meta: dict[str, Any], arrays: dict[str, array[int]], strings: dict[str, list[str]]) -> None:
    """`meta` (made of what JSON holds), `arrays` and `strings` (none with a NUL) kept under
    `key` (nothing when they cannot be)."""
    if _code() is None:
        return
    blobs = {name: "\0".join(values).encode() for name, values in strings.items()}
    text = json.dumps({
        "meta": meta, "arrays": {name: [values.typecode, len(values)] for name, values in arrays.items()},
        "strings": {name: [len(strings[name]), len(blob)] for name, blob in blobs.items()},
    }).encode()  # fmt: skip
    body = [text, *(values.tobytes() for values in arrays.values()), *blobs.values()]
    digest = hashlib.sha256()
    for chunk in body:
        digest.update(chunk)
    diskcache.write(KIND, key, [_HEADER.pack(_MAGIC, len(text), digest.digest()), *body])
