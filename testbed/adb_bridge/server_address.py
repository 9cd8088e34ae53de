"""Which adb server, as ``adb`` itself decides, and what to say when none answers: shared by
the ``testbed adb`` commands and the doctor. No adbutils here (it reads
``ANDROID_ADB_SERVER_PORT`` when imported and raises a bare ValueError on a bad value), so the
address is checked before adbutils is imported."""

from __future__ import annotations

import os

from testbed.agent.tls import parse_address

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 5037
# what to do when no adb server answers, in every command (the doctor's fix says it too)
START_SERVER_FIX = ("start one with `adb start-server`, or point --adb HOST:PORT (or "
                    "ANDROID_ADB_SERVER_ADDRESS and ANDROID_ADB_SERVER_PORT) at yours")


def unreachable(address: str, exc: BaseException) -> str:
    """The one line said when the adb server at ``address`` did not answer ``exc``."""
    return f"error: cannot reach the adb server at {address} ({exc}); {START_SERVER_FIX}"


def adb_address(flag: str | None, environ: dict[str, str] | None = None
                ) -> tuple[str, str | None]:
    """The adb server ``HOST:PORT`` to use, and the problem with it (None when fine).

    ``--adb`` wins; else ``ANDROID_ADB_SERVER_ADDRESS`` and ``ANDROID_ADB_SERVER_PORT``, the
    variables the ``adb`` client reads, each with adb's default. HOST:PORT is checked as a PS
    address is (:func:`testbed.agent.tls.parse_address`: ``[v6]:PORT`` for IPv6). A bad
    ``ANDROID_ADB_SERVER_PORT`` is a problem even with ``--adb``: adbutils reads it when it is
    imported, and raises a bare ValueError."""
    env = os.environ if environ is None else environ
    port_set = "ANDROID_ADB_SERVER_PORT" in env  # set but empty: adbutils's int('') raises
    port_text = env.get("ANDROID_ADB_SERVER_PORT", "").strip()
    if port_set and (not (port_text.isascii() and port_text.isdigit())
                     or not 0 < int(port_text) < 65536):
        return flag or port_text, (f"ANDROID_ADB_SERVER_PORT: expected a TCP port (1-65535), "
                                   f"got {port_text!r}")
    if flag is not None:
        try:
            parse_address(flag)
        except ValueError as exc:
            return flag, f"--adb: {exc}"
        return flag, None
    host = env.get("ANDROID_ADB_SERVER_ADDRESS", "").strip() or DEFAULT_HOST
    address = f"[{host}]" if ":" in host and not host.startswith("[") else host
    address += f":{port_text or DEFAULT_PORT}"
    try:
        parse_address(address)
    except ValueError as exc:
        return address, f"ANDROID_ADB_SERVER_ADDRESS: {exc}"
    return address, None
