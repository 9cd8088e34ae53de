"""Real Android phones join the run over USB through an adb server (see docs/adb-bridge.md).

``AdbBridge(adb_host, adb_port, ps_address, token)`` follows the adb server, sets up each phone
(properties, profile, ``adb reverse`` to a per-phone relay towards the PS, the agent pushed and
started over adb) and reports what happens as :class:`BridgeEvent` values.
"""

from testbed.adb_bridge.bridge import AdbBridge, BridgeEvent, PhoneStatus, device_name
from testbed.adb_bridge.relay import RelayShaping

__all__ = ["AdbBridge", "BridgeEvent", "PhoneStatus", "RelayShaping", "device_name"]
