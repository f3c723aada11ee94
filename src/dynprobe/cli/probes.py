"""What `trace`, `count` and `hist` share: probe options, checking every input before anything is
patched, placing many probes (with a progress bar on a terminal), and the per-probe statistics."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from dynprobe.actions.filter import parse_filter
from dynprobe.cli.common import (
    UsageError,
    add_output_option,
    byte_size,
    close_output,
    exit_code,
    interval_seconds,
    open_output,
    open_session,
    positive_count,
    run_target,
)
from dynprobe.core.probe import Probe
from dynprobe.core.session import Session
from dynprobe.core.stacks import MAX_FRAMES
from dynprobe.errors import DynprobeError, OptimizeRefusal
from dynprobe.frozen import frozen
from dynprobe.gcpause import gc_paused
from dynprobe.ringbuf.layout import SHADOW_CAPACITY, check_ring_bytes
from dynprobe.spec.model import ProbeSpec
from dynprobe.spec.parser import parse_probe

if TYPE_CHECKING:
    from rich.progress import Progress

PROGRESS_FROM = 200  # probes: fewer attach too fast for a bar to help


def add_aggregate_options(p: argparse.ArgumentParser, what: str) -> None:
    """What `count`, `hist` and `latency` take beyond their probes: when to print, what, where."""
    p.add_argument("-i", "--interval", type=interval_seconds, metavar="SECONDS",
                   help=f"also print, every SECONDS, the {what} of that interval (the total at the end)")  # fmt: skip
    p.add_argument("--top", type=positive_count, metavar="N", help="only the N probes hit most (funccount's -T)")
    p.add_argument("--all", action="store_true", help="also the probes with no hits (left out by default)")
    add_output_option(p, f"the {what}")


def frames(text: str) -> int:
    """An argparse type: a number of frames, 1 to MAX_FRAMES."""
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_FRAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of frames (1 to {MAX_FRAMES})")
    return int(text)


def add_max_frames_option(p: argparse.ArgumentParser, with_option: str | None = None) -> None:
    """--max-frames N: how many frames a stack is walked to (`with_option`: the option it is for)."""
    when = f"with {with_option}: " if with_option else ""
    p.add_argument("--max-frames", type=frames, default=MAX_FRAMES, metavar="N",
                   help=f"{when}walk at most N frames (1-{MAX_FRAMES}, default {MAX_FRAMES})")  # fmt: skip


def add_probe_options(p: argparse.ArgumentParser, filter_help: str = "only hits where EXPR holds") -> None:
    p.add_argument("specs", nargs="*", metavar="SPEC", help="probe specifications")
    p.add_argument(
        "-f", "--file", action="append", default=[], metavar="SPECFILE",
        help="read probe specs from a file ('-': standard input), one a line ('#' starts a comment)",
    )  # fmt: skip
    p.add_argument("--filter", metavar="EXPR", help=f"{filter_help}, e.g. 'a == 5 and (b > 0 or c != 1)'")
    p.add_argument("--trap", "--no-optimize", dest="trap", action="store_true",
                   help="keep every probe a trap probe (no jump optimization), for comparisons")  # fmt: skip
    p.add_argument("--ring-size", type=byte_size, default=None, metavar="BYTES",
                   help="per-thread ring buffer size, a power of two (64K, 16M; default 1M)")  # fmt: skip
    p.add_argument("--stats", action="store_true",
                   help="at the end, per probe: mode (optimized, or trap and why), hits, missed, lost")  # fmt: skip


def add_ring_options(p: argparse.ArgumentParser) -> None:
    """For commands that write records: by default a thread whose ring is full waits for the
    reader (the program slows down, no event is lost); `--lossy` counts the record lost;
    `--flight-recorder` keeps the newest records only."""
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lossy", action="store_true",
                      help="when a thread's ring is full, lose the record (counted) instead of waiting for "
                           "the reader (the program then never slows down for dynprobe)")  # fmt: skip
    mode.add_argument("--flight-recorder", action="store_true",
                      help="keep only the newest events, as many as the rings hold (older ones give way, "
                           "counted): written when the program ends, and at each SIGUSR2 to dynprobe (kill -USR2 "
                           "DYNPROBE_PID) those made since the last that the rings still hold")  # fmt: skip


def set_ring_mode(session: Session, *, lossy: bool, flight_recorder: bool) -> None:
    """What a full ring does: wait for the reader (default), lose the record, or give up its
    oldest. From now on SIGUSR2 takes a flight recorder's snapshot, and in the other modes says
    it is ignored: its default action, death, would end a run meant for a flight recorder
    (run_target ignores it once the run is over)."""
    if lossy:
        session.wait_for_room = 0
    session.flight_recorder = flight_recorder
    if flight_recorder:
        signal.signal(signal.SIGUSR2, lambda signum, frame: session.request_snapshot())
    else:
        signal.signal(signal.SIGUSR2, lambda signum, frame: print(SNAPSHOT_IGNORED, file=sys.stderr))


SNAPSHOT_IGNORED = "dynprobe: SIGUSR2 ignored: a snapshot is a flight recorder's (--flight-recorder)"
RING_WAS_FULL = "a thread's ring was full (--lossy), or stayed full longer than a thread waits for the reader"
MAX_SPEC_FILE = 64 << 20  # bytes of a spec file read at most


def read_spec_files(paths: list[str]) -> list[str]:
    """The specs of each file, one a line ('#' starts a comment); '-' is the standard input."""
    specs: list[str] = []
    for path in paths:
        name = "the standard input" if path == "-" else f"spec file {path}"
        try:
            if path == "-":
                data = sys.stdin.buffer.read(MAX_SPEC_FILE + 1)
            else:
                with open(path, "rb") as f:
                    data = f.read(MAX_SPEC_FILE + 1)
        except OSError as exc:
            raise DynprobeError(f"cannot read {name}: {exc.strerror}") from exc
        if len(data) > MAX_SPEC_FILE:
            raise DynprobeError(f"{name} is larger than {MAX_SPEC_FILE >> 20} MiB: not a list of probe specs")
        try:
            lines = data.decode().splitlines()
        except UnicodeDecodeError:
            raise DynprobeError(f"{name} is not text (UTF-8): give a file of probe specs, one a line") from None
        specs.extend(s for line in lines if (s := line.split("#", 1)[0].strip()))
    return specs


@dataclass
class ProbeRequest:
    """What a probe command's arguments ask for: the specifications and how to place them."""

    specs: list[ProbeSpec]
    filter: str | None
    trap: bool
    ring_size: int | None
    lossy: bool = False
    flight_recorder: bool = False


