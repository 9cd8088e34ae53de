"""testbed.interrupts: an interrupt inside a held block comes as the block ends, not in it; the
first signal interrupts, the ones after it do nothing."""

from __future__ import annotations

import os
import signal

import pytest

from testbed.interrupts import arm, disarm, held, interrupt


@pytest.fixture
def handler():
    arm()  # as the command line does when a command starts
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)
    arm()


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
    arm()  # the next command
    with pytest.raises(KeyboardInterrupt):
        with held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # a second signal: not raised twice
            done.append("held")
    assert done[-1] == "held"


def test_outside_a_held_block_the_interrupt_comes_at_once(handler: None) -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("never")
    assert done == []


def test_the_signals_after_the_first_stop_nothing(handler: None) -> None:
    """A second Ctrl-C, or a SIGTERM after it, inside the teardown the first started: the
    teardown runs on (a KeyboardInterrupt inside ``except KeyboardInterrupt`` ended `testbed
    up` with a traceback, killed by SIGINT)."""
    done = []
    try:
        os.kill(os.getpid(), signal.SIGINT)
        done.append("never")
    except KeyboardInterrupt:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("teardown")
    assert done == ["teardown"]
    arm()  # a new command: the next signal stops it
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
    disarm()  # the command has ended (or testbed up's own handler took the signal)
    os.kill(os.getpid(), signal.SIGTERM)
