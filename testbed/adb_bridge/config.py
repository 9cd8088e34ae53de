"""The topology's ``adb:`` section: schema, validation, and the frozen spec the bridge reads.

Schema (units written out, see :mod:`testbed.units`)::

    adb:
      enabled: true              # default false: no bridge unless asked
      server: 127.0.0.1:5037     # the adb server to follow (host:port)
      serials: all               # 'all', or a list of serials to take (others are ignored)
      profile: auto              # auto (by SoC) | measured (live) | a profile name
      phone_port: 7700           # port the agent dials on the phone (adb reverse source)
      telemetry_interval: 2s     # how often battery/thermal/cpufreq are polled
      link: {down: 100Mbit, up: 20Mbit, delay: 10ms}   # shaping in the phone's relay (optional)

On the Mininet backend each phone is placed in the topology like a device, by serial::

    adb:
      enabled: true
      serials:
        R58M12ABCDE: {switch: ap0, link: {down: 100Mbit, up: 20Mbit, delay: 10ms}}

``switch`` is a declared switch (required when switches are declared, as for a device group),
``link`` the phone's link to it (the topology's link keys; default 1Gbit both ways). Such a phone
gets a Mininet host of its own; see :mod:`testbed.adb_bridge.forwarder`. ``serials: all`` or a
list places no phone, which only the loopback backend can run.

``link.down`` is PS -> phone, ``link.up`` phone -> PS. ``loss`` is refused: the relay carries a
TCP byte stream, where a lost packet is only ever a retransmission delay. The section is a
:class:`AdbSection` (testbed/schema.py); inside a topology it is validated with the rest of the
file, and ``Topology.extra["adb"]`` holds its :class:`AdbSpec`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)

from testbed import units
from testbed.adb_bridge.relay import RelayShaping
from testbed.names import MAX_NAME_CHARS
from testbed.schema import Bool, Int, Schema, Str, problem_pairs, unique
from testbed.topology import LinkFile, LinkSpec, SwitchRef

Problems = list[tuple[str, str]]
MIN_TELEMETRY_INTERVAL_S = 0.1


DEFAULT_PHONE_LINK = LinkSpec(1e9, 1e9)


PLAIN_SERIAL = re.compile(r"[A-Z0-9-]{1,%d}" % (MAX_NAME_CHARS - len("adb-")))
SERIAL_HASH_CHARS = 6  # hex digits of the serial's SHA-256 in a hashed name
HASH_TAIL = re.compile(r"-[0-9a-f]{%d}$" % SERIAL_HASH_CHARS)


def device_name(serial: str) -> str:
    """The run's device name for a phone serial (at most ``MAX_NAME_CHARS`` characters).

    A serial of upper-case letters, digits and '-', at most 20 (what USB phones report:
    ``R58M12ABCDE``) is named ``adb-<serial>`` lower-cased (``adb-r58m12abcde``): the serial
    reads back from the name. Any other serial would lose something (case, '.', ':', '_',
    length), and two phones could meet in one name (``PHONE.1``, ``phone_1``), so it is named
    ``adb-<stem>-<hash>``: the stem is the serial lower-cased with each run of other characters
    folded to '-', cut to fit, the hash the first 6 hex digits of the serial's SHA-256
    (``adb-phone-1-dd7b4e``). A plain name never ends like a hash ('-' and 6 hex digits: such a
    serial is hashed too), so two phones share a name only if their stems and hashes do. The
    same serial always gets the same name."""
    plain = "adb-" + serial.lower()
    if PLAIN_SERIAL.fullmatch(serial) and not HASH_TAIL.search(plain):
        return plain
    digest = hashlib.sha256(serial.encode("utf-8", "surrogatepass")).hexdigest()
    room = MAX_NAME_CHARS - len("adb--") - SERIAL_HASH_CHARS
    stem = re.sub(r"[^a-z0-9]+", "-", serial.lower()).strip("-")[:room].rstrip("-")
    return "-".join(["adb", *([stem] if stem else []), digest[:SERIAL_HASH_CHARS]])


@dataclass(frozen=True)
class PhonePlacement:
    """Where a phone sits in the topology (the Mininet backend gives it a host there)."""

    serial: str
    switch: str | None  # None = the topology has no switches (the implicit one)
    link: LinkSpec = DEFAULT_PHONE_LINK

    @property
    def name(self) -> str:
        """The phone's device name, which is also its node name in the network."""
        return device_name(self.serial)


@dataclass(frozen=True)
class AdbSpec:
    """The validated ``adb:`` section."""

    enabled: bool = False
    server_host: str = "127.0.0.1"
    server_port: int = 5037
    serials: tuple[str, ...] | None = None  # None = every phone
    profile: str = "auto"
    phone_port: int = 7700
    telemetry_interval_s: float = 2.0
    shaping: RelayShaping = RelayShaping()
    placements: tuple[PhonePlacement, ...] = ()  # phones placed in the topology, by serial
    link_given: bool = False  # adb.link was written (the relay shapes; refused on Mininet)