def check_request(args: argparse.Namespace) -> ProbeRequest:
    """Every spec, the filter and the ring size checked before a process is touched."""
    with gc_paused():
        specs = [parse_probe(s) for s in list(args.specs) + read_spec_files(args.file)]
    if not specs:
        raise UsageError("no probe given: add a SPEC or -f SPECFILE")
    if args.filter is not None:
        for spec in specs:
            parse_filter(args.filter, spec.args)
    if args.ring_size is not None:
        problem = check_ring_bytes(args.ring_size)
        if problem is not None:
            raise UsageError(problem)
    return ProbeRequest(specs, args.filter, args.trap, args.ring_size, getattr(args, "lossy", False),
                        getattr(args, "flight_recorder", False))  # fmt: skip


def configure(session: Session, request: ProbeRequest) -> None:
    session.optimize = not request.trap
    if request.ring_size is not None:
        session.ring_bytes = request.ring_size
    set_ring_mode(session, lossy=request.lossy, flight_recorder=request.flight_recorder)


def place_all(session: Session, request: ProbeRequest, place: Callable[[ProbeSpec], Probe]) -> list[Probe]:
    """Place every probe (one batch: optimized at its end); progress bars on a terminal when
    there are many."""
    configure(session, request)
    with session.batch():  # (patterns expanded with the maps the batch reads once)
        specs = [one for spec in request.specs for one in session.expand(spec)]
    if len(specs) < PROGRESS_FROM or not sys.stderr.isatty():
        with session.batch():
            return [place(spec) for spec in specs]
    with progress_bar() as progress:
        placing = progress.add_task("placing probes", total=len(specs))
        optimizing = progress.add_task("optimizing", total=None, visible=False, start=False)

        def optimized(done: int, total: int) -> None:
            if not done:
                progress.start_task(optimizing)
            progress.update(optimizing, completed=done, total=total, visible=True)

        with session.batch(progress=optimized):
            probes = []
            for spec in specs:
                probes.append(place(spec))
                progress.advance(placing)
        return probes


