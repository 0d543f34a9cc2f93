"""deploy/helm/kvtierd: Helm's own lint and template engine (Helm v4's Go SDK through
helm-python-sdk, which ``make deploy-install`` installs: Helm publishes no Debian, PyPI or npm
package of its CLI), the rendered manifests validated against the Kubernetes API's schemas
(kubernetes-validate), the PrometheusRule checked by promtool and equal to
deploy/prometheus/alerts.yml, the ConfigMap's kvtierd.toml loaded by kvtierd's own config loader,
and the default rendering equal to deploy/kubernetes/daemonset.yaml.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvtierd import config

helm = pytest.importorskip("helm_python", reason="Helm's SDK is not installed: make deploy-install")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="make deploy-install")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvtierd"
EXAMPLE = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
KUBERNETES = "1.30.0"
# Variants an operator sets: what each must still render validly.
VARIANTS = {
    "default": {},
    "tier": {"tier": {"backend": "redis", "address": "h1:7000,h2:7000", "settings": {"ttl_s": 3600}}},
    "hugetlbfs": {"hugepages": {"mode": "on", "hugetlbfs": True}, "region": {"sizeGiB": 32}},
    "hostPID, no monitoring objects": {"hostPID": True, "priorityClassName": "system-node-critical",
                                       "metrics": {"serviceMonitor": {"enabled": False},
                                                   "prometheusRule": {"enabled": False},
                                                   "networkPolicy": {"enabled": False}}},
    "settings": {"config": {"max_leased_keys": 1048576, "checksums": True, "policy": "lru"}},
}


def render(values: dict) -> dict[str, dict]:
    """The chart's manifests (release kvtierd, namespace kvtier) by kind."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="kvtierd", namespace="kvtier")
    docs = [d for name, text in files.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def toml_of(configmap: dict, tmp_path: Path) -> config.Config:
    path = tmp_path / "kvtierd.toml"
    path.write_text(configmap["data"]["kvtierd.toml"])
    return config.load(None, str(path), environ={})       # every key a setting, every value valid


def test_helm_lint_finds_nothing_to_warn_about():
    for name, values in VARIANTS.items():
        report = helm.lint(str(CHART), values, strict=True)
        serious = [m for m in report["messages"] if m["severity"] > 1] + report["errors"]
        assert not serious, (name, report)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_manifest_is_valid(variant, tmp_path):
    docs = render(VARIANTS[variant])
    for kind, doc in docs.items():
        if kind in ("ServiceMonitor", "PrometheusRule"):      # CRDs: checked below
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    cfg = toml_of(docs["ConfigMap"], tmp_path)
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (daemon,) = pod["containers"]
    limits = daemon["resources"]["limits"]
    region_home = "hugepages-2Mi" if "hugepages-2Mi" in limits else "memory"
    assert int(limits[region_home].removesuffix("Gi")) << 30 >= cfg.size, "the pod must hold the region"
    socket = f"{cfg.dir}/{cfg.name}.sock"
    assert {m["mountPath"] for m in daemon["volumeMounts"]} >= {cfg.dir}
    assert [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v] == [cfg.dir]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert daemon[probe]["exec"]["command"][:3] == ["kvtierctl", "--socket", socket]
    assert pod["securityContext"]["runAsGroup"] == VARIANTS[variant].get("group", {}).get("gid", 2000)
    if "ServiceMonitor" in docs:
        (endpoint,) = docs["ServiceMonitor"]["spec"]["endpoints"]
        assert endpoint["port"] == "metrics" and docs["ServiceMonitor"]["spec"]["jobLabel"] == "app.kubernetes.io/name"
        assert docs["Service"]["spec"]["selector"] == docs["DaemonSet"]["spec"]["selector"]["matchLabels"]


def test_the_prometheus_rule_is_the_alerts_file_and_promtool_accepts_it(tmp_path):
    rule = render({})["PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    from tests.deploy.test_alerts import promtool
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_default_rendering_is_the_kubernetes_example(tmp_path):
    # deploy/kubernetes/daemonset.yaml is the same deployment, commented: it must not drift.
    chart = render({})
    example = {d["kind"]: d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d}
    for kind in ("DaemonSet", "NetworkPolicy"):
        ours, theirs = chart[kind]["spec"], example[kind]["spec"]
        if kind == "DaemonSet":
            ours, theirs = dict(ours, template=ours["template"]["spec"]), dict(theirs,
                                                                               template=theirs["template"]["spec"])
        assert ours == theirs, kind
    assert chart["ConfigMap"]["metadata"]["name"] == example["ConfigMap"]["metadata"]["name"]
    example_toml = tmp_path / "example"
    example_toml.mkdir()
    assert toml_of(chart["ConfigMap"], tmp_path).values == toml_of(example["ConfigMap"], example_toml).values
