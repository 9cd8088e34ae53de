"""Units written out in topology files, and their conversion to SI numbers.

Every quantity in a topology file carries its unit, and every quantity in code carries its unit in
its name (``rate_bps``, ``delay_s``, ``loss_fraction``, ``size_bytes``). This module is the one
place that turns one into the other, and holds the argparse types of numbers on the command line
(``duration_arg``, ``int_arg``, ``number_arg``, ``size_arg``, ``SEED``), each with its range.

=============  =======================================  ==========================================
kind           accepted spellings                       result
=============  =======================================  ==========================================
rate           ``bit kbit Kbit Mbit Gbit`` (per second), bits per second (float)
               ``bps Kbps Mbps Gbps``, ``B/s KB/s MB/s
               GB/s KiB/s MiB/s GiB/s`` (bytes per s)
duration       ``us ms s min h``                        seconds (float)
fraction       ``0.5%``                                 fraction in [0, 1] (float)
size           ``B KB MB GB TB PB KiB MiB GiB TiB PiB``  bytes (int)
=============  =======================================  ==========================================

Decimal prefixes are powers of 1000 (``1Mbit`` = 1,000,000 bit/s; ``1MB`` = 1,000,000 bytes), binary
ones powers of 1024 (``1MiB`` = 1,048,576 bytes), as in tc(8) and iperf3. A bare number is refused:
a forgotten unit is the commonest topology mistake, and guessing it hides the mistake.

Limits: a rate is at least :data:`MIN_RATE_BPS` (1 kbit/s, below the slowest cellular data
link; slower, one tile's blocks take hours and the planner's arithmetic underflows) and at most
:data:`MAX_RATE_BPS` (1 Tbit/s, ten times the fastest Ethernet port sold today; nothing this
testbed emulates comes near), a duration and a size must be finite
(``1e999s`` is infinity to a float) and a size at most :data:`MAX_SIZE_BYTES` (1 PiB). Callers
bound their own quantities further (a link's delay, for example, in :mod:`testbed.topology`).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable

_NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"
_PATTERN = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z/%]+)\s*$")

_RATE_BPS = {
    "bit": 1.0, "kbit": 1e3, "Kbit": 1e3, "Mbit": 1e6, "Gbit": 1e9,
    "bps": 1.0, "kbps": 1e3, "Kbps": 1e3, "Mbps": 1e6, "Gbps": 1e9,
    "B/s": 8.0, "KB/s": 8e3, "kB/s": 8e3, "MB/s": 8e6, "GB/s": 8e9,
    "KiB/s": 8.0 * 1024, "MiB/s": 8.0 * 1024**2, "GiB/s": 8.0 * 1024**3,
}
_DURATION_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_SIZE_BYTES = {
    "B": 1, "KB": 1000, "kB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "PB": 1000**5,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4, "PiB": 1024**5,
}


MIN_RATE_BPS = 1e3
MAX_RATE_BPS = 1e12
MAX_SIZE_BYTES = 1024**5


class UnitError(ValueError):
    """A quantity that is not a number followed by one of the expected units."""


def _split(text: object, kind: str, example: str, units: dict[str, float] | dict[str, int]
           ) -> tuple[float, str]:
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UnitError(f"expected a {kind} such as {example!r}, got {type(text).__name__}")
    match = _PATTERN.match(str(text))
    if not match:
        if isinstance(text, (int, float)) or re.fullmatch(rf"\s*{_NUMBER}\s*", str(text)):
            raise UnitError(f"expected a {kind} with its unit such as {example!r}, got {text!r} "
                            f"(no unit)")
        raise UnitError(f"expected a {kind} such as {example!r}, got {text!r}")
    value, unit = float(match.group(1)), match.group(2)
    if unit not in units:
        raise UnitError(f"unknown {kind} unit {unit!r} in {text!r}; "
                        f"expected one of {', '.join(units)}")
    return value, unit


def parse_rate_bps(text: object) -> float:
    """Parse a link rate like ``'20Mbit'`` or ``'10MB/s'`` into bits per second."""
    value, unit = _split(text, "rate", "20Mbit", _RATE_BPS)
    if value <= 0:
        raise UnitError(f"a rate must be positive, got {text!r}")
    rate_bps = value * _RATE_BPS[unit]
    if rate_bps < MIN_RATE_BPS:
        raise UnitError(f"a rate must be at least 1kbit, got {text!r}")
    if not rate_bps <= MAX_RATE_BPS:
        raise UnitError(f"a rate must be at most 1000Gbit, got {text!r}")
    return rate_bps


def parse_duration_s(text: object) -> float:
    """Parse a duration like ``'10ms'`` into seconds (>= 0)."""
    value, unit = _split(text, "duration", "10ms", _DURATION_S)
    if not math.isfinite(value * _DURATION_S[unit]):
        raise UnitError(f"a duration must be finite, got {text!r}")
    return value * _DURATION_S[unit]


def duration_arg(text: str) -> float:
    """An argparse type: a duration with its unit (``'10min'``) in seconds, or the parser's
    error naming the option (exit 2)."""
    try:
        return parse_duration_s(text)
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def positive_duration_arg(text: str) -> float:
    """:func:`duration_arg` above 0 (a timeout)."""
    seconds = duration_arg(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be above 0, got {text!r}")
    return seconds


def int_arg(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], or the parser's error naming the option
    (exit 2) before the command starts (a --passes of 0 failed at the end of a sweep)."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low:,} to {high:,}, got {value:,}")
        return value
    return whole_number


def number_arg(low: float, high: float, above_low: bool = False,
               below_high: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (above ``low`` if ``above_low``, below
    ``high`` if ``below_high``)."""
    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if above_low else low <= value) or \
                not (value < high if below_high else value <= high):
            raise argparse.ArgumentTypeError(
                f"expected a number {'above' if above_low else 'from'} {low:g} "
                f"{'up ' if above_low else ''}to {high:g}{' (not included)' if below_high else ''}"
                f", got {text!r}")
        return value
    return number


