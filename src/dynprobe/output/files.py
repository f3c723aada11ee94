"""Files and directories dynprobe writes (created new, ours alone, never through a link), and
the files it is handed to read (regular files only).

dynprobe often runs as root, in directories other users can write (/tmp), and what it writes
holds data fetched from the traced process. So every output is created with O_CREAT | O_EXCL |
O_NOFOLLOW, mode 0600 (directories 0700), as perf writes perf.data: a symbolic link or anything
else planted at the name is refused, never followed or truncated. An earlier output of ours at
the name is kept as NAME.old (as perf and uftrace do); an earlier NAME.old goes only if it is
a regular file (a trace directory: `tracefile.create_trace_directory`). A character device
(/dev/null) is written as it is.

Every failure is a DynprobeError of one line: what could not be written, and why. A file to
read (an ELF file, a trace) may be anything a path can name: a FIFO would block the open or the
read, a device never end; `open_regular` refuses them before any read.
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
    writing; what was there is kept as PATH.old (`keep_old`). A character device named (-o
    /dev/null) is written as it is: only root makes one, wherever it is."""
    try:
        device = stat.S_ISCHR(os.lstat(path).st_mode)
    except OSError:
        device = False
    if device:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            raise _refused(path, exc) from None
        if stat.S_ISCHR(os.fstat(fd).st_mode):
            return fd
        os.close(fd)  # put in its place since (a file someone else owns): never written
        raise OutputError(f"{path} changed as it was opened: choose another name")
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


class NotRegularFile(OSError):
    """A file dynprobe was handed to read is not a regular file (strerror: what it is)."""


class FileTooLarge(OSError):
    """A file dynprobe was handed to read is larger than it reads."""


def open_regular(path: str) -> BinaryIO:
    """`path` opened for reading if it is a regular file; anything else raises NotRegularFile
    without a read (O_NONBLOCK: opening a FIFO does not wait for a writer). Other failures
    raise their OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise NotRegularFile(0, what)
    return os.fdopen(fd, "rb")


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (`open_regular`; FileTooLarge if
    larger). Memory is taken for what the file holds, not for the limit."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FileTooLarge(0, f"larger than {limit >> 20} MiB")
        return f.read(size)


def make_directory(path: str) -> None:
    """A new directory at `path`, mode 0700 (its parent must exist)."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700, follow_symlinks=False)
    except OSError as exc:
        raise OutputError(f"cannot create the directory {path}: {exc.strerror or exc}") from None
