"""What a phone is (from ``getprop``) and which device profile describes it.

A phone's SoC is read from ``ro.soc.model`` (Android 12+), else ``ro.board.platform``, else
``ro.hardware``, lower-cased. :data:`SOC_PROFILES` maps those names to shipped profiles of
``testbed/perf_model/profiles``; a phone whose SoC is not in the table is *measured live*: it
runs with no profile and its own timings feed the performance model.

The API level comes from ``ro.build.version.sdk`` (read with :func:`parsers.parse_int`); a phone
that gives none that is a number cannot be checked against :data:`MIN_SDK`, and
:func:`support_problem` says so rather than let it pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.adb_bridge import parsers
from testbed.perf_model.profiles import list_profiles

# SoC identifiers as phones print them -> shipped profile name. Snapdragon 888 is SM8350, code
# name "lahaina" (Qualcomm product pages; AOSP device trees use the code name as board platform).
SOC_PROFILES = {"sm8350": "snapdragon888", "lahaina": "snapdragon888"}
MIN_SDK = 24  # Termux (python, python-numpy, python-grpcio) needs Android 7.0, API level 24


@dataclass(frozen=True)
class PhoneInfo:
    """A phone's identity as its properties tell it."""

    serial: str
    model: str
    manufacturer: str
    soc: str  # lower-case SoC identifier, "" when the phone does not say
    android_release: str
    sdk: int | None  # the API level, None when ro.build.version.sdk is missing or no number
    abi: str

    @classmethod
    def from_props(cls, serial: str, props: dict[str, str]) -> PhoneInfo:
        """Build from ``getprop`` output parsed by :func:`parsers.parse_getprop`."""
        soc = next((props[k] for k in ("ro.soc.model", "ro.board.platform", "ro.hardware")
                    if props.get(k)), "")
        return cls(serial=serial, model=props.get("ro.product.model", ""),
                   manufacturer=props.get("ro.product.manufacturer", ""),
                   soc=soc.strip().lower(),
                   android_release=props.get("ro.build.version.release", ""),
                   sdk=parsers.parse_int(props.get("ro.build.version.sdk")),
                   abi=props.get("ro.product.cpu.abi", ""))

    def soc_candidates(self, props: dict[str, str]) -> list[str]:
        """Every SoC-like identifier the phone prints, most specific first."""
        keys = ("ro.soc.model", "ro.board.platform", "ro.hardware", "ro.product.board")
        return [props[k].strip().lower() for k in keys if props.get(k)]


@dataclass(frozen=True)
class ProfileChoice:
    """The profile chosen for a phone (None = measured live) and why."""

    profile: str | None
    reason: str


def choose_profile(info: PhoneInfo, props: dict[str, str], requested: str = "auto"
                   ) -> ProfileChoice:
    """Pick a device profile: ``requested`` may be ``auto``, ``measured`` or a profile name."""
    if requested == "measured":
        return ProfileChoice(None, "measured live (the topology asks for it)")
    if requested != "auto":
        return ProfileChoice(requested, "named in the topology")
    shipped = set(list_profiles())
    for soc in info.soc_candidates(props):
        name = SOC_PROFILES.get(soc)
        if name and name in shipped:
            return ProfileChoice(name, f"SoC {soc!r} matches profile {name!r}")
    return ProfileChoice(None, f"measured live: no profile for SoC {info.soc or 'unknown'!r}")


def support_problem(info: PhoneInfo) -> str | None:
    """Why the agent cannot run on this phone (too old for Termux, or its Android version
    unknown), or None when it may."""
    if info.sdk is None:
        return ("the phone reported no usable Android version (`getprop ro.build.version.sdk` "
                "gives no API level), so the bridge cannot tell whether Termux, which provides "
                f"python, numpy and grpcio, runs on it (it needs API {MIN_SDK}, Android 7.0)")
    if info.sdk < MIN_SDK:
        return (f"Android {info.android_release or '?'} (API {info.sdk}) is too old: Termux, "
                f"which provides python, numpy and grpcio, needs API {MIN_SDK} (Android 7.0)")
    return None
