"""The PS's TLS identity for devices beyond loopback: a self-signed certificate made per run.

A device pins the certificate by its SHA-256 fingerprint (printed with the join command), so no
certificate authority is involved and a certificate from another run is refused. The private
key stays in the run directory, readable only by its owner.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.agent.tls import CERT_NAME, fingerprint_of, parse_address

VALID_DAYS = 30  # a run, with room for --resume


@dataclass(frozen=True)
class TlsIdentity:
    cert_pem: bytes
    key_pem: bytes
    fingerprint: str  # "sha256:" + hex of the DER certificate


def make_identity(run_dir: Path, listen: str) -> TlsIdentity:
    """A new ECDSA P-256 key and self-signed certificate for the host of `listen` (HOST:PORT),
    saved in run_dir."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    host = parse_address(listen, listen=True)[0]
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CERT_NAME)])
    names: list[x509.GeneralName] = [x509.DNSName(CERT_NAME)]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        if host:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    key_path = run_dir / "ps-tls.key"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    (run_dir / "ps-tls.crt").write_bytes(cert_pem)
    return TlsIdentity(cert_pem, key_pem,
                       fingerprint_of(cert.public_bytes(serialization.Encoding.DER)))


def saved_identity(run_dir: Path) -> TlsIdentity | None:
    """The identity an earlier start of this run saved (``--resume``), so that the devices that
    joined it, which pin its certificate, join the resumed run too; None when it is missing,
    damaged, does not match its key or expires within a day (a new one is made then)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert_pem = (run_dir / "ps-tls.crt").read_bytes()
        key_pem = (run_dir / "ps-tls.key").read_bytes()
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (OSError, ValueError, TypeError):
        return None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, public) != \
            cert.public_key().public_bytes(serialization.Encoding.PEM, public):
        return None
    if cert.not_valid_after_utc < datetime.datetime.now(datetime.timezone.utc) + \
            datetime.timedelta(days=1):
        return None
    return TlsIdentity(cert_pem, key_pem,
                       fingerprint_of(cert.public_bytes(serialization.Encoding.DER)))


def join_hosts(listen_host: str,
               interfaces: Mapping[str, Sequence[Any]] | None = None) -> list[str]:
    """The hosts a device dials for a PS listening on ``listen_host``: that host, or, when it
    is every address of this machine (0.0.0.0, ::), which a device cannot dial (to it, that is
    itself), this machine's addresses of that family that another machine may reach: not
    loopback, not link-local, private ones first; loopback when there is none (a device on this
    machine only). ``interfaces``: ``psutil.net_if_addrs()`` (the default)."""
    wanted = ipaddress.ip_address(listen_host)
    if not wanted.is_unspecified:
        return [listen_host]
    if interfaces is None:
        import psutil

        interfaces = psutil.net_if_addrs()
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for addresses in interfaces.values():
        for entry in addresses:
            try:
                ip = ipaddress.ip_address(str(entry.address).split("%")[0])
            except ValueError:  # a MAC address (AF_PACKET)
                continue
            if ip.version == wanted.version and not (ip.is_loopback or ip.is_link_local
                                                     or ip.is_unspecified) and ip not in found:
                found.append(ip)
    found.sort(key=lambda ip: not ip.is_private)  # stable: the interfaces' order otherwise
    loopback = "127.0.0.1" if wanted.version == 4 else "::1"
    return [str(ip) for ip in found] or [loopback]


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets (as `testbed join` reads it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_problem(listen: str) -> str | None:
    """Why the PS could not listen on ``listen`` (HOST:PORT) on this machine, found before the
    run starts (the PS's own bind failed only once everything was up, as a gRPC traceback)."""
    host, port = parse_address(listen, listen=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as a listener does: a port whose last connections wait out TIME_WAIT is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = ("another process listens on that port" if exc.errno == errno.EADDRINUSE
                   else "it is not an address of this machine"
                   if exc.errno == errno.EADDRNOTAVAIL else exc.strerror)
            return f"cannot listen on {listen}: {why} ({exc.strerror})"
    return None


def resumed_listen(listen: str, earlier: object) -> str:
    """Where a resumed run's PS listens for devices beyond loopback: ``listen`` (the topology's
    ``network.ps.listen``), unless it asks for any free port (0) and the run's last start bound
    ``earlier`` (``ps.json``'s ``lan_address`` as read: anything but a ``HOST:PORT`` string
    means none), whose port is free now. Then that port: the devices that joined the run retry
    the address they had and find it again."""
    host, port = parse_address(listen, listen=True)
    if port != 0 or not isinstance(earlier, str):
        return listen
    try:
        _, old = parse_address(earlier)
    except ValueError:  # a damaged ps.json: any free port, as the topology says
        return listen
    again = host_port(host, old)
    return listen if listen_problem(again) else again
