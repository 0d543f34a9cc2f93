"""deploy/ stays in step with the code: every metric, label value, setting and path it names exists.

The exported metric names and label values come from running the real collector
(kvtierd.metrics.DaemonCollector) on a synthetic stats reply (every field of replies.StatsReply),
with the label-bearing dicts filled from the code that fills them in the daemon (error codes,
request ops, abort causes, lease ends, session roles, pin modes, eviction policy segments). The Prometheus
expressions in alerts.yml and in the Grafana dashboard are then read with regexes, so those
checks run without PyYAML; the structural checks of the YAML files need it and skip without it.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from kvtierd import config
from kvtierd.attachments import Attachments, SessionEnd
from kvtierd.contract import protocol as P
from kvtierd.contract.codes import AbortCause, ErrorCode
from kvtierd.contract.events import Cause
from kvtierd.contract.replies import StatsReply
from kvtierd.fence import ROW_CAPS, Reason, Release
from kvtierd.histogram import Histogram
from kvtierd.holds import CAPS as HOLD_CAPS
from kvtierd.leases import LeaseEnd
from kvtierd.metrics import STORE_KEY_OUTCOMES, DaemonCollector
from kvtierd.policy import POLICIES, policy_class

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
SCRAPE = DEPLOY / "prometheus" / "scrape.yml"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvtierd-dashboard.json"
YAML_FILES = [ALERTS, SCRAPE, DAEMONSET]

# Labels Prometheus adds to every scraped series (instance, job), and histograms' bucket bound.
TARGET_LABELS = {"instance", "job"}


# --- what the code can emit --------------------------------------------------------------------
def abort_causes() -> set[str]:
    """Every `cause` label value of kvtierd_aborted_jobs_total: the values of codes.AbortCause,
    the only causes the job machine aborts with, among them rank_<end> for every way a session ends."""
    causes = {cause.value for cause in AbortCause}
    assert {f"rank_{end.value}" for end in SessionEnd} <= causes, "a way a session ends has no abort cause"
    return causes


def session_roles() -> set[str]:
    """Every `role` label value of kvtierd_sessions: the keys of ``Attachments.roles``."""
    return set(Attachments().roles())


def pin_results() -> set[str]:
    """What Region.pinned (the region_info `pinned` label) can be: the pin modes but auto."""
    return set(config.BY_NAME["pin"].choices) - {"auto"}


def policy_segments() -> set[str]:
    """Every `segment` label value: the segments of every registered eviction policy."""
    return {segment for name in POLICIES for segment in policy_class(name).segments}


def tier_snapshot() -> dict:
    """``CompanionTier.stats`` with every label value the second tier can emit."""
    from kvtierd.tier.backend import ERRORS
    from kvtierd.tier.disk import CAUSES
    from kvtierd.tier.link import LinkBusy
    from kvtierd.tier.seal import REASONS
    from kvtierd.tier.service import LANES
    from kvtierd.tiering.companion import OPS
    hist = Histogram()
    hist.observe(1e-3)
    codes = [*ERRORS, LinkBusy.code]
    disk = {"engine": "disk", "used_bytes": 1, "allocated_bytes": 2, "capacity_bytes": 3, "blocks": 1,
            "errors": {cause: 1 for cause in CAUSES}}
    return {"backend": "disk", "address": "/var/lib/kvtierd/tier", "state": "ready", "pid": 7, "last_error": None,
            "engine": disk, "restarts": 1, "killed": 0, "inflight": 2, "max_inflight": 64, "demote": True,
            "promote": True, "exclude": [], "low_watermark": 0.05, "demoted_blocks": 3, "demoted_bytes": 30,
            "demoting_blocks": 1, "demote_dropped_blocks": {r: 1 for r in ("busy", "down", "failed", "pressure")},
            "promoted_blocks": 4, "promoted_bytes": 40, "promoting_blocks": 1, "promote_failed_blocks": 1,
            "promote_jobs": 2, "promote_jobs_done": 1, "seal_rejected_blocks": {r: 1 for r in REASONS},
            "promote_aborted": {c: 1 for c in ("tier_failed", "tier_timeout")},
            "lookup_keys": {"hit": 5, "miss": 6}, "cleared_blocks": 2,
            "errors": [{"op": op, "code": code, "calls": 1} for op in OPS for code in codes],
            "call_seconds": {op: hist.snapshot() for op in OPS},
            "breaker": {lane: "open" for lane in set(LANES.values())}}


def snapshot(pinned: str, tier: bool = True) -> StatsReply:
    """A whole stats reply, label-bearing dicts filled with every value the code can emit;
    ``tier``: with the optional families too (the second tier's, the daemon's KV events stream's)."""
    hist = Histogram()
    hist.observe(1e-4)
    return StatsReply(
        region="/dev/shm/kvtierd/kvtierd.region", pinned=pinned, generation=0xABC, hugepages="thp",
        huge_page_size=2 << 20, huge_bytes=1 << 30,
        page_size=65536, capacity_bytes=1 << 30, used_bytes=1 << 29,
        pages_total=16384, pages_free=8192, pages_used=8192, pages_fenced=16,
        fenced_pages={reason.value: 1 for reason in Reason}, fence_released_pages={c.value: 1 for c in Release},
        fence_oldest_seconds=1.0, fence_grace_seconds=600.0, writer_rows=2,
        writer_rows_refused={cap: 1 for cap in ROW_CAPS}, fence_check_failures=1,
        held_pages=9, held_pages_top_engine=8, hold_capped_keys={cap: 1 for cap in HOLD_CAPS},
        entries_ready=100, entries_writing=3, entries_pinned=7, evictable=93, namespaces=1,
        leases_open=2, entries_leased=5, leased_keys=6, leases_granted=3, lease_ends={end.value: 1 for end in LeaseEnd},
        lease_missed_loads=1, lease_capped_keys=1,
        lookup_hit_keys=5, lookup_miss_keys=6, load_hit_keys=7, load_miss_keys=8,
        **{field: 1 for field in STORE_KEY_OUTCOMES.values()},
        store_jobs_done=9, load_jobs_done=10, evictions=11, operator_evictions=0,
        bytes_written=12, bytes_saved_dedup=13, engines=2, sessions=3, open_jobs=1, jobs_held=2, open_job_keys=9, tombstones=5,
        aborted_jobs={cause: 1 for cause in abort_causes()},
        session_roles={role: 1 for role in session_roles()},
        errors={code.name: 1 for code in ErrorCode},
        latency={op: hist.snapshot() for op in P.REQUESTS},
        vote_wait=hist.snapshot(),
        namespace_list=[], requests={}, clients_watched=0, uptime_seconds=1.0, socket="s", admin_socket="a",
        metrics_address=None, file_bytes=1 << 30, daemon_pid=1, stopping=False, region_problem=None,
        sessions_heartbeat=0, checksums=False, connections=4, connections_refused={"total": 1, "per_peer": 2},
        policy="slru", policy_admitted_keys=14, policy_refused_keys=15,
        policy_segments={segment: 1 for segment in policy_segments()},
        policy_evictions={segment: 1 for segment in policy_segments()}, policy_extra={},
        tier=tier_snapshot() if tier else {"backend": "off"},
        events={"log_bytes": 1, "log_budget_bytes": 2, "namespaces": 1, "stored_keys": 3,
                "removed_keys": {cause.value: 1 for cause in Cause}, "dropped_keys": 1, "resets": 1,
                "snapshot_keys": 1, "failed_runs": 1, "readers": 1, "reader_lag_keys": 1,
                # the daemon's KV events stream: optional, as the second tier is (kv_events_endpoint)
                "stream": {"batches": 1, "events": 2, "bytes": 3, "resyncs": 1, "replays": 1, "replay_batches": 1,
                           "replays_cut": 0, "bad_replay_requests": 0, "endpoint": "tcp://*:5557",
                           "replay_endpoint": None, "seq": 5, "buffered_batches": 1, "buffered_bytes": 10,
                           "replays_pending": 0} if tier else {}},
    )


class Exported:
    """Sample names, the family each belongs to, and label names/values per sample name."""

    def __init__(self, tier: bool = True):
        self.family_of: dict[str, str] = {}
        self.labels: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.series: dict[str, set[tuple]] = defaultdict(set)    # sample name → its label sets
        for pinned in sorted(pin_results()):
            for family in DaemonCollector(lambda: snapshot(pinned, tier)).collect():
                for sample in family.samples:
                    self.family_of[sample.name] = family.name
                    self.series[sample.name].add(tuple(sorted(sample.labels.items())))
                    for label, value in sample.labels.items():
                        self.labels[sample.name][label].add(value)
                # A family whose dict came out empty has no samples; its names still exist.
                suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                            "info": ["_info"]}.get(family.type, [""])
                for suffix in suffixes:
                    self.family_of.setdefault(family.name + suffix, family.name)

    @property
    def names(self) -> set[str]:
        return set(self.family_of)

    @property
    def all_label_names(self) -> set[str]:
        return {label for per_sample in self.labels.values() for label in per_sample}


