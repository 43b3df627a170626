#!/bin/sh
# Installs the Debian 12 packages kvtier needs to build and test, only those missing.
# Run as root (or with sudo available). Nothing is downloaded except Debian packages.
set -eu
# build: compilers, BLAS, hashes, JSON, HTTP; tests: cmocka, clang (libFuzzer), promtool,
# Chromium (dashboard test, driven by playwright-core from tests/e2e), Chart.js for the dashboard,
# valgrind (the examples run under it against the installed library), python3 (make mutate); the
# remote tier: hiredis (libhiredis-dev) and redis-server (its tests start real servers on loopback)
PKGS="build-essential cmake pkg-config libopenblas-dev libssl-dev libxxhash-dev libjansson-dev libcmocka-dev gnuplot-nox
 libmicrohttpd-dev clang libclang-rt-14-dev prometheus libjs-chart.js chromium curl valgrind python3
 libhiredis-dev redis-server"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "kvtier: installing missing Debian packages:$missing" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing
