#!/system/bin/sh
# Run a Python script on the phone with the first Python the adb shell can use:
#   sh /data/local/tmp/testbed/run-python.sh SCRIPT ARGS...
# Exit 3: no Python; 4: Python without numpy. Same search order as start-agent.sh.
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
if ! "$PY" -c "import numpy" >/dev/null 2>&1; then
  echo "testbed: $PY has no numpy" >&2
  exit 4
fi
exec "$PY" "$@"
