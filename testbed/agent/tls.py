"""Pinning the PS's self-signed certificate (standard library only: the agent runs on phones).

The agent fetches the certificate the PS presents, compares its SHA-256 fingerprint with the one
the user was given, and only then trusts exactly that certificate for the gRPC channel. A server
without the matching private key cannot complete the channel's handshake.
"""

from __future__ import annotations

import hashlib
import socket
import ssl

CERT_NAME = "testbed-ps"  # the name every run's certificate carries; the channel checks it


class PinError(Exception):
    """The PS presented another certificate than the one pinned, or none (or the pin given is
    not a fingerprint): retrying will not help."""


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


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
    except (OSError, ssl.SSLError) as exc:  # not up yet, or unreachable: the agent retries
        raise ConnectionError(f"no TLS handshake with {host}:{port}: {exc}") from exc
    if not der:
        raise PinError(f"{host}:{port} presented no certificate")
    got = fingerprint_of(der)
    if got != want:
        raise PinError(f"the PS at {host}:{port} presented certificate {got}, not the pinned "
                       f"{want}: another server, or another run (refusing to send the token)")
    return ssl.DER_cert_to_PEM_cert(der).encode()
