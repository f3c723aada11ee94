"""The rescue handler (arch/x86_64/rescue.py), run natively: installed as SIGTRAP's handler of a
child Python process, with a rescue page laid out as dynprobe lays it out, over small code of
the test's own. Each scenario runs in a process of its own (a failing one dies of its signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

# Seizes the thread, stops it, single-steps it and exits: the kernel lets the thread go with the
# step's trap flag still set, and the SIGTRAP of its step is the rescue handler's.
TRACER = textwrap.dedent(
    """
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    PTRACE_SINGLESTEP, PTRACE_SEIZE, PTRACE_INTERRUPT = 9, 0x4206, 0x4207
    tid = int(sys.argv[1])
    assert libc.ptrace(PTRACE_SEIZE, tid, None, None) == 0, ctypes.get_errno()
    assert libc.ptrace(PTRACE_INTERRUPT, tid, None, None) == 0, ctypes.get_errno()
    os.waitpid(tid, 0x40000000)  # __WALL: a thread of another process
    assert libc.ptrace(PTRACE_SINGLESTEP, tid, None, None) == 0, ctypes.get_errno()
    os._exit(0)
    """
)

HARNESS = textwrap.dedent(
    """
    import ctypes, mmap, os, resource, signal, struct, subprocess, sys, threading, time

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a death by SIGTRAP writes no core file
    from dynprobe.arch.x86_64.rescue import HANDLER_FLAGS, MEM_PATH, build_rescue_handler
    from types import SimpleNamespace
    from dynprobe.core.rescue import Rescue
    from dynprobe.ringbuf import layout as L

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    page = mmap.mmap(-1, L.RESCUE_BYTES)
    page_at = ctypes.addressof(ctypes.c_char.from_buffer(page))
    code_page = mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code_at = ctypes.addressof(ctypes.c_char.from_buffer(code_page))
    handler, restorer = build_rescue_handler(page_at)
    code_page[: len(handler)] = handler
    page[L.RESCUE_MEM_PATH : L.RESCUE_MEM_PATH + len(MEM_PATH)] = MEM_PATH
    struct.pack_into("<QQQQ", page, L.RESCUE_ACTION, code_at, HANDLER_FLAGS, code_at + restorer, (1 << 64) - 1)
    own = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    struct.pack_into("<Q", page, L.RESCUE_OWN, own)
    FUNCS = code_at + 0x8000

    def function(offset, code):
        code_page[0x8000 + offset : 0x8000 + offset + len(code)] = code
        return FUNCS + offset

    rescue = Rescue(page_at, page, code_at)

    def table(*entries):  # (as the tracer publishes it: sorted, into the half not in use)
        rescue.publish([
            SimpleNamespace(addr=addr, original=bytes([first]), rescue_wait=bool(flags & L.RESCUE_WAIT))
            for addr, first, flags in entries
        ])

    def call(addr):
        return ctypes.CFUNCTYPE(ctypes.c_long)(addr)()

    assert libc.syscall(13, signal.SIGTRAP, ctypes.c_void_p(page_at + L.RESCUE_ACTION), None, 8) == 0
    scenario = sys.argv[1]
    forty_two = function(0, bytes.fromhex("b82a000000c3"))  # mov eax, 42; ret
    if scenario == "site":
        # our int3 over its first byte: the byte goes back, the function runs whole
        code_page[0x8000] = 0xCC
        table((forty_two, 0xB8, 0), (forty_two + 64, 0x90, 0))
        print(call(forty_two), hex(code_page[0x8000]), call(forty_two))
    elif scenario == "site, waiting for the guardian":
        code_page[0x8000] = 0xCC
        table((forty_two, 0xB8, L.RESCUE_WAIT))
        started = time.monotonic()  # (before the timer: it may fire before this thread runs on)
        threading.Timer(0.2, lambda: struct.pack_into("<Q", page, L.RESCUE_RESCUED, 1)).start()
        print(call(forty_two), time.monotonic() - started >= 0.2)
    elif scenario == "moved back to the site":
        # the tracer had moved the thread back to the site (rip == site) before dying: here, an
        # int3 jumped over into the site
        before = function(0x100, bytes.fromhex("cc"))  # an int3 (not ours) right before the site
        function(0x101, bytes.fromhex("cc07000000c3"))  # the site: our int3 over `mov eax, 7`; ret
        table((before + 1, 0xB8, 0))
        print(call(before))
    elif scenario == "resumed as the tracer set it":
        tid = threading.get_native_id()
        resume = function(0x200, bytes.fromhex("ccb807000000c3"))  # int3; mov eax, 7; ret
        struct.pack_into("<QQ", page, L.RESCUE_MARK_TID, tid, resume + 1)
        print(call(resume))
    elif scenario == "a debugger's single step":
        # A tracer steps a thread spinning until a flag is set, and dies before it sees the trap.
        flag = function(0x380, bytes(8))
        # mov rax, flag; spin: cmp byte [rax], 0; je spin; mov eax, 5; ret
        spin = function(0x300, bytes.fromhex("48b8") + flag.to_bytes(8, "little")
                        + bytes.fromhex("803800 74fb b805000000 c3"))
        results = []
        spinner = threading.Thread(target=lambda: results.append(call(spin)))
        spinner.start()  # (wherever the step lands, in the spin or before it, the thread goes on)
        subprocess.run([sys.executable, "-c", sys.argv[3], str(spinner.native_id)], check=True)
        function(0x380, b"\x01")
        spinner.join()
        print(results[0])
    elif scenario == "the program's own single step":
        # pushfq; or qword [rsp], 0x100 (TF); popfq; nop; mov eax, 5; ret
        print("before", flush=True)
        call(function(0x300, bytes.fromhex("9c48810c24000100009d90b805000000c3")))
        print("after")
    elif scenario == "foreign int3":
        print("before", flush=True)
        call(function(0x400, bytes.fromhex("ccc3")))
        print("after")
    elif scenario == "sent":
        os.kill(os.getpid(), signal.SIGTRAP)  # (to this one thread: handled before kill returns)
        print("after")
    """
)


def run(scenario: str, own: int = 0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", HARNESS, scenario, str(own), TRACER], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip


@pytest.mark.parametrize(
    ("scenario", "out"),
    [
        ("site", "42 0xb8 42"),
        ("site, waiting for the guardian", "42 True"),
        ("moved back to the site", "7"),
        ("resumed as the tracer set it", "7"),
        ("a debugger's single step", "5"),
    ],
)
def test_a_thread_dynprobe_left_goes_on(scenario: str, out: str) -> None:
    r = run(scenario)
    assert (r.returncode, r.stdout.strip()) == (0, out), r.stderr


@pytest.mark.parametrize("scenario", ["foreign int3", "the program's own single step"])
def test_a_trap_not_dynprobe_s_kills_as_it_would_have(scenario: str) -> None:
    """SIG_DFL: the handler puts the default back and raises it again: the process dies of
    SIGTRAP, with its core, as without dynprobe."""
    r = run(scenario)
    assert (r.returncode, r.stdout.strip()) == (-signal.SIGTRAP, "before"), r.stderr


@pytest.mark.parametrize(("own", "code", "out"), [(0, -signal.SIGTRAP, ""), (1, 0, "after")])
def test_a_sent_sigtrap_goes_by_the_program_s_disposition(own: int, code: int, out: str) -> None:
    """kill(SIGTRAP): by default the program dies of it; where it ignored SIGTRAP, it goes on."""
    r = run("sent", own)
    assert (r.returncode, r.stdout.strip()) == (code, out), r.stderr
