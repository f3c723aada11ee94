"""What dynprobe works out from a file once and reads back in later runs (the unwind tables of
symbols/unwind_cache.py, the analysis of symbols/elf_cache.py), kept in files named by a hash.

The cache is $XDG_CACHE_HOME/dynprobe/KIND, else ~/.cache/... with the effective user's home
from the password database (never $HOME: under sudo that may be another user's). dynprobe often
runs as root, so the way there is walked a directory at a time without following a link, and
used only where each directory is the effective user's or root's and no one else may write it;
what is missing below the home is made (0700). A file is written under a name of its own
(O_EXCL | O_NOFOLLOW, 0600) and renamed into place; one read must be a regular file of the
effective user's, no larger than its reader allows. Callers check what they read as they would
a file from elsewhere. The cache is best effort: any failure reads as nothing kept, and a write
that fails leaves nothing behind. DYNPROBE_CACHE=0 turns it off.

A kind's entries hold at most BUDGET bytes, but for the one just written: after a write, those
read or written longest ago go (a read dates its entry anew: entries of an older dynprobe, or of
files since changed, are never read again), and so do temporary files a write killed midway left
over LEFT_BEHIND ago. A kind is named with its format, and the directory of an older format is
written no more: it keeps what it held.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import stat
import time
from collections.abc import Iterable

_KEY = re.compile(r"[0-9a-f]{64}")  # (a SHA-256: never a path)
_TEMPORARY = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{16}")  # (what `write` names a file until it is whole)
BUDGET = 256 << 20  # bytes of entries a kind keeps (the largest here take a few MB: python3's analysis)
LEFT_BEHIND = 3600  # seconds after which a temporary file is no write's any more


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


def _directory(kind: str) -> int | None:
    """The cache directory of `kind`, open (None: no cache to be had here)."""
    base = _base()
    if base is None:
        return None
    parts = [p for p in os.path.normpath(base).split("/") if p]
    fd: int | None = None
    try:
        fd = _open_dir("/", None, make=False, ours=False)
        for i, part in enumerate([*parts, "dynprobe", kind]):
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


def read(kind: str, key: str, *, most: int) -> bytes | None:
    """The bytes kept under `key` (a SHA-256 in hex) in the cache of `kind`, if they are there,
    ours and at most `most` bytes long."""
    if not _KEY.fullmatch(key):
        return None
    directory = _directory(kind)
    if directory is None:
        return None
    try:
        fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not _trusted(fd, ours=True) or info.st_size > most:
                return None
            data = f.read(info.st_size + 1)  # (one more: a file that grew since is not used)
            if len(data) != info.st_size:
                return None
            with contextlib.suppress(OSError):  # (used now: an eviction takes those used longest ago first)
                os.utime(fd)
    except OSError:
        return None
    finally:
        os.close(directory)
    return data


def write(kind: str, key: str, chunks: Iterable[bytes]) -> None:
    """`chunks` kept under `key` (a SHA-256 in hex) in the cache of `kind` (nothing when they
    cannot be)."""
    if not _KEY.fullmatch(key):
        return
    directory = _directory(kind)
    if directory is None:
        return
    temporary = f".{key}.{os.urandom(8).hex()}"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=directory)  # fmt: skip
        renamed = False
        try:
            with os.fdopen(fd, "wb") as f:
                f.writelines(chunks)
            os.rename(temporary, key, src_dir_fd=directory, dst_dir_fd=directory)
            renamed = True
        finally:
            if not renamed:  # (whatever stopped it: nothing half-written is left)
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=directory)
        _evict(directory, key)
    except OSError:
        pass
    finally:
        os.close(directory)


def _evict(directory: int, kept: str) -> None:
    """The entries of `directory` used longest ago removed until the others fit BUDGET (never
    `kept`, just written), and the temporary files of writes over LEFT_BEHIND ago."""
    entries: list[tuple[int, int, str]] = []
    left_behind = time.time() - LEFT_BEHIND
    with os.scandir(directory) as found:
        for entry in found:
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                info = entry.stat(follow_symlinks=False)
            except OSError:  # (another run took it away meanwhile)
                continue
            if _KEY.fullmatch(entry.name):
                entries.append((info.st_mtime_ns, info.st_size, entry.name))
            elif _TEMPORARY.fullmatch(entry.name) and info.st_mtime < left_behind:
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=directory)
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= BUDGET:
            break
        if name == kept:
            continue
        try:
            os.unlink(name, dir_fd=directory)
        except FileNotFoundError:  # (another run's eviction took it)
            pass
        except OSError:
            continue
        total -= size
