"""Unwind tables (arch/x86_64/unwind.py) kept on disk, named by a hash of the section they are
compiled from: a module's CFI is compiled once (python3's takes a quarter of a second), then read
back in a millisecond by every later run.

The cache is $XDG_CACHE_HOME/dynprobe/unwind-FORMAT, else ~/.cache/... with the effective user's
home from the password database (never $HOME: under sudo that may be another user's). dynprobe
often runs as root, so the way there is walked a directory at a time without following a link,
and used only where each directory is the effective user's or root's and no one else may write
it; what is missing below the home is made (0700). A file is written under a name of its own
(O_EXCL | O_NOFOLLOW, 0600) and renamed into place; one read must be a regular file of the
effective user's, of the size its header says, with rows this FORMAT writes, else it is
ignored (and written again). The cache is best effort: any failure leaves a table compiled as
if there were none. DYNPROBE_CACHE=0 turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import re
import secrets
import stat
import struct
from array import array

import numpy as np

from dynprobe.arch.x86_64.unwind import CfiSection, UnwindTable

FORMAT = 2  # bump when unwind.pack's rows or compile_sections' output change
MAX_ROWS = 1 << 24  # as the stack walker reads (codegen/stacks.py)
_HEADER = struct.Struct("<8sQQ")  # magic, rows, descriptions skipped
_MAGIC = b"DPUNWIND"
_KEY = re.compile(r"[0-9a-f]{64}")


def _base() -> str | None:
    if os.environ.get("DYNPROBE_CACHE") == "0":
        return None
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return xdg
    try:
        return os.path.join(pwd.getpwuid(os.geteuid()).pw_dir, ".cache")
    except KeyError:
        return None


def _trusted(fd: int, *, ours: bool) -> bool:
    """A directory (or file) only the effective user (or root, unless `ours`) may change: not
    writable by others, but for a directory of root's with the sticky bit (/tmp), where no one
    may take away or rename what is ours."""
    info = os.fstat(fd)
    if info.st_uid not in ((os.geteuid(),) if ours else (os.geteuid(), 0)):
        return False
    shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return not shared or (not ours and info.st_uid == 0 and bool(info.st_mode & stat.S_ISVTX))


def _open_dir(name: str, dir_fd: int | None, *, make: bool, ours: bool) -> int | None:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if not make:
            return None
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        fd = os.open(name, flags, dir_fd=dir_fd)
    if _trusted(fd, ours=ours):
        return fd
    os.close(fd)
    return None


def _directory() -> int | None:
    """The cache directory, open (None: no cache to be had here)."""
    base = _base()
    if base is None:
        return None
    parts = [p for p in os.path.normpath(base).split("/") if p]
    fd: int | None = None
    try:
        fd = _open_dir("/", None, make=False, ours=False)
        for i, part in enumerate([*parts, "dynprobe", f"unwind-{FORMAT}"]):
            if fd is None:
                return None
            below = _open_dir(part, fd, make=i >= len(parts) - 1, ours=i >= len(parts))
            os.close(fd)
            fd = below
        return fd
    except OSError:
        if fd is not None:
            os.close(fd)
        return None


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
    if not _KEY.fullmatch(key):
        return None
    directory = _directory()
    if directory is None:
        return None
    try:
        fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not _trusted(fd, ours=True):
                return None
            header = f.read(_HEADER.size)
            if len(header) != _HEADER.size:
                return None
            magic, rows, skipped = _HEADER.unpack(header)
            if magic != _MAGIC or rows > MAX_ROWS or info.st_size != _HEADER.size + 16 * rows:
                return None
            body = f.read(16 * rows + 1)
    except OSError:
        return None
    finally:
        os.close(directory)
    if len(body) != 16 * rows:
        return None
    starts = np.frombuffer(body, dtype="<u8", count=rows)
    packed = np.frombuffer(body, dtype="<i8", count=rows, offset=8 * rows)
    kinds, bp_rules = packed & 7, (packed >> 4) & 3
    if (starts[1:] < starts[:-1]).any() or (kinds > 4).any() or (bp_rules > 2).any() or (packed & 0xFFC0).any():
        return None  # (not one this FORMAT wrote)
    return UnwindTable(array("Q", body[: 8 * rows]), array("q", body[8 * rows :]), skipped)


def store(key: str, table: UnwindTable) -> None:
    """`table` kept under `key` (`key_of`; nothing when it cannot be)."""
    if not _KEY.fullmatch(key) or len(table) > MAX_ROWS:
        return
    directory = _directory()
    if directory is None:
        return
    temporary = f".{key}.{secrets.token_hex(8)}"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=directory)  # fmt: skip
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(table), table.skipped))
                f.write(table.starts.tobytes())
                f.write(table.rows.tobytes())
            os.rename(temporary, key, src_dir_fd=directory, dst_dir_fd=directory)
        except OSError:
            os.unlink(temporary, dir_fd=directory)
    except OSError:
        pass
    finally:
        os.close(directory)