@pytest.fixture(scope="module")
def exported() -> Exported:
    return Exported()


def test_the_synthetic_snapshot_exports_every_family_with_labels(exported):
    # Guards the fixture itself: the label-bearing families must have come out with values.
    for name, label in [("kvtierd_aborted_jobs_total", "cause"), ("kvtierd_errors_total", "code"),
                        ("kvtierd_sessions", "role"), ("kvtierd_request_duration_seconds_bucket", "op"),
                        ("kvtierd_region_info", "pinned"), ("kvtierd_pages", "state")]:
        assert exported.labels[name][label], f"{name} has no {label} values"
    assert "timeout" in exported.labels["kvtierd_aborted_jobs_total"]["cause"]
    assert "rank_died" in exported.labels["kvtierd_aborted_jobs_total"]["cause"]
    assert "INTERNAL" in exported.labels["kvtierd_errors_total"]["code"]


# --- reading PromQL with regexes ---------------------------------------------------------------
SELECTOR = re.compile(r"\b(kvtierd_\w+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def alert_exprs_text() -> str:
    return ALERTS.read_text()


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.extend(panel.get("targets", []))
        for inner in panel.get("panels", []):        # panels of collapsed rows
            out.extend(inner.get("targets", []))
    return out


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for t in dashboard_targets(dash)]
    exprs += [v.get("definition", "") for v in dash.get("templating", {}).get("list", [])]
    return exprs


