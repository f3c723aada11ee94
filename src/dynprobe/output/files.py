"""Files and directories dynprobe writes: created new, ours alone, never through a link.

dynprobe often runs as root, in directories other users can write (/tmp), and what it writes
holds data fetched from the traced process. So every output is created with O_CREAT | O_EXCL |
O_NOFOLLOW, mode 0600 (directories 0700), as perf writes perf.data: a symbolic link or anything
else planted at the name is refused, never followed or truncated. An earlier output of ours at
the name is kept as NAME.old (as perf and uftrace do); an earlier NAME.old goes only if it is
a regular file (a trace directory: `tracefile.create_trace_directory`).

Every failure is a DynprobeError of one line: what could not be written, and why.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO, TextIO

from dynprobe.errors import DynprobeError


class OutputError(DynprobeError):
    """A file dynprobe was asked to write cannot be."""


def _refused(path: str, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


def kind_of(path: str) -> str | None:
    """What is at `path` without following a link: 'file', 'directory', 'link', 'other', None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _refused(path, exc) from None
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return "directory" if stat.S_ISDIR(mode) else "other"


def keep_old(path: str) -> None:
    """An earlier regular file at `path` becomes PATH.old (an earlier PATH.old that is a regular
    file is replaced); anything else at `path` is refused."""
    kind = kind_of(path)
    if kind is None:
        return
    if kind != "file":
        what = {"link": "a symbolic link", "directory": "a directory"}.get(kind, "not a regular file")
        raise OutputError(f"{path} is {what}: dynprobe writes only files it creates; choose another name")
    old = path + ".old"
    if kind_of(old) not in (None, "file"):
        raise OutputError(f"{old} is in the way (not a regular file): move it, or choose another name")
    try:
        os.replace(path, old)
    except OSError as exc:
        raise _refused(path, exc) from None


def create_fd(path: str) -> int:
    """A new file at `path` (O_EXCL | O_NOFOLLOW, mode 0600 whatever the umask), open for
    writing; what was there is kept as PATH.old (`keep_old`)."""
    keep_old(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _refused(path, exc) from None
    os.fchmod(fd, 0o600)
    return fd


def create_binary(path: str) -> BinaryIO:
    return os.fdopen(create_fd(path), "wb")


def create_text(path: str) -> TextIO:
    return os.fdopen(create_fd(path), "w")


def make_directory(path: str) -> None:
    """A new directory at `path`, mode 0700 (its parent must exist)."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700, follow_symlinks=False)
    except OSError as exc:
        raise OutputError(f"cannot create the directory {path}: {exc.strerror or exc}") from None