def say_placed(probes: list[Probe], pid: int | None) -> None:
    """Attached to a running process, dynprobe runs until Ctrl-C: say when the probes are in."""
    if pid is not None:
        what = "1 probe" if len(probes) == 1 else f"{len(probes)} probes"
        print(f"dynprobe: {what} placed in pid {pid}; Ctrl-C ends (the program runs on)", file=sys.stderr)


@contextmanager
def progress_bar() -> Iterator[Progress]:
    # Imported here: rich takes ~40 ms to import, and most runs show no bar.
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # On stderr, the terminal the caller checked: stdout may be a file of events or counts.
    with Progress(*columns, transient=True, console=Console(stderr=True)) as progress:
        yield progress


def mode_text(probe: Probe) -> str:
    if probe.mode.value == "optimized":
        return "optimized"
    reason = probe.trap_reason
    return f"trap ({reason.name})" if reason is not None else "trap (not optimized yet when the target ended)"


MAXACTIVE_IN_SPEC = "a larger MAXACTIVE, as in 'r{}:EVENT ...',"


def note_missed_returns(probes: list[Probe], option: str = MAXACTIVE_IN_SPEC) -> None:
    """A return probe that missed calls for want of instances says how to keep them (`option`:
    how, with {} for a number)."""
    for p in probes:
        if p.is_return and p.maxactive and p.nmissed:
            more = min(4 * p.maxactive, SHADOW_CAPACITY)
            print(f"dynprobe: {p.name} missed {p.nmissed} calls: more than {p.maxactive} were pending on a thread "
                  f"(recursion); {option.format(more)} keeps more", file=sys.stderr)  # fmt: skip


def note_rings(session: Session) -> None:
    """A program that waited for dynprobe to read its events ran slower than it would have: say
    so, and what avoids it; a flight recorder's events that gave way to newer ones: how many."""
    overwritten = session.records_overwritten
    if overwritten:
        print(f"dynprobe: flight recorder: {overwritten} older records gave way to newer ones (a larger "
              "--ring-size keeps more)", file=sys.stderr)  # fmt: skip
    waited = session.records_waited
    if waited:
        times = f"{waited} time{'' if waited == 1 else 's'}"
        print(f"dynprobe: the program waited {times} for its events to be read (a thread's ring was full): "
              "--lossy never waits, a larger --ring-size waits less", file=sys.stderr)  # fmt: skip


def note_traps(probes: list[Probe]) -> None:
    """Probes hit as traps though they could have been jumps (not --trap) say so: each hit cost
    the target a stop, ~10 us, which a user reading counts would not guess (--stats says it too)."""
    # (in this order: a jump is a flag; hits are a read of every thread's counters; the reason
    # a look at every site)
    traps = [p for p in probes if p.mode.value != "optimized" and p.hits and p.trap_reason != OptimizeRefusal.DISABLED]
    if traps:
        named = ", ".join(f"{p.name} ({p.trap_reason.name if p.trap_reason else 'not optimized yet'})"
                          for p in traps[:5]) + (", ..." if len(traps) > 5 else "")  # fmt: skip
        which = "the probe that stayed a trap" if len(traps) == 1 else f"the {len(traps)} probes that stayed traps"
        print(f"dynprobe: each hit cost a stop (~10 us) for {which}: {named}", file=sys.stderr)


def note_never_placed(probes: list[Probe]) -> None:
    """A probe on a library the program never loaded waited to the end (its counts are 0
    because it never was in the program, not because nothing called it): say so (one refused
    where the library is mapped was said when it was: not this)."""
    waited = [p for p in probes if not p.sites and p.not_placed is None]
    if waited:
        named = ", ".join(f"{p.name} ({p.location.basename})" for p in waited[:5]) + (
            ", ..." if len(waited) > 5 else ""
        )
        which = "1 probe" if len(waited) == 1 else f"{len(waited)} probes"
        print(f"dynprobe: {which} never placed: the program did not load the library: {named}", file=sys.stderr)


