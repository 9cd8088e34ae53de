"""testbed.interrupts: an interrupt inside a held block comes as the block ends, not in it."""

from __future__ import annotations

import os
import signal

import pytest

from testbed.interrupts import held, interrupt


@pytest.fixture
def handler():
    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_an_interrupt_in_a_held_block_is_raised_as_it_ends(handler: None) -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with held():
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode
            done.append("written")
            with held():  # nested: still held until the outer block ends
                done.append("counted")
            done.append("after the inner block")
    assert done == ["written", "counted", "after the inner block"]
    # nothing is left pending: the next block runs whole and raises nothing
    with held():
        done.append("again")
    assert done[-1] == "again"


def test_outside_a_held_block_the_interrupt_comes_at_once(handler: None) -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("never")
    assert done == []
