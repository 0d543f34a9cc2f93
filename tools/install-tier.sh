#!/usr/bin/env bash
# Installs the second-tier engines the tier tests and benchmark run against, on loopback:
#   - Debian packages: libibverbs1 (Mooncake's libraries link it even for TCP), redis-server and
#     redis-tools (Debian 12 ships Redis 7.0, not Valkey; valkey-server is used instead when a
#     later Debian provides it) — only when missing, and only as root (else it says what to run);
#   - into the given venv: the Mooncake Store wheel (non-CUDA build: a bundled mooncake_master and
#     the store client extension), pinned to the version this project was tested with, and redis-py
#     with hiredis (not used by kvtierd: the benchmark's floor for Redis Cluster, kvtierbench/tier.py).
# Usage: tools/install-tier.sh VENV
set -euo pipefail
VENV=${1:?usage: tools/install-tier.sh VENV}
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1

need=()
dpkg -s libibverbs1 >/dev/null 2>&1 || need+=(libibverbs1)
if ! command -v valkey-server >/dev/null && ! command -v redis-server >/dev/null; then need+=(redis-server); fi
if ! command -v valkey-cli >/dev/null && ! command -v redis-cli >/dev/null; then need+=(redis-tools); fi
if ((${#need[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "install-tier: missing Debian packages: ${need[*]}; run: sudo apt-get install -y ${need[*]}" >&2
        exit 1
    fi
    apt-get update -qq
    # policy-rc.d or not, a packaged redis-server service is never what the tests use: they start
    # their own cluster nodes on free loopback ports.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

"$VENV/bin/pip" install -q "$MOONCAKE" "redis>=5" "hiredis>=2"
# Every bundled binary and extension must resolve its libraries (libibverbs1 above).
missing=0
for f in "$VENV"/lib/python3*/site-packages/mooncake/{store*.so,engine*.so,mooncake_master}; do
    [[ -e $f ]] || continue
    if ldd "$f" | grep "not found"; then missing=1; fi
done
if ((missing)); then echo "install-tier: Mooncake's libraries do not resolve (see above)" >&2; exit 1; fi
echo "install-tier: $("$VENV/bin/pip" show mooncake-transfer-engine-non-cuda | sed -n 's/^Version: /mooncake-transfer-engine-non-cuda /p'), $( (valkey-server --version || redis-server --version) 2>/dev/null | head -1)"
