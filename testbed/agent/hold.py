"""Holds that end on time on a busy host: sleep to a deadline at real-time priority.

Kept apart from the agent so that light programs (the link check's echo client) hold the way
the agent does without importing gRPC and the tensor code.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

# An emulated device's hold ends at a deadline; on a busy host a sleeping thread wakes late by
# the time the CPU's run queue makes it wait (bench/emulation_fidelity.py: p95 ~10-20 ms with 16
# agents on 2 busy cores), a wall-clock amount that only a larger time dilation hides. So the
# hold's sleep runs at real-time priority (SCHED_FIFO, lowest level) where the host allows it:
# the thread is then woken on time, reads the clock and drops back to normal priority before it
# does anything else (microseconds at RT; the compute itself never runs at RT).
HOLD_RT_PRIORITY = 1
# Even at real-time priority a sleep ends 20-35 us late on an idle host, ~70 us for sleeps of a
# few ms (timer and wake-up path; a one-off loop of hold_until), i.e. 10 % of a 0.3 ms hold (a
# laptop's small tile at D 3). The last SPIN_S of a hold shorter than SPIN_BELOW_S is therefore
# spun on the clock instead. Longer holds sleep to the end: there the lateness is under 1.5 %,
# and a spin at real-time priority takes the core from the PS and the other agents (docs/
# architecture.md, "Time").
SPIN_S = 150e-6
SPIN_BELOW_S = 5e-3
_rt_hold = [hasattr(os, "sched_setscheduler")]  # off after the host refused it once


def hold_until(deadline_s: float) -> float:
    """Sleep until the monotonic deadline_s; return the monotonic time the hold ended."""
    remaining = deadline_s - time.monotonic()
    if remaining <= 0:
        return time.monotonic()
    spin_s = SPIN_S if remaining < SPIN_BELOW_S else 0.0
    # only a normal thread switches (and back): one the caller made real-time already stays so
    if _rt_hold[0] and os.sched_getscheduler(0) == os.SCHED_OTHER:
        try:  # pid 0: this thread only
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(HOLD_RT_PRIORITY))
        except OSError as exc:  # not permitted (no CAP_SYS_NICE, an RT-less cgroup)
            _rt_hold[0] = False
            log.info("holds sleep at normal priority (%s): wake-ups may be late on a busy host",
                     exc)
        else:
            try:
                return _sleep_then_spin(deadline_s, spin_s)  # before the switch back (may yield)
            finally:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return _sleep_then_spin(deadline_s, spin_s)


def _sleep_then_spin(deadline_s: float, spin_s: float) -> float:
    time.sleep(max(0.0, deadline_s - spin_s - time.monotonic()))
    now = time.monotonic()
    while now < deadline_s:
        now = time.monotonic()
    return now
