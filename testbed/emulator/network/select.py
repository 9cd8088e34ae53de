"""Pick the network backend for a topology: ``network.backend`` is auto, loopback or mininet.

``auto`` takes Mininet when the probe (:mod:`.probe`) says it can run here (root, mnexec, brctl,
netns, HTB, the mininet Python package) and otherwise falls back to loopback with a logged notice
naming what is missing. An explicit ``mininet`` without those raises :class:`NetworkUnavailable`
with the same list: asking for real namespaces and silently getting loopback would be wrong.
"""

from __future__ import annotations

import logging

from testbed.emulator.network.base import Network
from testbed.emulator.network.loopback import LoopbackNetwork
from testbed.emulator.network.probe import Capabilities, probe
from testbed.topology import Topology

log = logging.getLogger(__name__)


class NetworkUnavailable(RuntimeError):
    """The topology asks for a backend this machine cannot provide."""


def resolve_backend(topology: Topology, capabilities: Capabilities | None = None) -> str:
    """'loopback' or 'mininet' for this topology on this machine; raise NetworkUnavailable."""
    wanted = topology.network.backend
    if wanted == "loopback":
        return "loopback"
    caps = capabilities or probe()
    missing = caps.missing()
    if not missing:
        return "mininet"
    if wanted == "mininet":
        raise NetworkUnavailable(
            f"network.backend is 'mininet' but this machine lacks: {'; '.join(missing)}. "
            f"Run as root with the Debian packages mininet and bridge-utils, or set "
            f"network.backend to 'auto' or 'loopback'.")
    log.warning("network: Mininet is not usable here (missing: %s); using the loopback backend, "
                "where every link is emulated in the application", "; ".join(missing))
    return "loopback"


def make_network(topology: Topology, dilation: float = 1.0,
                 capabilities: Capabilities | None = None, backend: str | None = None) -> Network:
    """The backend object for a topology (not started). ``backend``: what
    :func:`resolve_backend` already chose for it (else chosen here: a second call would say
    again why ``auto`` fell back to loopback)."""
    kind = backend or resolve_backend(topology, capabilities)
    if kind == "loopback":
        return LoopbackNetwork(topology)
    from testbed.emulator.network.mininet import MininetNetwork

    net = MininetNetwork(topology, dilation=dilation, capabilities=capabilities)
    log.info("network: Mininet backend (rate: HTB; delay and loss: %s)",
             net.caps.delay_mechanism)
    return net
