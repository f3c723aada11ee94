"""gc_paused: bulk work without automatic collections, and the collector back after it."""

from __future__ import annotations

import gc

import pytest

from dynprobe.gcpause import gc_paused


def test_collection_is_paused_inside_and_resumed_after_even_on_error() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the outer block resumes it
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError
    assert gc.isenabled()


def test_a_caller_that_turned_collection_off_keeps_it_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
