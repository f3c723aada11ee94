"""Module tracking: what each traced process maps, the probes' sites kept in step with it (a
library loaded later gets its pending probes, one unloaded loses its sites), the loader's hook
that says when that happens, and addresses turned into names (`symbolize_in`) with the maps seen
last, which outlive the process.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

from dynprobe.arch.x86_64 import Regs
from dynprobe.core.engine import Mechanism
from dynprobe.core.patching import Patcher
from dynprobe.core.probe import Probe, Site
from dynprobe.core.processes import ProcessTable
from dynprobe.core.traced import MemoryReader, TracedProcess
from dynprobe.errors import ProbeRefused, Refusal, SymbolError
from dynprobe.spec.fetch import FetchContext
from dynprobe.symbols import files
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import (
    Mapping,
    address_of_offset,
    file_key,
    load_bias,
    mapping_at,
    maps_file,
    read_maps,
    root_of,
)
from dynprobe.symbols.resolve import Location

LOADER_HOOK = "_dl_debug_state"
RSEQ_OFFSET = "__rseq_offset"  # glibc 2.35+: where its threads' rseq areas are, from the thread pointer


def sites_to_recheck(sites: dict[int, Site], before: list[Mapping] | None, maps: list[Mapping]) -> list[int]:
    """The sites that may have lost their module: all but those inside an executable mapping
    that is the same in `before` (the map of the last sync) and in `maps`. A library load
    re-syncs a process of 10^4 sites without looking at each. (A site outside every mapping of
    `before`, placed with a map read after it, is looked at.)"""
    if before is None:
        return list(sites)
    kept = sorted((m for m in set(before).intersection(maps) if m.executable), key=lambda m: m.start)
    addrs = sorted(sites)
    recheck, at = [], 0
    for m in kept:
        inside = bisect.bisect_left(addrs, m.start, at)
        recheck += addrs[at:inside]
        at = bisect.bisect_left(addrs, m.end, inside)
    return recheck + addrs[at:]


def symbolize_in(maps: list[Mapping], addr: int) -> str | None:
    """`function+0xoff` for an address of a process with these maps (`symbol`-typed fetches)."""
    m = mapping_at(maps, addr)
    if m is None or not m.path.startswith("/"):
        return None
    try:
        image = load_elf(m.path)
    except SymbolError:
        return None
    vaddr = image.offset_to_vaddr(addr - m.start + m.offset)
    return image.symbolize(vaddr) if vaddr is not None else None


class ModulesEngine(Protocol):
    """What module tracking asks of the runtime (core/runtime.py)."""

    processes: ProcessTable
    patcher: Patcher
    mechanisms: tuple[Mechanism, ...]
    probes: list[Probe]

    def warn(self, message: str) -> None: ...


class Modules:
    """The maps of every traced process, and the probes' sites kept in step with them."""

    def __init__(self, engine: ModulesEngine) -> None:
        self.engine = engine
        self.last: dict[int, list[Mapping]] = {}  # pid -> its maps at the last sync (for symbolizing after it ended)
        self.now: dict[int, list[Mapping]] = {}  # within a batch: the maps, read once

    def maps_of(self, pid: int) -> list[Mapping]:
        """The maps of `pid` now (within a batch, as read at its start)."""
        return self.now.get(pid) or read_maps(pid)

    def forked(self, parent: TracedProcess, child: TracedProcess) -> None:
        if parent.pid in self.last:  # the child's sites were placed with its parent's map
            self.last[child.pid] = self.last[parent.pid]
        else:
            self.last.pop(child.pid, None)  # (an earlier process's, if its pid was reused)

    def sync_process(
        self, proc: TracedProcess, only: Probe | None = None, strict: bool = False, maps: list[Mapping] | None = None
    ) -> None:
        """Make the process's sites match the probes and what is mapped now: arm probes whose file
        is mapped, forget sites whose module went away (dlclose). `strict`: a probe refused
        raises (else it is a warning)."""
        with files.unchanged():
            self._sync_sites(proc, only, strict, maps or read_maps(proc.pid))

    def _sync_sites(self, proc: TracedProcess, only: Probe | None, strict: bool, maps: list[Mapping]) -> None:
        patcher = self.engine.patcher
        before, self.last[proc.pid] = self.last.get(proc.pid), maps
        if only is None:
            for addr in sites_to_recheck(proc.sites, before, maps):
                site = proc.sites[addr]
                m = mapping_at(maps, addr)
                if (
                    m is None
                    or not m.executable
                    or (
                        not any(maps_file(m, file_key(p.location.path), p.location.path) for p in site.probes)
                        and site.internal is None
                    )
                ):
                    patcher.forget_site(proc, addr)
            self._install_loader_hook(proc, maps)
        keys: dict[str, tuple[int, int] | None] = {}
        for probe in [only] if only else list(self.engine.probes):
            if probe.removed:
                continue
            placed = proc.sites.get(probe.sites.get(proc.pid, -1))
            if only is None and placed is not None and probe in placed.probes:
                continue  # armed already (its module's mapping was checked above)
            loc = probe.location
            if loc.path not in keys:
                keys[loc.path] = file_key(loc.path)
            where = address_of_offset(maps, keys[loc.path], loc.path, loc.offset)
            if where is None:
                if any(m.path == f"{loc.path} (deleted)" for m in maps):
                    refused = ProbeRefused(Refusal.FILE_REPLACED, f"{loc.basename}:{loc.label}")
                    if strict:
                        raise refused
                    probe.not_placed = refused
                    self.engine.warn(f"{probe.name}: {refused} (pid {proc.pid})")
                continue
            existing = proc.sites.get(where)
            if existing is not None and probe in existing.probes:
                continue
            try:
                patcher.install(proc, probe, where)
            except ProbeRefused as refused:
                if strict:
                    raise
                probe.not_placed = refused
                self.engine.warn(f"{probe.name}: {refused} (pid {proc.pid})")

    def _modules_changed(self, proc: TracedProcess) -> None:
        """The loader mapped or unmapped libraries: arm pending probes, and tell the mechanisms."""
        self.sync_process(proc)
        for mechanism in self.engine.mechanisms:
            mechanism.modules_changed(proc, self.last[proc.pid])

    def _install_loader_hook(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        if proc.loader_hook in proc.sites:
            return
        path = self._interpreter(proc)
        if path is None:
            return  # static binary: nothing is loaded later
        try:
            loader = load_elf(path)
        except SymbolError:
            return
        func = loader.own_function(LOADER_HOOK) or loader.by_name.get(LOADER_HOOK)
        if func is None:
            self.engine.warn(f"{path} has no {LOADER_HOOK}: libraries loaded later will not be probed")
            return
        offset = loader.vaddr_to_offset(func.addr)
        addr = address_of_offset(maps, file_key(path), path, offset) if offset is not None else None
        if addr is None:
            return
        location = Location(path, offset or 0, func.addr, func, LOADER_HOOK)

        def on_hook(tid: int, regs: Regs) -> None:
            self._modules_changed(proc)

        self.engine.patcher.add_internal_site(proc, location, addr, on_hook)
        proc.loader_hook = addr

    def _interpreter(self, proc: TracedProcess) -> str | None:
        """The path of the process's dynamic linker, as we reach it (None: a static binary)."""
        try:
            interp = load_elf(proc.exe).interp
        except SymbolError:
            return None
        return files.real_path(root_of(proc.pid) + interp) if interp else None

    def rseq_offset_at(self, proc: TracedProcess) -> int | None:
        """Where the process's glibc (2.35 and later) keeps `__rseq_offset`: the distance from a
        thread's pointer to the rseq area glibc registers for it, where the kernel keeps the
        thread's CPU number (a load: cheaper than `rdpid`). None without it."""
        maps = self.maps_of(proc.pid)
        for path in (proc.exe, self._interpreter(proc)):
            if path is None:
                continue
            try:
                image = load_elf(path)
            except SymbolError:
                continue
            vaddr = image.own_object(RSEQ_OFFSET)  # the program's first: a copy relocation's
            bias = load_bias(maps, file_key(path), path, image.first_page) if vaddr is not None else None
            if vaddr is not None and bias is not None:
                return bias + vaddr
        return None

    # --- names ----------------------------------------------------------------------------------
    def symbolizer(self, pid: int) -> Callable[[int], str | None]:
        """Symbolizes addresses of `pid` when asked, which may be after it exited (events are
        formatted by the consumer): then with the maps dynprobe saw last."""

        def symbolize(addr: int) -> str | None:
            maps = read_maps(pid) or self.last.get(pid, [])
            return symbolize_in(maps, addr)

        return symbolize

    @staticmethod
    def symbol_resolver(site: Site) -> Callable[[str], int | None]:
        """@SYM of fetch arguments, as addresses in the process of `site`."""
        location = site.probes[0].location

        def address(name: str) -> int | None:
            vaddr = load_elf(location.path).address_of(name)
            return None if vaddr is None else site.addr - location.vaddr + vaddr

        return address

    def symbol_resolver_for(self, probe: Probe, proc: TracedProcess) -> Callable[[str], int | None]:
        site = proc.sites.get(probe.sites.get(proc.pid, -1))
        return self.symbol_resolver(site) if site is not None and site.probes else (lambda name: None)

    def fetch_context(self, proc: TracedProcess, tid: int, regs: Regs, probe: Probe) -> FetchContext:
        """What the probe's fetches read on thread `tid` of `proc`."""
        return FetchContext(
            regs, MemoryReader(proc.tracee), lambda: proc.comm(tid), self.symbol_resolver_for(probe, proc),
            self.symbolizer(proc.pid),
        )  # fmt: skip
