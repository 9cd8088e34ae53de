"""Starting and stopping the agent inside Termux with Termux's ``RUN_COMMAND`` intent.

Facts this module relies on (termux-app's ``RunCommandService`` and its wiki page
"RUN_COMMAND Intent"; see docs/adb-bridge.md for the permission model):

* the service is ``com.termux/.app.RunCommandService``, action ``com.termux.RUN_COMMAND``;
  extras ``com.termux.RUN_COMMAND_PATH`` (string: the executable), ``..._ARGUMENTS`` (string
  array; ``am --esa`` splits it on commas, a literal comma is written ``\\,``), ``..._WORKDIR``
  (string) and ``..._BACKGROUND`` (boolean: no terminal session);
* the service is exported behind the permission ``com.termux.permission.RUN_COMMAND``; a caller
  that lacks it gets ``Error: Requires permission com.termux.permission.RUN_COMMAND`` from ``am``
  (AOSP's ``am`` prints that when the activity manager answers a permission denial);
* Termux itself refuses (silently for ``am``, it only logs) unless ``allow-external-apps = true``
  is in ``~/.termux/termux.properties``: ``am`` says ``Starting service`` either way, so the
  bridge confirms a start by finding the agent in the process list;
* the command runs as the Termux app's user: the adb shell cannot signal it (``kill`` gives
  EPERM) nor read its files, but can see it in ``/proc`` (the shell user may read every
  process). So liveness is ``test -d /proc/PID`` and stopping is a second intent.

Names written down once: the script is ``<PHONE_DIR>/termux-agent.sh`` (pushed by the bridge,
readable by apps: AOSP's app policy lets apps read ``/data/local/tmp`` files, not write them);
Termux's own state (pid file, log) is ``~/.testbed/`` inside Termux.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "com.termux"
SERVICE = "com.termux/.app.RunCommandService"
ACTION = "com.termux.RUN_COMMAND"
PERMISSION = "com.termux.permission.RUN_COMMAND"
EXTRA_PATH = "com.termux.RUN_COMMAND_PATH"
EXTRA_ARGUMENTS = "com.termux.RUN_COMMAND_ARGUMENTS"
EXTRA_WORKDIR = "com.termux.RUN_COMMAND_WORKDIR"
EXTRA_BACKGROUND = "com.termux.RUN_COMMAND_BACKGROUND"
PREFIX = "/data/data/com.termux/files/usr"
HOME = "/data/data/com.termux/files/home"
SHELL = f"{PREFIX}/bin/sh"
SCRIPT = Path(__file__).resolve().parent / "phone" / "termux-agent.sh"
SERVE_PY = Path(__file__).resolve().parent / "phone" / "termux_serve.py"  # `serve` runs it
PROPERTIES_FIX = ("in Termux run: mkdir -p ~/.termux && echo 'allow-external-apps = true' >> "
                  "~/.termux/termux.properties && termux-reload-settings")
PACKAGES_FIX = "in Termux run: pkg install python python-numpy python-grpcio"


def escape_array_item(item: str) -> str:
    """One element of an ``am --esa`` value (commas separate elements, so escape them)."""
    return item.replace("\\", "\\\\").replace(",", "\\,")


def intent_command(script_path: str, arguments: list[str], *,
                   verb: str = "startservice") -> str:
    """The adb-shell command that asks Termux to run ``sh script_path ARGUMENTS`` in background.

    ``verb`` is ``startservice``, or ``start-foreground-service`` on phones that refuse to start
    a service of an app in background (Android 8+ may answer "app is in background")."""
    array = ",".join(escape_array_item(a) for a in [script_path, *arguments])
    argv = ["am", verb, "--user", "0", "-n", SERVICE, "-a", ACTION,
            "--es", EXTRA_PATH, SHELL, "--esa", EXTRA_ARGUMENTS, array,
            "--es", EXTRA_WORKDIR, HOME, "--ez", EXTRA_BACKGROUND, "true"]
    return shlex.join(argv)


@dataclass(frozen=True)
class IntentAnswer:
    """What ``am`` said: ``sent`` (Termux got it; it may still refuse), ``permission``,
    ``not-found`` (no such service: Termux missing or older than 0.95), ``background``, or
    ``error`` (anything else, in ``text``)."""

    outcome: str
    text: str


def parse_am_output(text: str, exit_code: int) -> IntentAnswer:
    """Classify ``am startservice`` output (see :class:`IntentAnswer`)."""
    clean = text.strip()
    if re.search(r"Requires permission", clean):
        return IntentAnswer("permission", clean)
    if re.search(r"Not found; no service started|Unable to start service", clean):
        return IntentAnswer("not-found", clean)
    if re.search(r"app is in background|Not allowed to start service", clean):
        return IntentAnswer("background", clean)
    if exit_code == 0 and re.search(r"Starting service", clean):
        return IntentAnswer("sent", clean)
    return IntentAnswer("error", clean or f"am exited {exit_code}")


def agent_pattern(name: str) -> str:
    """``pgrep -f`` pattern that finds this device's agent (its command line has no secret)."""
    return f"agent\\.zip .*--name {re.escape(name)}( |$)"


PERMISSION_REFUSED = (
    "this phone does not let the adb shell send Termux's RUN_COMMAND intent (the shell user "
    f"does not hold {PERMISSION}, and Android lets only apps that request it be granted it)")
PERMISSION_FIX = ("start the listener in Termux once: sh /data/local/tmp/testbed/termux-agent.sh "
                  "serve (docs/adb-bridge.md, 'The Termux listener')")