def promql_sources() -> list[tuple[str, str]]:
    """(where, text) pairs of every place that names kvtierd metrics."""
    return [("alerts.yml", alert_exprs_text())] + [("dashboard", e) for e in dashboard_exprs(dashboard())]


def test_every_metric_named_in_alerts_and_dashboard_is_exported(exported):
    unknown = set()
    for where, text in promql_sources():
        for name, _ in SELECTOR.findall(text):
            if name not in exported.names:
                unknown.add(f"{where}: {name}")
    assert not unknown, (f"metrics kvtierd/metrics.py does not export: {sorted(unknown)}; "
                         f"exported: {sorted(exported.names)}")


def _check_value(where: str, name: str, label: str, op: str, value: str, known: set[str]) -> str | None:
    if "$" in value:                           # a Grafana variable ($instance)
        return None
    if op in ("=", "!="):
        return None if value in known else f"{where}: {name}{{{label}{op}\"{value}\"}} (known: {sorted(known)})"
    alternatives = value.split("|")
    if all(re.fullmatch(r"\w+", a) for a in alternatives):
        missing = [a for a in alternatives if a not in known]
        return f"{where}: {name}{{{label}{op}\"{value}\"}}: {missing} never emitted (known: {sorted(known)})" \
            if missing else None
    if not any(re.fullmatch(value, k) for k in known):
        return f"{where}: {name}{{{label}{op}\"{value}\"}} matches no value (known: {sorted(known)})"
    return None


def test_every_label_and_value_in_selectors_is_one_the_code_emits(exported):
    problems = []
    for where, text in promql_sources():
        for name, braces in SELECTOR.findall(text):
            if not braces or name not in exported.names:
                continue
            labels = exported.labels[name]
            allowed = set(labels) | TARGET_LABELS
            for label, op, value in MATCHER.findall(braces):
                if label not in allowed:
                    problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(allowed)})")
                elif label in labels and label != "le":
                    problem = _check_value(where, name, label, op, value, labels[label])
                    if problem:
                        problems.append(problem)
    assert not problems, "\n".join(problems)


def test_grouping_and_legend_labels_exist(exported):
    known = exported.all_label_names | TARGET_LABELS
    problems = []
    for where, text in promql_sources():
        for group in GROUPING.findall(text):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if label not in known:
                    problems.append(f"{where}: grouping by unknown label {label!r}")
    for target in dashboard_targets(dashboard()):
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
            if label not in known:
                problems.append(f"dashboard legend {target['legendFormat']!r}: unknown label {label!r}")
    for label in re.findall(r"\$labels\.(\w+)", alert_exprs_text()):
        if label not in known:
            problems.append(f"alerts.yml annotation: unknown label $labels.{label}")
    assert not problems, "\n".join(problems)


