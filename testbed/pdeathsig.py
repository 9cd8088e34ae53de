"""A child process that ends with its parent, however the parent ends (SIGKILL included).

``PR_SET_PDEATHSIG`` (prctl(2)): the kernel sends the child SIGKILL when the *thread* that forked
it exits, which is why ``testbed up`` forks from one long-lived thread (``testbed.up.Spawner``).
The signal is not sent for a parent that died before the call: a caller that must not outlive
its parent checks ``os.getppid()`` afterwards.
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """Ask for SIGKILL when the parent (thread) exits; nothing where prctl is missing (not
    Linux). Safe between fork and exec (``preexec_fn``)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
