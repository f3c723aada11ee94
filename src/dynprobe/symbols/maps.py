"""/proc/PID/maps: which file is mapped where, and where a file offset lives in memory."""

from __future__ import annotations

import bisect
import os

from dynprobe.frozen import frozen
from dynprobe.symbols import files


@frozen
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    offset: int
    dev: int
    inode: int
    path: str

    @property
    def executable(self) -> bool:
        return "x" in self.perms

    @property
    def file_key(self) -> tuple[int, int]:
        return (self.dev, self.inode)


def root_of(pid: int) -> str:
    """'' when the process sees the files as we do; otherwise /proc/PID/root, through which the
    paths it sees (in /proc/PID/maps, /proc/PID/exe) reach its files: a process in a container,
    or in another mount namespace."""
    try:
        if os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            ours, theirs = os.stat("/"), os.stat(f"/proc/{pid}/root")
            if (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino):
                return ""
    except OSError:
        return ""
    return f"/proc/{pid}/root"


def read_maps(pid: int) -> list[Mapping]:
    """The mappings of `pid`, file paths as we reach them (root_of)."""
    out: list[Mapping] = []
    root = root_of(pid)
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        path = parts[5] if len(parts) > 5 else ""
        if root and path.startswith("/"):
            path = root + path
        out.append(Mapping(start, end, parts[1], int(parts[2], 16), os.makedev(major, minor), int(parts[4]), path))
    return out


def file_key(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, which is how /proc/PID/maps identifies it whatever the path."""
    try:
        st = files.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def maps_file(m: Mapping, key: tuple[int, int] | None, path: str) -> bool:
    """Whether mapping `m` maps the file with (dev, inode) `key` at `path`. On overlay file
    systems maps may show the underlying inode, so a matching path counts too."""
    return (key is not None and m.file_key == key) or (m.path == path and bool(path))


def address_of_offset(maps: list[Mapping], key: tuple[int, int] | None, path: str, offset: int) -> int | None:
    """Where file offset `offset` of the file (`key`, `path`) is mapped executable, or None."""
    for m in maps:
        if m.executable and maps_file(m, key, path) and m.offset <= offset < m.offset + (m.end - m.start):
            return m.start + (offset - m.offset)
    return None


def load_bias(maps: list[Mapping], key: tuple[int, int] | None, path: str, first_page: int) -> int | None:
    """What to add to the file's link-time addresses for where they are (its first page, link
    address `first_page`, is the mapping of offset 0), or None if it is not mapped. For data:
    a file offset may be mapped twice (read-only data, and the first page of RELRO data)."""
    for m in maps:
        if m.offset == 0 and maps_file(m, key, path):
            return m.start - first_page
    return None


def mapping_at(maps: list[Mapping], addr: int) -> Mapping | None:
    """The mapping holding `addr` (`maps` in address order, as /proc lists them)."""
    i = bisect.bisect_right(maps, addr, key=_start) - 1
    return maps[i] if i >= 0 and addr < maps[i].end else None


def _start(m: Mapping) -> int:
    return m.start
