"""Synthetic churn: alternating sessions and absences per device, seeded.

Each device alternates between a *session* (present) and an *absence*. Lengths are drawn
independently per device from

* ``exponential`` with mean ``session_mean_s`` / ``absence_mean_s`` (memoryless, the classic
  availability model), or
* ``weibull`` with shape ``k`` and the scale chosen so that the mean is the given one:
  ``scale = mean / Γ(1 + 1/k)`` (mean of Weibull(k, λ) is ``λ Γ(1 + 1/k)``). ``k < 1`` gives the
  heavy-tailed sessions measured on real mobile devices (many short, a few very long).

**Diurnal availability.** Without it, the long-run fraction of time a device is present is
``a0 = S / (S + A)`` (S, A: session and absence means). With amplitude ``α`` and period ``P``
(24 h by default), the target availability at time t is
``a(t) = clip(a0 · (1 + α cos(2π (t - t_peak) / P)), 0.01, 0.99)`` and an absence that starts at
t has mean ``A(t) = S (1 - a(t)) / a(t)``, so that S / (S + A(t)) = a(t). Sessions keep mean S.
A device starts present with probability a(0).

**Departures.** A session ends with ``crash`` with probability ``crash_fraction``, else
``leave``. Times are rounded to milliseconds (the precision a trace file keeps).

**Limits** (:meth:`SessionModel.problems`, each named as the CLI option that sets it), so that
generation stays quick (measured: the largest accepted run, :data:`MAX_GENERATED_EVENTS`
events, is drawn in about 5 s) and the parameters mean something:

* the Weibull shape ``k`` is in [:data:`MIN_SHAPE`, :data:`MAX_SHAPE`] = [0.1, 20]. Below 0.1,
  ``Γ(1 + 1/k)`` explodes (3.6e6 at 0.1, 3e64 at 0.02, past a float below 0.0059): the median
  length is then mean x 1e-7 or less, nearly every session is shorter than the millisecond a
  trace keeps and is dropped, and the loop draws ~1e9 samples per kept event (0.02 ran for
  minutes, 0.001 overflowed). Above 20 the length is practically constant (standard deviation
  6 % of the mean).
* the duration, the means and the diurnal period are in [1 ms, a year] (1 ms: the precision of
  a trace row; a year: :data:`~testbed.churn.trace.MAX_TIME_S`, the latest time a trace may
  name), the diurnal peak in [0, a year].
* before drawing anything, the expected number of events, ``2 n D / (S + A_min)`` for n devices
  over D with ``A_min`` the shortest mean absence of the daily cycle (``S (1 - a_max) / a_max``
  at the peak, ``a_max = clip(a0 (1 + α), 0.01, 0.99)``), must be at most
  :data:`MAX_GENERATED_EVENTS`. Using ``A`` instead of ``A_min`` missed that a cycle shortens
  the absences (and the clip at 0.01 caps them at 99 S): with ``S = 1 ms, A = 1 h, α = 0.5`` the
  old estimate was 16 events an hour for 8 devices, where the formula above gives 576,000 an
  hour (arithmetic; a one-off generation drew some 360,000).

**Seeding.** Device i uses ``numpy.random.default_rng([seed, i])``: the same seed and device
list give the same trace, and one device's stream does not depend on the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # numpy is imported where it draws, so the CLI can read the limits cheaply
    import numpy as np

from testbed.churn.trace import MAX_TIME_S, ChurnEvent, TraceEvent

DISTRIBUTIONS = ("exponential", "weibull")
MAX_GENERATED_EVENTS = 1_000_000  # about 30 MB of trace: replays far longer than any run
MIN_AVAILABILITY, MAX_AVAILABILITY = 0.01, 0.99
MIN_SHAPE, MAX_SHAPE = 0.1, 20.0  # Weibull k; why these, in the module docstring
MIN_LENGTH_S = 1e-3  # the shortest duration, mean or period: a trace row's precision


def _range_problem(option: str, value: float, low: float, high: float, why: str) -> str | None:
    """A problem naming ``option`` when ``value`` is not in [low, high] (or is nan)."""
    if low <= value <= high:
        return None
    return f"{option}: must be from {low:,.10g} to {high:,.10g}{why}, got {value:g}"


@dataclass(frozen=True)
class SessionModel:
    """How long devices stay and stay away; see the module docstring for the formulas."""

    session_mean_s: float
    absence_mean_s: float
    distribution: str = "exponential"  # exponential | weibull
    weibull_shape: float = 1.0  # k; used by weibull only
    diurnal_amplitude: float = 0.0  # α in [0, 1]; 0 = no daily cycle
    diurnal_period_s: float = 86400.0  # P
    diurnal_peak_s: float = 0.0  # t_peak: when availability is highest
    crash_fraction: float = 0.0  # share of departures that are crashes

    def problems(self) -> list[str]:
        """Every parameter out of range, named as the CLI option that sets it."""
        out = []
        if self.distribution not in DISTRIBUTIONS:
            out.append(f"--dist: expected one of {DISTRIBUTIONS}, got {self.distribution!r}")
        seconds = " s (1 ms to a year)"
        found = [_range_problem("--session-mean", self.session_mean_s, MIN_LENGTH_S, MAX_TIME_S,
                                seconds),
                 _range_problem("--absence-mean", self.absence_mean_s, MIN_LENGTH_S, MAX_TIME_S,
                                seconds),
                 _range_problem("--diurnal-period", self.diurnal_period_s, MIN_LENGTH_S,
                                MAX_TIME_S, seconds),
                 _range_problem("--diurnal-peak", self.diurnal_peak_s, 0.0, MAX_TIME_S,
                                " s (0 to a year)"),
                 _range_problem("--shape", self.weibull_shape, MIN_SHAPE, MAX_SHAPE,
                                " (below, almost every session is shorter than a millisecond "
                                "and generation draws millions of samples per kept event; "
                                "above, every length is about the mean)")]
        out.extend(p for p in found if p)
        if not 0 <= self.diurnal_amplitude <= 1:
            out.append(f"--diurnal-amplitude: must be in [0, 1], got {self.diurnal_amplitude:g}")
        if not 0 <= self.crash_fraction <= 1:
            out.append(f"--crash-fraction: must be in [0, 1], got {self.crash_fraction:g}")
        return out

    @property
    def base_availability(self) -> float:
        """a0 = S / (S + A)."""
        return self.session_mean_s / (self.session_mean_s + self.absence_mean_s)

    def availability_at(self, time_s: float) -> float:
        """Target availability a(t)."""
        phase = 2 * math.pi * (time_s - self.diurnal_peak_s) / self.diurnal_period_s
        a = self.base_availability * (1 + self.diurnal_amplitude * math.cos(phase))
        return min(MAX_AVAILABILITY, max(MIN_AVAILABILITY, a))

    @property
    def shortest_cycle_s(self) -> float:
        """S + A_min: a session and the shortest mean absence of the daily cycle."""
        if self.diurnal_amplitude == 0:
            return self.session_mean_s + self.absence_mean_s
        a_max = min(MAX_AVAILABILITY, max(MIN_AVAILABILITY, self.base_availability
                                          * (1 + self.diurnal_amplitude)))
        return self.session_mean_s + self.session_mean_s * (1 - a_max) / a_max

    def absence_mean_at(self, time_s: float) -> float:
        """A(t) = S (1 - a(t)) / a(t); equals absence_mean_s when there is no daily cycle."""
        if self.diurnal_amplitude == 0:
            return self.absence_mean_s
        a = self.availability_at(time_s)
        return self.session_mean_s * (1 - a) / a


def sample_lengths_s(rng: np.random.Generator, distribution: str, mean_s: float,
                     shape: float = 1.0, size: int | None = None) -> np.ndarray:
    """Draw lengths in seconds with the given mean from the named distribution."""
    import numpy as np

    if distribution == "exponential":
        return np.asarray(rng.exponential(mean_s, size))
    if distribution == "weibull":
        scale_s = mean_s / math.gamma(1 + 1 / shape)
        return np.asarray(rng.weibull(shape, size) * scale_s)
    raise ValueError(f"unknown distribution {distribution!r}; expected one of {DISTRIBUTIONS}")


def _device_events(model: SessionModel, device: str, duration_s: float,
                   rng: np.random.Generator) -> list[TraceEvent]:
    present = initially_present = bool(rng.random() < model.availability_at(0.0))
    events: list[TraceEvent] = []
    t = 0.0
    while True:
        mean = model.session_mean_s if present else model.absence_mean_at(t)
        t += float(sample_lengths_s(rng, model.distribution, mean, model.weibull_shape))
        crash = bool(rng.random() < model.crash_fraction) if present else False
        if t >= duration_s:
            break
        time_s = round(t, 3)
        present = not present
        if events and time_s <= events[-1].time_s:
            events.pop()  # a blip shorter than the file's millisecond precision: drop both ends
            continue
        if not present:
            event = ChurnEvent.CRASH if crash else ChurnEvent.LEAVE
        else:
            event = ChurnEvent.JOIN
        events.append(TraceEvent(time_s, device, event))
    if not events and not initially_present:
        events.append(TraceEvent(0.0, device, ChurnEvent.LEAVE))  # absent for the whole trace
    return events


def generation_problems(device_count: int, model: SessionModel, duration_s: float) -> list[str]:
    """Every reason :func:`generate_events` would refuse these parameters (nothing is drawn)."""
    problems = model.problems()
    duration_problem = _range_problem("--duration", duration_s, MIN_LENGTH_S, MAX_TIME_S,
                                      " s (1 ms to a year)")
    if not problems and math.isfinite(duration_s) and duration_s > 0:
        # two events (a departure, a return) per session and absence, on average, counted with
        # the shortest absences of a daily cycle; checked before drawing any, since a typo
        # ('1000000h') would otherwise run for ever
        cycle_s = model.shortest_cycle_s
        expected = 2 * device_count * duration_s / cycle_s
        if expected > MAX_GENERATED_EVENTS:
            problems.append(
                f"--duration: {device_count} device(s) over {duration_s:,.10g} s with a session "
                f"and an absence every {cycle_s:,.6g} s on average (at the daily peak, if any) "
                f"make about {expected:,.0f} events; a generated trace holds at most "
                f"{MAX_GENERATED_EVENTS:,} (shorten --duration or lengthen the means)")
    if duration_problem:
        problems.insert(0, duration_problem)
    return problems


def generate_events(devices: Sequence[str], model: SessionModel, duration_s: float,
                    seed: int) -> list[TraceEvent]:
    """A trace's events for ``devices`` over [0, duration_s), ordered by time then device."""
    problems = generation_problems(len(devices), model, duration_s)
    if problems:
        raise ValueError("; ".join(problems))
    import numpy as np

    events: list[tuple[float, int, int, TraceEvent]] = []
    for index, device in enumerate(devices):
        rng = np.random.default_rng([seed, index])
        for order, e in enumerate(_device_events(model, device, duration_s, rng)):
            events.append((e.time_s, index, order, e))
    events.sort(key=lambda item: item[:3])
    return [item[3] for item in events]
