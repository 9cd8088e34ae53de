"""Real Android phones join the run over USB through an adb server (see docs/adb-bridge.md).

``AdbBridge(adb_host, adb_port, ps_address, token)`` follows the adb server, sets up each phone
(properties, profile, ``adb reverse`` to a per-phone relay towards the PS, the agent pushed and
started over adb or through Termux) and reports what happens as :class:`BridgeEvent` values.

The names are loaded on first use: adbutils reads ``ANDROID_ADB_SERVER_PORT`` when it is
imported and fails on a bad value, and ``testbed adb`` must be able to say so itself (exit 2).
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdbBridge", "BridgeEvent", "PhoneStatus", "RelayShaping", "device_name"]


def __getattr__(name: str) -> Any:
    if name == "RelayShaping":
        from testbed.adb_bridge.relay import RelayShaping
        return RelayShaping
    if name in __all__:
        from testbed.adb_bridge import bridge
        return getattr(bridge, name)
    raise AttributeError(f"module 'testbed.adb_bridge' has no attribute {name!r}")