def _serial(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"expected a serial (no spaces), got {value!r}")
    return value


def _all_is_none(value: Any) -> Any:
    if value == "all":
        return None
    if isinstance(value, dict) and value:
        # a phone written with nothing under it sits on the only switch with the default link
        return {k: ({} if v is None else v) for k, v in value.items()}
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected 'all', a non-empty list of serials or a mapping "
                         f"SERIAL: {{switch: ..., link: {{...}}}}, got {value!r}")
    return value


def _interval(value: float) -> float:
    if value < MIN_TELEMETRY_INTERVAL_S:
        raise ValueError(f"must be at least 100ms, got {value:g} s")
    return value


class AdbLink(Schema):
    """Shaping in the phone's relay."""

    unknown_key_hints: ClassVar[dict[str, str]] = {
        "loss": "loss cannot be applied on the ADB relay (it carries a TCP stream); leave it out"}

    down: Annotated[float, BeforeValidator(units.parse_rate_bps)] | None = None
    up: Annotated[float, BeforeValidator(units.parse_rate_bps)] | None = None
    delay: Annotated[float, BeforeValidator(units.parse_duration_s),
                     Field(le=60.0)] = 0.0

    def spec(self) -> RelayShaping:
        return RelayShaping(down_bps=self.down, up_bps=self.up, delay_s=self.delay)


class PhonePlaceFile(Schema):
    """One phone placed in the topology: its switch and its link."""

    switch: SwitchRef = Field(default=None, validate_default=True)
    link: LinkFile | None = None

    def spec(self, serial: str) -> PhonePlacement:
        return PhonePlacement(serial, self.switch,
                              self.link.spec() if self.link else DEFAULT_PHONE_LINK)


SerialKey = Annotated[Str, AfterValidator(_serial)]


class AdbSection(Schema):
    """The ``adb:`` section as written."""

    enabled: Bool = False
    server: Str = "127.0.0.1:5037"
    # tagged by the value's type, so an error names only the form the user wrote
    serials: Annotated[Annotated[
        Annotated[list[Annotated[Str, AfterValidator(_serial), unique("serials", "serial")]],
                  Tag("list")] | Annotated[dict[SerialKey, PhonePlaceFile], Tag("dict")],
        Discriminator(lambda v: "dict" if isinstance(v, dict) else "list")] | None,
        BeforeValidator(_all_is_none)] = None
    profile: Str = "auto"
    phone_port: Int = 7700
    telemetry_interval: Annotated[float, BeforeValidator(units.parse_duration_s),
                                  AfterValidator(_interval)] = 2.0
    link: AdbLink | None = None

    @field_validator("server", mode="before")
    @classmethod
    def _server(cls, value: Any) -> Any:
        host, _, port = str(value).rpartition(":")
        if not isinstance(value, str) or not host or not port.isdigit() or \
                not 1 <= int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT such as '127.0.0.1:5037', got {value!r}")
        return value

    @field_validator("profile")
    @classmethod
    def _profile(cls, value: str) -> str:
        if not value:
            raise ValueError(f"expected auto, measured or a profile name, got {value!r}")
        if value not in ("auto", "measured"):
            from testbed.perf_model.profiles import find_profile, list_profiles

            if find_profile(value) is None:
                raise ValueError(f"no device profile named {value!r}; expected auto, measured "
                                 f"or one of {', '.join(list_profiles())}")
        return value

    @field_validator("phone_port", mode="before")
    @classmethod
    def _port(cls, value: Any) -> Any:
        # the phone's control socket is phone_port + 2 (termux_control), as testbed adb's
        # --phone-port takes it
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65533:
            raise ValueError(f"expected a TCP port 1..65533 (the control port is 2 above it), "
                             f"got {value!r}")
        return value

    def spec(self) -> AdbSpec:
        host, _, port = self.server.rpartition(":")
        places = tuple(p.spec(serial) for serial, p in self.serials.items()) \
            if isinstance(self.serials, dict) else ()
        return AdbSpec(self.enabled, host, int(port),
                       tuple(self.serials) if self.serials is not None else None, self.profile,
                       self.phone_port, self.telemetry_interval,
                       self.link.spec() if self.link else RelayShaping(), places,
                       self.link is not None)


def validate_adb_section(raw: Any, path: str = "adb") -> tuple[AdbSpec, Problems]:
    """Check an ``adb:`` section; return the spec and every problem as (yaml_path, message)."""
    if raw is None:
        return AdbSpec(), []
    try:
        return AdbSection.model_validate(raw, context={}).spec(), []
    except ValidationError as exc:
        return AdbSpec(), problem_pairs(exc, path, AdbSection)
