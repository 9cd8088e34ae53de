#!/system/bin/sh
# Start the testbed device agent on a phone; run by the ADB bridge over `adb shell`.
#   sh /data/local/tmp/testbed/start-agent.sh AGENT_ARGS...
# Prints the agent's pid on success. Exit codes the bridge understands:
#   3 no Python the adb shell user can run, 4 Python without numpy or grpcio.
# Python is looked for in: $TESTBED_PYTHON, python3/python on PATH, Termux's prefix (readable by
# the shell user only on rooted or specially set up phones; see docs/adb-bridge.md).
DIR=$(cd "$(dirname "$0")" && pwd)
PIDFILE="$DIR/agent.pid"
LOG="$DIR/agent.log"

# An agent from an earlier session (cable pulled while it ran) must not run twice.
if [ -f "$PIDFILE" ]; then
  kill "$(cat "$PIDFILE")" 2>/dev/null
  rm -f "$PIDFILE"
fi

PY=""
for candidate in "$TESTBED_PYTHON" python3 python \
    /data/data/com.termux/files/usr/bin/python3 /data/local/tmp/python/bin/python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1; then
    PY="$candidate"
    break
  fi
done
if [ -z "$PY" ]; then
  echo "testbed: no Python that the adb shell can run on this phone (see docs/adb-bridge.md)" >&2
  exit 3
fi
if ! "$PY" -c "import numpy, grpc" >"$DIR/import.err" 2>&1; then
  echo "testbed: $PY has no numpy or grpcio: $(tail -n 1 "$DIR/import.err")" >&2
  exit 4
fi
nohup "$PY" "$DIR/agent.zip" "$@" >"$LOG" 2>&1 </dev/null &
echo $! >"$PIDFILE"
echo $!