SEED = int_arg(0, 2**63 - 1)  # what numpy's generators take


def list_arg(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type: comma-separated items, each read by the argparse type ``item``, or
    the parser's error naming the option and the item (a bench's `--rates abc` ended in a
    traceback)."""
    def items(text: str) -> list[Any]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        out = []
        for part in parts:
            try:
                out.append(item(part))
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise argparse.ArgumentTypeError(f"{part!r}: {exc}") from None
        return out
    return items


def choice_arg(*choices: str) -> Callable[[str], str]:
    """An argparse type: one of ``choices`` (for items of :func:`list_arg`)."""
    def choice(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}")
        return text
    return choice


def parse_fraction(text: object) -> float:
    """Parse a percentage like ``'0.5%'`` into a fraction in [0, 1]."""
    value, _ = _split(text, "percentage", "0.5%", {"%": 1.0})
    if value > 100:
        raise UnitError(f"a percentage must be at most 100%, got {text!r}")
    return value / 100.0


def parse_size_bytes(text: object) -> int:
    """Parse a size like ``'2GiB'`` into bytes."""
    value, unit = _split(text, "size", "2GiB", _SIZE_BYTES)
    if not value * _SIZE_BYTES[unit] <= MAX_SIZE_BYTES:
        raise UnitError(f"a size must be at most 1PiB, got {text!r}")
    return int(round(value * _SIZE_BYTES[unit]))


def size_arg(low_bytes: int, high_bytes: int = MAX_SIZE_BYTES) -> Callable[[str], int]:
    """An argparse type: a size with its unit (``'64GiB'``) in bytes, in [low, high], or the
    parser's error naming the option (exit 2)."""
    def size(text: str) -> int:
        try:
            size_bytes = parse_size_bytes(text)
        except UnitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not low_bytes <= size_bytes <= high_bytes:
            raise argparse.ArgumentTypeError(
                f"expected a size from {_size_text(low_bytes)} to {_size_text(high_bytes)}, "
                f"got {text!r}")
        return size_bytes
    return size


def _size_text(size_bytes: int) -> str:
    """A size in the largest binary unit that divides it (``'1GiB'``), else in bytes."""
    for unit, scale in (("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2),
                        ("KiB", 1024)):
        if size_bytes % scale == 0 and size_bytes:
            return f"{size_bytes // scale}{unit}"
    return f"{size_bytes}B"


def format_rate(rate_bps: float) -> str:
    """Format bits per second the way a topology file would write it (``'20Mbit'``)."""
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("Kbit", 1e3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:g}{unit}"
    return f"{rate_bps:g}bit"


def format_bytes(size_bytes: float) -> str:
    """Format a byte count for people (``'12.3 MB'``), decimal prefixes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(size_bytes) >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes:.0f} B"
