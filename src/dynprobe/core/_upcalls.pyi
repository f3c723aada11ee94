"""core/upcalls.c: the upcall server's wait for a request, write-back and answer."""

from array import array

from typing_extensions import Buffer

def set_layout(
    *,
    state: int,
    sleeping: int,
    cpu: int,
    request: int,
    answered: int,
    prefetch_from: int,
    prefetch_to: int,
    spin_ns: int,
) -> None: ...
def next_request(bells: array[int], askers: list[memoryview], start: int) -> int: ...
def write_back(area: Buffer, at: int, regs: Buffer) -> None: ...
def answer(cells: Buffer, cpu: int) -> bool: ...
