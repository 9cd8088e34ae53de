"""The progress watchdog's rule (testbed/ps_backend/watchdog.py), which the PS and the
simulator both apply: by hand-set times, each condition fires just past its limit, not before."""

from __future__ import annotations

from testbed.ps_backend.watchdog import ALL_QUARANTINED_GRACE_S, ProgressWatchdog


def _check(dog: ProgressWatchdog, now_s: float, names: list[str], quarantined: int = 0,
           outstanding: int = 0, in_flight: int = 0) -> str | None:
    """``names``: the devices attached."""
    return dog.check(now_s, len(names), quarantined, outstanding, lambda: names,
                     lambda: in_flight)


def test_no_device_attached_fires_past_the_limit_and_names_the_last_to_go() -> None:
    dog = ProgressWatchdog.starting(10.0, 100.0)
    assert _check(dog, 101.0, ["a"], outstanding=5, in_flight=5) is None
    dog.progressed(101.5)
    dog.departed(102.0, "a", "lease_expired", "no message for more than 5 s")
    assert _check(dog, 102.0, [], outstanding=5) is None
    assert _check(dog, 111.0, []) is None  # 10 s
    reason = _check(dog, 111.5, [])
    assert reason == ("no device attached for 10 s (watchdog no_progress_s = 10); no device "
                      "has been attached since a left 10 s ago (lease_expired: no message for "
                      "more than 5 s)")
    # set once: a device back later does not clear it
    assert _check(dog, 112.0, ["b"]) == reason


def test_no_tile_accepted_counts_only_while_work_is_outstanding() -> None:
    dog = ProgressWatchdog.starting(10.0, 0.0)
    assert _check(dog, 50.0, ["a"]) is None  # idle
    assert _check(dog, 59.0, ["a"], outstanding=3, in_flight=3) is None
    assert _check(dog, 60.0, ["a"], outstanding=3, in_flight=3) is None
    reason = _check(dog, 60.5, ["a"], outstanding=3, in_flight=2)
    assert reason == ("no tile accepted for 10 s with 3 tiles outstanding (2 in flight on 1 "
                      "attached devices; watchdog no_progress_s = 10)")


def test_every_device_quarantined_fails_after_the_grace() -> None:
    dog = ProgressWatchdog.starting(120.0, 0.0)
    assert _check(dog, 1.0, ["b", "a"], quarantined=2, outstanding=4) is None
    dog.progressed(5.0)  # a result accepted meanwhile does not end the grace
    grace = ALL_QUARANTINED_GRACE_S
    assert _check(dog, 1.0 + grace, ["b", "a"], quarantined=2, outstanding=4) is None
    reason = _check(dog, 1.5 + grace, ["b", "a"], quarantined=2, outstanding=4)
    assert reason == ("every attached device is quarantined (2: a, b); no device may compute "
                      "the 4 tiles left")


def test_one_trusted_device_ends_the_grace() -> None:
    dog = ProgressWatchdog.starting(120.0, 0.0)
    _check(dog, 1.0, ["a", "b"], quarantined=2, outstanding=4)
    _check(dog, 2.0, ["a", "b", "c"], quarantined=2, outstanding=4)
    assert dog.all_quarantined_since is None
    assert _check(dog, 30.0, ["a", "b"], quarantined=2, outstanding=4) is None


def test_a_pause_moves_the_clocks_but_never_past_now() -> None:
    dog = ProgressWatchdog.starting(10.0, 0.0)
    _check(dog, 1.0, [], outstanding=2)
    dog.paused(30.0, now_s=25.0)  # the caller did not run for 30 s
    assert dog.last_attached_s == 25.0 and dog.last_progress_s == 25.0
    assert _check(dog, 34.0, [], outstanding=2) is None


def test_a_limit_of_zero_turns_it_off() -> None:
    dog = ProgressWatchdog.starting(0.0, 0.0)
    assert _check(dog, 1e9, [], outstanding=7) is None
