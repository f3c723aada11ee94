"""What this machine's CPUs offer generated code: the flags of /proc/cpuinfo, the kernel's view
(features it has not enabled are not listed). Targets run on the tracer's machine, so its flags
are theirs."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def has_rdpid() -> bool:
    """`rdpid` reads the CPU number (TSC_AUX) in ~3 ns; `rdtscp`, which also does, waits for
    every earlier instruction (~19 ns against rdtsc's ~12 here)."""
    return "rdpid" in cpu_flags()
