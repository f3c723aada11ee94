"""Where the dynamic linker finds a program's libraries, worked out before it has run.

A probe or a traced library named before the target's loader ran ('libfoo:func' on a spawned
command) has to name the file the loader *will* map: with an RPATH/RUNPATH ($ORIGIN), an
LD_LIBRARY_PATH or an LD_PRELOAD that is often not the one the system's cache lists (a pyenv
Python's libpython next to the system's). This follows ld.so(8)'s search order over the
DT_NEEDED closure of the executable; a library nothing needs (a dlopen) is left to the cache.
"""

from __future__ import annotations

import functools
import os
import struct
from collections import deque
from collections.abc import Mapping

from dynprobe.errors import DynprobeError
from dynprobe.output.files import read_regular
from dynprobe.symbols import files
from dynprobe.symbols.elf import ElfImage, load_elf

_DEFAULT_DIRS = (
    "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib",
)  # fmt: skip
_MAX_OBJECTS = 2000


def is_x86_64_elf(path: str) -> bool:
    """A file the loader would take for an x86-64 process (it skips other classes and machines)."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return len(head) == 20 and head[:4] == b"\x7fELF" and head[4] == 2 and head[18:20] == b"\x3e\x00"


def _cache_mtime() -> int:
    try:
        return os.stat("/etc/ld.so.cache").st_mtime_ns
    except OSError:
        return 0


# /etc/ld.so.cache, as glibc's elf/cache.c writes it: a header, then entries of (flags, offset
# of the soname, offset of the path, -, hwcap), the offsets from the header's start; alone since
# glibc 2.32, before that after the old format's header and entries (which only it reads).
_CACHE_MAGIC = b"glibc-ld.so.cache1.1"
_CACHE_HEADER = struct.Struct("<20sII")  # magic and version, entries, bytes of strings (and more)
_CACHE_HEADER_SIZE = 48
_CACHE_ENTRY = struct.Struct("<iIIIQ")
_OLD_MAGIC = b"ld.so-1.7.0"
_OLD_HEADER = struct.Struct("<12sI")  # magic, entries of 12 bytes
_X86_64_LIBC6 = 0x0303  # FLAG_ELF_LIBC6 | FLAG_X8664_LIB64: what `ldconfig -p` calls (libc6,x86-64)
_MAX_CACHE = 64 << 20


@functools.lru_cache(maxsize=1)
def _ld_cache(mtime: int) -> dict[str, str]:
    try:
        return parse_ld_cache(read_regular("/etc/ld.so.cache", _MAX_CACHE))
    except OSError:  # (FileTooLarge, NotRegularFile too)
        return {}


def parse_ld_cache(data: bytes) -> dict[str, str]:
    """{soname: path} of the x86-64 entries of a loader's cache, the first path of each, as
    `ldconfig -p` lists them ({} for what is not such a cache)."""
    base = 0
    if data.startswith(_OLD_MAGIC) and len(data) >= _OLD_HEADER.size:
        base = -(-(_OLD_HEADER.size + 12 * _OLD_HEADER.unpack_from(data)[1]) // 8) * 8
    if len(data) < base + _CACHE_HEADER_SIZE:
        return {}
    magic, count, _ = _CACHE_HEADER.unpack_from(data, base)
    end = base + _CACHE_HEADER_SIZE + count * _CACHE_ENTRY.size
    if magic != _CACHE_MAGIC or end > len(data):
        return {}
    paths: dict[str, str] = {}
    for flags, key, value, _, _ in _CACHE_ENTRY.iter_unpack(data[base + _CACHE_HEADER_SIZE : end]):
        if flags & 0xFFFF == _X86_64_LIBC6:
            soname, path = _c_string(data, base + key), _c_string(data, base + value)
            if soname and path:
                paths.setdefault(soname, path)
    return paths


def _c_string(data: bytes, at: int) -> str | None:
    end = data.find(b"\0", at, at + 4096)
    return data[at:end].decode(errors="surrogateescape") if 0 <= at < end else None


def ld_cache() -> dict[str, str]:
    """/etc/ld.so.cache's x86-64 entries, as `ldconfig -p` lists them: {soname: path}."""
    return _ld_cache(_cache_mtime())


def _expand(directory: str, origin: str, cwd: str) -> str | None:
    """A search directory with $ORIGIN and $PLATFORM expanded (None: a token we do not know);
    relative (and empty) ones are relative to the process's working directory, as for ld.so."""
    for token, value in (("$ORIGIN", origin), ("${ORIGIN}", origin), ("$PLATFORM", "x86_64"),
                         ("${PLATFORM}", "x86_64")):  # fmt: skip
        directory = directory.replace(token, value)
    if "$" in directory:
        return None
    return os.path.join(cwd, directory)


def _search(
    name: str, needer: ElfImage, exe: ElfImage, env_dirs: list[str], cwd: str
) -> str | None:  # fmt: skip
    if "/" in name:
        path = os.path.join(cwd, name)
        return path if is_x86_64_elf(path) else None
    origin = os.path.dirname(needer.path)
    dirs: list[str | None] = []
    if not needer.runpath:  # DT_RPATH counts only without a DT_RUNPATH
        dirs += [_expand(d, origin, cwd) for d in needer.rpath]
        if needer is not exe and not exe.runpath:
            dirs += [_expand(d, os.path.dirname(exe.path), cwd) for d in exe.rpath]
    dirs += env_dirs
    dirs += [_expand(d, origin, cwd) for d in needer.runpath]
    for directory in dirs:
        if directory is not None and is_x86_64_elf(path := os.path.join(directory, name)):
            return path
    cached = ld_cache().get(name)
    if cached is not None and is_x86_64_elf(cached):
        return cached
    return next((p for d in _DEFAULT_DIRS if is_x86_64_elf(p := os.path.join(d, name))), None)


def loaded_libraries(exe: str, environ: Mapping[str, str] | None = None, cwd: str = "/") -> dict[str, str]:
    """The libraries the dynamic linker will load for `exe` (LD_PRELOAD first, then the
    DT_NEEDED closure, breadth first as ld.so loads them): {the name asked for: real path}.
    `environ` and `cwd` are the target's. Names it cannot find are left out (the loader will
    fail on them, not us)."""
    environ = environ or {}
    try:
        main = load_elf(exe)
    except DynprobeError:
        return {}
    env_dirs = [os.path.join(cwd, d) for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    preload = environ.get("LD_PRELOAD", "").replace(":", " ").split()
    found: dict[str, str] = {}
    by_soname: dict[str, str] = {}  # ld.so loads an object once: a name that is a loaded one's soname is it
    queue: deque[tuple[str, ElfImage]] = deque((name, main) for name in preload + main.needed)
    while queue and len(found) < _MAX_OBJECTS:
        name, needer = queue.popleft()
        if name in found:
            continue
        if name in by_soname:
            found[name] = by_soname[name]
            continue
        path = _search(name, needer, main, env_dirs, cwd)
        if path is None:
            continue
        found[name] = files.real_path(path)
        try:
            image = load_elf(path)
        except DynprobeError:
            continue
        if image.soname is not None:
            by_soname.setdefault(image.soname, found[name])
        queue.extend((n, image) for n in image.needed if n not in found)
    return found