def test_dashboard_shows_every_exported_family(exported):
    shown = {exported.family_of[name] for _, text in promql_sources() for name, _ in SELECTOR.findall(text)
             if name in exported.family_of}
    missing = sorted(set(exported.family_of.values()) - shown)
    assert not missing, f"exported families no alert or panel uses: {missing}; add a panel for them"


# --- the alert rules -----------------------------------------------------------------------
def test_alerts_reference_the_scrape_job():
    scrape_jobs = set(re.findall(r"^\s*- job_name:\s*(\S+)", SCRAPE.read_text(), re.M))
    used = set(re.findall(r'\bup\{[^}]*job="([^"]+)"', alert_exprs_text()))
    assert used and used <= scrape_jobs, f"alerts match up{{job=...}} {used}, scrape.yml defines {scrape_jobs}"


def test_alert_rules_are_well_formed():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(ALERTS.read_text())
    names = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            names.append(rule["alert"])
            assert rule["expr"].strip()
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            for key in ("summary", "description"):
                assert len(rule["annotations"][key].strip()) > 20, f"{rule['alert']}: {key} too short"
            assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
    assert len(names) == len(set(names)), "duplicate alert names"
    required = {"KvtierdDown", "KvtierdEvictionStorm", "KvtierdAbortedJobs", "KvtierdRegionFullLittleEvictable",
                "KvtierdErrorReplies", "KvtierdSlowRequests", "KvtierdSlowVotes"}
    assert required <= set(names)


def test_yaml_files_parse():
    yaml = pytest.importorskip("yaml")
    for path in YAML_FILES:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, path


def test_scrape_config_targets_the_default_metrics_port():
    default = config.BY_NAME["metrics_address"].default
    assert f'"{default}"' in SCRAPE.read_text()
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(SCRAPE.read_text())
    (job,) = doc["scrape_configs"]
    assert job["job_name"] == "kvtierd"
    assert job["static_configs"][0]["targets"] == [default]
    assert "instance" in job["static_configs"][0]["labels"]