def print_stats(probes: list[Probe], stats: bool) -> None:
    """One line per probe on stderr: where, hits, missed, lost if any (with --stats: lost and
    mode always); records lost to a full ring say how to keep them."""
    if not probes:
        return
    stream = sys.stderr
    width = max(len(p.name) for p in probes)
    print(f"dynprobe: {len(probes)} probe(s)", file=stream)
    for p in probes:
        where = f"{p.location.basename}:{p.location.label}"
        line = f"  {p.name:<{width}}  {where:<28} hits={p.hits} missed={p.nmissed}"
        if stats:
            line += f" lost={p.lost} mode={mode_text(p)}"
        elif p.lost:
            line += f" lost={p.lost}"
            paths = ", ".join(f"{k.value} {n}" for k, n in sorted(p.resumes.items(), key=lambda kv: kv[0].value))
            if paths:
                line += f"  ({paths})"
        print(line, file=stream)
    lost = sum(p.lost for p in probes)
    if lost:
        print(f"dynprobe: {lost} records lost: {RING_WAS_FULL}; a larger --ring-size keeps more", file=stream)


@frozen
class Tally:
    """What `count`, `hist` and `latency` print of a probe: its hits, missed and histogram, in
    all or in one interval."""

    probe: Probe
    hits: int
    missed: int
    histogram: list[int]

    @classmethod
    def of(cls, probe: Probe) -> Tally:
        return cls(probe, *probe.hits_and_missed(), list(probe.histogram))

    def since(self, before: Tally | None) -> Tally:
        if before is None:
            return self
        histogram = [now - then for now, then in zip(self.histogram, before.histogram, strict=True)]
        return Tally(self.probe, self.hits - before.hits, self.missed - before.missed, histogram)

    @property
    def seen(self) -> int:
        """Hits, missed calls and (a return probe's) returns: 0 for a probe nothing reached."""
        return self.hits + self.missed + sum(self.histogram)


@frozen
class Shown:
    """The tallies a report prints (in the order given) and what it leaves out: probes with no
    hits (unless --all), those past the N most hit (--top N)."""

    tallies: list[Tally]
    title: str | None
    no_hits: int = 0
    past_top: int = 0

    @classmethod
    def of(cls, tallies: list[Tally], title: str | None, args: argparse.Namespace) -> Shown:
        # (a lone probe is shown, hit or not: its row is the whole answer)
        shown = tallies if args.all or len(tallies) == 1 else [t for t in tallies if t.seen]
        no_hits = len(tallies) - len(shown)
        if args.top is not None and len(shown) > args.top:
            most = {id(t) for t in sorted(shown, key=lambda t: -t.seen)[: args.top]}
            shown = [t for t in shown if id(t) in most]
        return cls(shown, title, no_hits, len(tallies) - no_hits - len(shown))

    def left_out_line(self) -> str | None:
        parts = [f"{self.past_top} past the top {len(self.tallies)}"] if self.past_top else []
        parts += [f"{self.no_hits} with no hits (--all shows them)"] if self.no_hits else []
        return f"  (not shown: {', '.join(parts)})" if parts else None


def write_report(out: TextIO, lines: list[str]) -> None:
    """A report in one write: the program may write to the same stream (its stderr is ours),
    and a line of its own must not land inside one of ours."""
    out.write("\n".join(lines) + "\n")
    out.flush()


def run_aggregating(
    args: argparse.Namespace,
    command: list[str],
    request: ProbeRequest,
    place: Callable[[Session, ProbeSpec], Probe],
    report: Callable[[Shown, TextIO], None],
    more_instances: str = MAXACTIVE_IN_SPEC,
) -> int:
    """`count`, `hist` and `latency`: place the probes, run the target, `report` every -i
    seconds what that interval saw (the time as title, as bcc's funccount and funclatency
    print), and at the end everything (title "total:" after intervals, else None), on the
    standard error or -o FILE."""
    last: dict[int, Tally] = {}

    def run() -> int:
        out = open_output(args.output)
        with open_session(args, command) as session:
            probes = place_all(session, request, lambda spec: place(session, spec))

            def interval() -> None:
                now = [Tally.of(p) for p in probes]
                report(Shown.of([t.since(last.get(t.probe.index)) for t in now], time.strftime("%H:%M:%S"), args), out)
                last.update((t.probe.index, t) for t in now)

            status = run_target(session, args.interval, interval, ready=lambda: say_placed(probes, args.pid))
            session.close()
            report(Shown.of([Tally.of(p) for p in probes], "total:" if last else None, args), out)
            close_output(out)
            if args.stats:
                print_stats(probes, True)
            elif not request.trap:
                note_traps(probes)
            note_missed_returns(probes, more_instances)
            note_never_placed(probes)
        if args.pid is not None:
            return 0
        return status if status is not None else 130

    return exit_code(run, args.output)
