#!/usr/bin/env bash
# Install the Debian packages testbed uses, when we are root on a Debian-like machine.
#   mininet, bridge-utils : the Mininet network backend (Linux-bridge switches, mnexec)
#   iperf3                : `testbed net check` measures links with it
#   adb                   : the real adb client, for the ADB bridge and its conformance tests
# Without root (or without apt-get) it prints what is missing and carries on: the loopback
# backend needs none of these, and the tests that do skip with a reason.
set -euo pipefail
packages=(mininet bridge-utils iperf3 adb)
commands=(mnexec brctl iperf3 adb)
missing=()
for i in "${!packages[@]}"; do
  command -v "${commands[$i]}" >/dev/null 2>&1 || missing+=("${packages[$i]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "note: not root or no apt-get; not installing ${missing[*]} (Mininet and adb tests will skip)" >&2
  exit 0
fi
echo "installing Debian packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