# --- the Grafana dashboard -----------------------------------------------------------------
def test_dashboard_is_importable_json():
    dash = dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    ids = []
    for panel in dash["panels"]:
        ids.append(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    assert len(ids) == len(set(ids)), "duplicate panel ids"


def test_dashboard_has_the_operator_panels():
    titles = {p["title"] for p in dashboard()["panels"]}
    for title in ("Capacity vs used bytes", "Pages by state", "Entries by state", "Hit ratio (lookup and load)",
                  "Store outcomes", "Evictions", "Aborted jobs by cause", "D2H written vs saved by one-copy dedup",
                  "Sessions by role", "Request latency p50 / p99 by op", "Vote wait p50 / p99", "Errors by code"):
        assert title in titles


# --- the Kubernetes example ----------------------------------------------------------------
def configmap_toml() -> str:
    """The kvtierd.toml block scalar of the ConfigMap, read without a YAML parser."""
    lines = DAEMONSET.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.fullmatch(r"(\s*)kvtierd\.toml:\s*\|\s*", line)
        if m:
            indent = len(m.group(1))
            body = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                body.append(nxt)
            return textwrap.dedent("\n".join(body)) + "\n"
    raise AssertionError("no `kvtierd.toml: |` block in daemonset.yaml")


def load_k8s_config(tmp_path) -> config.Config:
    path = tmp_path / "kvtierd.toml"
    path.write_text(configmap_toml())
    table = tomllib.loads(path.read_text())
    unknown = set(table) - set(config.BY_NAME)
    assert not unknown, f"ConfigMap TOML has keys that are not settings: {sorted(unknown)}"
    return config.load(None, str(path), environ={})      # parses and bound-checks every value


def test_configmap_toml_holds_real_settings(tmp_path):
    k8s_config = load_k8s_config(tmp_path)
    assert all(k8s_config.sources[name].startswith("file:") for name in
               ("dir", "size", "page_size", "pin", "group", "job_timeout", "metrics_address"))


def test_deploy_files_name_only_real_environment_variables():
    known = {s.env for s in config.SETTINGS} | {"KVTIERD_CONFIG", "KVTIERD_SOCKET"}
    for path in [*YAML_FILES, DEPLOY / "README.md"]:
        used = set(re.findall(r"\bKVTIERD_[A-Z_]+\b", path.read_text()))
        assert used <= known, f"{path.name}: unknown {sorted(used - known)}"


def test_deploy_files_name_only_real_kvtierctl_commands():
    from kvtierd.cli import COMMANDS

    for path in [*YAML_FILES, DEPLOY / "README.md"]:
        # Commands quoted in `backticks`, e.g. `kvtierctl clients` or `kubectl exec ... kvtierctl stats`.
        used = set(re.findall(r"`[^`\n]*?\bkvtierctl (?:--\S+ \S+ )*([a-z]+)\b", path.read_text()))
        assert used <= set(COMMANDS), f"{path.name}: kvtierctl has no {sorted(used - set(COMMANDS))}"


def _containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def test_daemonset_paths_probes_and_ports_agree_with_its_config(tmp_path):
    yaml = pytest.importorskip("yaml")
    from kvtierd.cli import COMMANDS, ctl_parser

    k8s_config = load_k8s_config(tmp_path)

    docs = {d["kind"]: d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d}
    assert set(docs) >= {"ConfigMap", "DaemonSet", "Pod"}
    assert docs["ConfigMap"]["data"]["kvtierd.toml"] == configmap_toml()
    directory = k8s_config.dir
    sock = f"{directory}/{k8s_config.name}.sock"
    port = int(k8s_config.metrics_address.rpartition(":")[2])

    for kind in ("DaemonSet", "Pod"):
        spec = docs[kind]["spec"]["template"]["spec"] if kind == "DaemonSet" else docs[kind]["spec"]
        host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert set(host_paths.values()) == {directory}, f"{kind} must share the host's {directory}"
        for container in _containers(spec):
            for mount in container.get("volumeMounts", []):
                if mount["name"] in host_paths:    # same path inside as outside: the region path is announced
                    assert mount["mountPath"] == directory, (kind, container["name"])
            for env in container.get("env", []):
                if env["name"] == "KVTIERD_SOCKET":
                    assert env["value"] == sock
    engine = docs["Pod"]["spec"]
    assert any(e["name"] == "KVTIERD_SOCKET" for c in engine["containers"] for e in c.get("env", []))
    assert 2000 in engine["securityContext"]["supplementalGroups"]

    daemon_spec = docs["DaemonSet"]["spec"]["template"]["spec"]
    (daemon,) = daemon_spec["containers"]
    assert "IPC_LOCK" in daemon["securityContext"]["capabilities"]["add"]
    assert [p["containerPort"] for p in daemon["ports"] if p["name"] == "metrics"] == [port]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        argv = daemon[probe]["exec"]["command"]
        assert argv[0] == "kvtierctl"
        args = ctl_parser().parse_args(argv[1:])
        assert args.socket == sock and args.command in COMMANDS
    memory = daemon["resources"]["limits"]["memory"]
    assert memory.endswith("Gi") and int(memory[:-2]) << 30 > k8s_config.size, "memory limit must cover the region"
    assert daemon["resources"]["requests"] == daemon["resources"]["limits"], "Guaranteed QoS"
    assert daemon_spec["nodeSelector"]


def test_the_unit_gives_the_default_caps_their_descriptors():
    # Issue 11 item 2: the unit set no LimitNOFILE, so the daemon ran with 1,024 descriptors.
    from kvtierd.config import BY_NAME
    from kvtierd.contract.region_format import WRITER_SLOTS
    from kvtierd.daemon import FD_RESERVE, fit_fd_caps
    unit = (DEPLOY / "systemd" / "kvtierd.service").read_text()
    limit = int(re.search(r"^LimitNOFILE=(\d+)$", unit, re.M).group(1))
    # Issue 26 B: a writer gone with pages fenced holds a pidfd too (one per writer row at most).
    caps = (BY_NAME["max_connections"].default_value(), BY_NAME["max_sessions"].default_value(), WRITER_SLOTS)
    assert fit_fd_caps(limit, *caps[:2]) == caps and limit >= sum(caps) + FD_RESERVE
    connections, sessions, rows = fit_fd_caps(1024, *caps[:2])      # a low hard limit: caps shrink to fit it
    assert connections + sessions + rows + FD_RESERVE <= 1024 and connections >= 256 and rows >= 256


# --- the systemd unit ------------------------------------------------------------------------
UNIT = DEPLOY / "systemd" / "kvtierd.service"
# Directories that are empty after a boot (tmpfs, or mounted at boot): a path under one exists only
# once something creates it.
EMPTY_AT_BOOT = ("/dev/shm", "/dev/hugepages", "/run", "/tmp", "/var/tmp")


def unit_lines(commented: bool) -> list[tuple[str, str]]:
    """(key, value) of the unit's settings; with ``commented``, also of its commented-out settings
    (the alternatives the comments tell operators to switch on)."""
    out = []
    for line in UNIT.read_text().splitlines():
        if commented and re.match(r"#[A-Z]\w*=", line):
            line = line[1:]
        m = re.fullmatch(r"([A-Z]\w*)=(.*)", line)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


@pytest.mark.parametrize("commented", [False, True], ids=["as shipped", "alternatives switched on"])
def test_every_read_write_path_of_the_unit_exists_at_boot(commented):
    # Issue 27 item 1: ReadWritePaths=/dev/shm/kvtierd (no "-" prefix) names a directory the daemon
    # creates, absent after a boot: namespace setup failed (226/NAMESPACE) and the unit never started.
    lines = unit_lines(commented)
    created = {arg for key, value in lines if key == "ExecStartPre"
               for arg in re.findall(r"\binstall -d\b.*?(/\S+)$", value)}
    problems = []
    for key, value in lines:
        if key not in ("ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "BindPaths", "BindReadOnlyPaths"):
            continue
        for path in value.split():
            if path.startswith("-") or path in created:
                continue
            if path.startswith(EMPTY_AT_BOOT):
                problems.append(f"{key}={path}: absent after a boot; prefix it with '-' or create it in ExecStartPre")
    assert not problems, problems


def test_the_unit_sets_no_setting_that_overrides_its_config_file():
    # Issue 27 item 4: Environment=KVTIERD_DIR/KVTIERD_GROUP silently overrode dir and group set in
    # /etc/kvtierd/kvtierd.toml, the file the docs tell operators to edit.
    lines = unit_lines(commented=True)
    env = [value for key, value in lines if key == "Environment" and "KVTIERD_" in value]
    assert not env, f"the unit overrides its config file: {env}"
    (exec_start,) = [value for key, value in lines if key == "ExecStart"]
    flags = re.findall(r"(--[\w-]+)", exec_start)
    assert flags == ["--config"], f"ExecStart passes settings that override the file: {flags}"
    shipped = tomllib.loads((DEPLOY / "kvtierd.example.toml").read_text())
    group = re.search(r"^Group=(\S+)$", UNIT.read_text(), re.M).group(1)
    assert shipped["group"] == group and shipped["dir"] == "/dev/shm/kvtierd"


# Grafana units by what a query yields (issue 27 item 7: counts were shown as ops, seconds as ops,
# blocks in flight as Bps).
UNITS = {"bytes": {"bytes", "decbytes"}, "bytes_per_second": {"Bps", "binBps"}, "seconds": {"s", "ms", "µs"},
         "per_second": {"ops", "reqps", "cps"}, "count": {"none", "short"}, "ratio": {"percentunit"}}


def query_kind(expr: str) -> str:
    """What a dashboard query yields, from the metrics it reads and the functions it applies."""
    names = [name for name, _ in SELECTOR.findall(expr)]
    if "histogram_quantile" in expr:
        assert all(n.endswith("_seconds_bucket") for n in names), expr
        return "seconds"
    if re.search(r"\)\s*/\s", expr):
        if {n.rsplit("_", 1)[-1] for n in names} == {"sum", "count"} and names[0].endswith("_seconds_sum"):
            return "seconds"                       # a histogram's mean
        return "ratio"
    if "rate(" in expr:
        return "bytes_per_second" if names[0].endswith("_bytes_total") else "per_second"
    if "increase(" in expr or re.search(r"\bcount\b", expr):
        return "count"
    if names[0].endswith("_bytes"):
        return "bytes"
    if names[0].endswith("_seconds"):
        return "seconds"
    return "count"


def test_every_dashboard_query_is_shown_in_a_unit_of_its_kind():
    problems = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            continue
        config = panel.get("fieldConfig", {})
        overrides = {o["matcher"]["options"]: p["value"] for o in config.get("overrides", [])
                     if o["matcher"]["id"] == "byFrameRefID" for p in o["properties"] if p["id"] == "unit"}
        for target in panel["targets"]:
            unit = overrides.get(target["refId"], config.get("defaults", {}).get("unit", "none"))
            kind = query_kind(target["expr"])
            if unit not in UNITS[kind]:
                problems.append(f"{panel['title']!r} {target['refId']}: {kind} shown as {unit!r} "
                                f"(one of {sorted(UNITS[kind])}): {target['expr'][:80]}")
    assert not problems, "\n".join(problems)
