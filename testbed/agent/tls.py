"""Pinning the PS's self-signed certificate (standard library only: the agent runs on phones).

The agent fetches the certificate the PS presents, compares its SHA-256 fingerprint with the one
the user was given, and only then trusts exactly that certificate for the gRPC channel. A server
without the matching private key cannot complete the channel's handshake.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import re
import socket
import ssl

CERT_NAME = "testbed-ps"  # the name every run's certificate carries; the channel checks it


class PinError(Exception):
    """The PS presented another certificate than the one pinned, or none, or the server does
    not speak TLS at all (or the pin given is not a fingerprint): retrying will not help."""


# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens, 63 at most each
_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
MAX_HOSTNAME_CHARS = 253


def host_problem(host: str) -> str | None:
    """Why ``host`` is neither an IP address nor a host name (None when it is one)."""
    if not host:
        return "no host before the port"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host.split(".")
    if len(host) > MAX_HOSTNAME_CHARS or not all(_LABEL_RE.fullmatch(x) for x in labels):
        return f"{host!r} is neither an IP address nor a host name"
    if all(x.isdigit() for x in labels):  # 127.0.0.300: a mistyped address, not a name
        return f"{host!r} is not an IP address"
    return None


def parse_address(address: str, *, listen: bool = False) -> tuple[str, int]:
    """A ``HOST:PORT``, checked: (host, port) with ``[v6]:PORT`` unbracketed, or ValueError
    saying what was expected. The one parser of addresses (a PS to connect to, an adb server, a
    PS's ``network.ps.listen``), so all of them read ``[v6]`` and ports alike.

    To connect, HOST is an IP address or a host name and PORT 1..65535. To ``listen``, HOST is
    an IP address of this host (a socket binds to an address, not a name) and PORT 0..65535,
    0 meaning any free port."""
    low = 0 if listen else 1
    expected = (f"expected HOST:PORT (an IP address{'' if listen else ' or host name'}, ':', a "
                f"port {low}-65535{' (0: any)' if listen else ''}; IPv6 as [::1]:50051), got "
                f"{address[:80]!r}{'...' if len(address) > 80 else ''}")
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ValueError(f"{expected}: no port")
    # five digits at most before int(): 5,000 of them raised Python's own digit-limit error
    if not (port.isascii() and port.isdigit() and len(port) <= 5) or \
            not low <= int(port) <= 65535:
        raise ValueError(f"{expected}: the port must be a whole number {low}-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            if ipaddress.ip_address(host).version == 6:
                return host, int(port)
        except ValueError:
            pass
        raise ValueError(f"{expected}: {host!r} in brackets is not an IPv6 address")
    problem = host_problem(host)
    if problem is None and ":" in host:  # an IPv6 address: its last group read as the port
        problem = "write an IPv6 address in brackets"
    if problem is None and listen:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            problem = (f"{host!r} is a name; a PS listens on an IP address of this host (for "
                       f"example 0.0.0.0:50051 or 192.168.1.10:50051)")
    if problem:
        raise ValueError(f"{expected}: {problem}")
    return host, int(port)


def ps_address_arg(text: str) -> str:
    """An argparse type: a PS address ``HOST:PORT`` (``[v6]:PORT``) as written, checked
    (:func:`parse_address`), or the parser's error naming the option (exit 2):
    a malformed one would otherwise be retried for ever. So would 0.0.0.0 or ``[::]``, which
    a PS listening on every address of its host puts in the join command it prints: to
    connect, it is this machine itself."""
    try:
        host, port = parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        unspecified = False
    if unspecified:
        raise argparse.ArgumentTypeError(
            f"{text!r} is every address of the PS's host (where it listens), not one to "
            f"connect to: give an address of that host which this machine reaches, with the "
            f"same port (for example 192.168.1.10:{port})")
    return text


def fingerprint_of(der: bytes) -> str:
    """``sha256:`` and the lowercase hex SHA-256 of a DER certificate."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


def normalize(fingerprint: str) -> str:
    """Accept ``sha256:AB:CD...``, ``ab cd ...`` or bare hex; return the canonical form."""
    text = fingerprint.strip().lower()
    text = text.removeprefix("sha256:")
    hex_digits = "".join(ch for ch in text if ch not in ": ")
    if len(hex_digits) != 64 or any(ch not in "0123456789abcdef" for ch in hex_digits):
        raise PinError(f"not a SHA-256 fingerprint: {fingerprint!r} (expected 64 hex digits, "
                       "as printed by `testbed up` with the join command)")
    return "sha256:" + hex_digits


def pinned_certificate(host: str, port: int, fingerprint: str, timeout_s: float = 10.0
                       ) -> bytes:
    """The PEM certificate the PS at host:port presents, if its fingerprint is the pinned one."""
    want = normalize(fingerprint)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # we verify by the pin, below
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=CERT_NAME) as tls:
                der = tls.getpeercert(binary_form=True)
    except ssl.SSLError as exc:
        if exc.reason == "WRONG_VERSION_NUMBER":  # it answered, in something else than TLS
            raise PinError(f"{host}:{port} answered, but not in TLS: not the port a PS opens "
                           f"for network.ps.listen (the one in the join command `testbed up` "
                           f"printed)") from exc
        raise ConnectionError(f"no TLS handshake with {host}:{port}: {exc}") from exc
    except OSError as exc:  # not up yet, or unreachable: the agent retries
        raise ConnectionError(f"no TLS handshake with {host}:{port}: {exc}") from exc
    if not der:
        raise PinError(f"{host}:{port} presented no certificate")
    got = fingerprint_of(der)
    if got != want:
        raise PinError(f"the PS at {host}:{port} presented certificate {got}, not the pinned "
                       f"{want}: another server, or another run (refusing to send the token)")
    return ssl.DER_cert_to_PEM_cert(der).encode()
