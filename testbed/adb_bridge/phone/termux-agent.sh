#!/data/data/com.termux/files/usr/bin/sh
# Run inside Termux, as the Termux app's user with Termux's python, never by the adb shell: the
# adb shell can read nothing Termux writes, so everything the bridge learns comes from the
# process list or over a reverse port. Two ways in (docs/adb-bridge.md):
#   sh /data/local/tmp/testbed/termux-agent.sh serve [127.0.0.1:PORT]
#                                     typed once by the user in Termux (unrooted phones): dial
#                                     the bridge's control port (default 127.0.0.1:7702, the
#                                     phone port + 2) and take start/stop from it; retries
#                                     every second, Ctrl-C ends it
# and the verbs below, which the bridge sends with Termux's RUN_COMMAND intent where the phone
# lets the adb shell send it:
#   sh termux-agent.sh start ARGS...  start the agent (ARGS as for python -m testbed.agent;
#                                     the token comes with --token-file, never on a command line)
#   sh termux-agent.sh stop           SIGTERM to the agent this script started (a graceful leave)
#   sh termux-agent.sh probe HOST:PORT  report python, numpy and grpcio versions there
DIR=$(cd "$(dirname "$0")" && pwd)
STATE="${HOME:-/data/data/com.termux/files/home}/.testbed"
mkdir -p "$STATE"
PIDFILE="$STATE/agent.pid"
PY=$(command -v python3 || command -v python)

case "$1" in
  serve)
    [ -n "$PY" ] || { echo "testbed: no python in Termux; run: pkg install python python-numpy python-grpcio" >&2; exit 3; }
    # exec: the script file may be replaced by a newer push while the listener runs
    exec "$PY" "$DIR/termux_serve.py" "$DIR" "${2:-127.0.0.1:7702}"
    ;;
  start)
    shift
    if [ -f "$PIDFILE" ]; then  # an agent from an earlier session must not run twice
      kill "$(cat "$PIDFILE")" 2>/dev/null
      rm -f "$PIDFILE"
    fi
    [ -n "$PY" ] || { echo "no python in Termux: pkg install python" >"$STATE/start.err"; exit 3; }
    "$PY" -c "import numpy, grpc" >"$STATE/start.err" 2>&1 || exit 4
    nohup "$PY" "$DIR/agent.zip" "$@" >"$STATE/agent.log" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    ;;
  stop)
    [ -f "$PIDFILE" ] && kill -TERM "$(cat "$PIDFILE")" 2>/dev/null
    rm -f "$PIDFILE"
    ;;
  probe)
    # The report goes over the reverse port because the adb shell cannot read Termux's files.
    # Without a python there is nothing to send it with: stay visible in the process list for a
    # while instead, so that the bridge can tell "Termux ran this" from "Termux refused".
    if [ -z "$PY" ]; then
      sleep 15
      exit 3
    fi
    "$PY" - "$2" <<'PYEOF'
import json, socket, sys
report = {"python": sys.version.split()[0]}
for module in ("numpy", "grpc"):
    try:
        report[module] = __import__(module).__version__
    except Exception as exc:  # any import failure is what the report is for
        report[module] = None
        report[module + "_error"] = f"{type(exc).__name__}: {exc}"
host, _, port = sys.argv[1].rpartition(":")
with socket.create_connection((host, int(port)), timeout=10) as s:
    s.sendall(json.dumps(report).encode() + b"\n")
PYEOF
    ;;
  *)
    echo "usage: termux-agent.sh serve [127.0.0.1:PORT] | start ARGS... | stop | probe HOST:PORT" >&2
    exit 2
    ;;
esac
