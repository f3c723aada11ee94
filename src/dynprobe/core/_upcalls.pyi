"""core/upcalls.c: the upcall server's wait for a request, and its answer."""

from array import array

from typing_extensions import Buffer

def set_layout(
    *,
    state: int,
    sleeping: int,
    cpu: int,
    request: int,
    answered: int,
    frame: int,
    prefetch_to: int,
    spin_ns: int,
) -> None: ...
def next_request(bells: array[int], askers: list[memoryview], start: int) -> int: ...
def answer(cells: Buffer, cpu: int, regs: Buffer | None) -> bool: ...
