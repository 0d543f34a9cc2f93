#!/usr/bin/env bash
# Installs what the deploy/ checks (tests/deploy, make test-deploy) run:
#   - promtool (`promtool check rules`, `promtool test rules` on deploy/prometheus/alerts.yml) from
#     Debian's prometheus package, unpacked into the venv: only the binary is used, so the package's
#     service and user are never installed;
#   - systemd-nspawn (Debian's systemd-container), which boots deploy/systemd/kvtierd.service under
#     a real systemd as PID 1 — only when missing, and only as root (else it says what to run);
#   - into the venv: Helm v4's Go SDK behind a C ABI (helm-python-sdk: Helm's own chart loader, lint
#     and template engine; Helm publishes no Debian, PyPI or npm package of its CLI and nothing else is
#     reachable here), kubernetes-validate (the Kubernetes API's JSON schemas, to validate what the
#     chart renders) and PyYAML.
# Usage: tools/install-deploy-tools.sh VENV
set -euo pipefail
VENV=${1:?usage: tools/install-deploy-tools.sh VENV}
PROMETHEUS_DEB=prometheus        # Debian 12: 2.42
HELM_SDK=helm-python-sdk==0.2.2  # Helm SDK v4.2.3
K8S_VALIDATE=kubernetes-validate==1.37.0

apt_ready=0
apt_update() { ((apt_ready)) || { apt-get update -qq; apt_ready=1; }; }

if [[ ! -x $VENV/bin/promtool ]]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && { apt-get download -qq "$PROMETHEUS_DEB" 2>/dev/null || { apt_update && apt-get download -qq "$PROMETHEUS_DEB"; }; })
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
    install -m 0755 "$tmp/root/usr/bin/promtool" "$VENV/bin/promtool"
fi

if ! command -v systemd-nspawn >/dev/null; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "install-deploy-tools: systemd-nspawn is missing; run: sudo apt-get install -y systemd-container" >&2
        echo "  (tests/deploy/test_systemd_boot.py skips without it)" >&2
    else
        apt_update
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd-container >/dev/null
    fi
fi

"$VENV/bin/pip" install -q "$HELM_SDK" "$K8S_VALIDATE" pyyaml
echo "install-deploy-tools: $("$VENV/bin/promtool" --version 2>&1 | head -1); $(systemd-nspawn --version 2>/dev/null | head -1); helm SDK $("$VENV/bin/python" -c 'import helm_python as h; print(h.helm_sdk_version())')"
