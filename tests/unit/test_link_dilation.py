"""A new time dilation reaches the links: the PS's request, the run owner's answer, the tc
commands that move a shaped egress in place."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from testbed.emulator.link_dilation import (
    APPLIED,
    DilationFollower,
    DilationRequester,
    LinksDidNotFollow,
)
from testbed.emulator.network.mininet import Egress, tc_change_commands, tc_commands


def _follow(run_dir: Path, apply, stop: threading.Event) -> threading.Thread:
    follower = DilationFollower(run_dir, apply)

    def loop() -> None:
        while not stop.wait(0.01):
            follower.poll()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_the_ps_returns_once_the_owner_applied_each_new_dilation(tmp_path: Path) -> None:
    applied: list[float] = []
    stop = threading.Event()
    thread = _follow(tmp_path, applied.append, stop)
    request = DilationRequester(tmp_path, timeout_s=10)
    request(6.5)
    assert applied == [6.5]
    request(6.5)  # a second change to the same D is a request of its own
    request(13.0)
    stop.set()
    thread.join()
    assert applied == [6.5, 6.5, 13.0]


def test_the_owners_failure_fails_the_ps_with_its_reason(tmp_path: Path) -> None:
    def broken(dilation: float) -> None:
        raise RuntimeError("tc in host tbx1d0 failed: RTNETLINK answers: No such device")
    stop = threading.Event()
    thread = _follow(tmp_path, broken, stop)
    with pytest.raises(LinksDidNotFollow, match="No such device"):
        DilationRequester(tmp_path, timeout_s=10)(4.0)
    stop.set()
    thread.join()


def test_no_owner_times_out_and_an_old_answer_does_not_count(tmp_path: Path) -> None:
    # the answer a PS before a resume got (same count, another pid) is not this PS's
    (tmp_path / APPLIED).write_text('{"id": "1-1", "dilation": 4.0, "error": null}')
    started = time.monotonic()
    with pytest.raises(LinksDidNotFollow, match="within 0.3 s"):
        DilationRequester(tmp_path, timeout_s=0.3)(4.0)
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize("netem", [False, True])
@pytest.mark.parametrize("acks_first", [False, True])
def test_change_commands_move_every_class_of_an_egress_in_place(netem: bool,
                                                                acks_first: bool) -> None:
    before = Egress("tbx1s0e3", 8e6, 0.010, 0.0, 100)
    after = Egress("tbx1s0e3", 2e6, 0.040, 0.0, 100)  # D x 4
    added = [c for c in tc_commands(before, netem, acks_first) if c.startswith("class add")]
    changed = tc_change_commands(after, netem, acks_first)
    classes = [c for c in changed if c.startswith("class change")]
    # the same classes, each at the new rate; no qdisc replaced (queued packets stay)
    assert [c.split("htb")[0].replace("class add", "") for c in added] == \
        [c.split("htb")[0].replace("class change", "") for c in classes]
    assert all("ceil 2000000bit" in c for c in classes)
    assert all("8000000bit" not in c for c in changed)
    assert not any(c.startswith("qdisc replace") or c.startswith("qdisc add") for c in changed)
    delays = [c for c in changed if c.startswith("qdisc change")]
    assert len(delays) == ((2 if acks_first else 1) if netem else 0)
    assert all("delay 40000us" in c for c in delays)


def test_a_slow_egress_holds_two_frames_of_credit_and_a_fast_one_a_millisecond():
    """What an egress's bucket holds after an idle moment leaves faster than the link: at 3.5
    Mbit/s a 15 kB floor passed 34 ms of traffic at once (small tiles then crossed slow links
    faster than their bound allows); the floor is two frames, and above 24 Mbit/s 1 ms."""
    def bursts(rate_bps: float) -> set[str]:
        return {word for c in tc_commands(Egress("tbx1d0e0", rate_bps, 0.0, 0.0, None),
                                          False, True)
                for word in c.split() if word.endswith("b") and word[:-1].isdigit()}
    assert bursts(3.5e6) == {"3028b"}
    assert bursts(100e6) == {"12500b"}
    assert bursts(1e9) == {"125000b"}
