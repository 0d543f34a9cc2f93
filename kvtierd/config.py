"""Every daemon setting, declared once: name, type, default, bounds, environment variable, doc.

The table drives the TOML config file, the ``kvtierd`` command-line flags, the KVTIERD_*
environment variables and the settings reference. Precedence, lowest to highest: built-in
default < config file < environment < command line. ``load`` returns the effective values and,
for each, where it came from.

Sizes accept binary units (``64KiB``, ``512MiB``, ``64GiB``) or plain byte counts; ``KB``, ``MB``,
``GB``, ``TB`` (and ``K``, ``M``, ``G``, ``T``) are accepted as the same binary units, and every
place that documents a size says so (``64GB`` is 64 × 2^30 bytes, not 64 × 10^9). Durations are
seconds (floats).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .contract.paths import DEFAULT_NAME, default_directory
from .policy import DEFAULT as DEFAULT_POLICY
from .policy import POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_FILE = "/etc/kvtierd/kvtierd.toml"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "tb": 1 << 40}


# What a size may be, said alike by the docs, the --help of every size setting and the error for a bad one.
SIZE_UNITS = ("binary units: 65536, 64KiB, 512MiB, 64GiB; KB, MB, GB, TB are read as the same binary units "
              "(64GB = 64GiB = 64 × 2^30 bytes)")


def parse_size(text: str | int) -> int:
    """'64KiB' → 65536. Binary units throughout (KB and KiB both mean 1024)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size ({SIZE_UNITS})")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false)")


@dataclass(frozen=True)
class Setting:
    name: str
    type: str                       # size | int | float | str | bool | choice
    default: Any                    # a value, or a callable giving one
    doc: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        return "KVTIERD_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.parse(self.default)

    def parse(self, raw: Any) -> Any:
        """Convert and bound-check one value; ValueError names the setting."""
        try:
            value = _PARSERS[self.type](raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"setting {self.name}: {exc}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"setting {self.name}: {value!r} is not one of {', '.join(self.choices)}")
        if self.lo is not None and value < self.lo:
            raise ValueError(f"setting {self.name}: {raw!r} is below the minimum {self.describe_bound(self.lo)}")
        if self.hi is not None and value > self.hi:
            raise ValueError(f"setting {self.name}: {raw!r} is above the maximum {self.describe_bound(self.hi)}")
        return value

    def describe_bound(self, bound: float) -> str:
        return format_size(int(bound)) if self.type == "size" else str(bound)


def _parse_int(raw: Any) -> int:
    # int() alone would take TOML's true as 1 and 2.5 as 2.
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(f"{raw!r} is not an integer")
    return int(raw)


def _parse_float(raw: Any) -> float:
    # NaN compares false with both bounds, so it would pass any bound check.
    value = float(raw)
    if isinstance(raw, bool) or math.isnan(value):
        raise ValueError(f"{raw!r} is not a number")
    return value


def _parse_json(raw: Any) -> dict:
    """A JSON object (a TOML inline table arrives as a dict already)."""
    value = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(value, dict):
        raise ValueError(f"{raw!r} is not a JSON object (example: '{{\"protocol\": \"tcp\"}}')")
    return value


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "size": parse_size,
    "int": _parse_int,
    "float": _parse_float,
    "str": str,
    "choice": str,
    "bool": parse_bool,
    "json": _parse_json,
}

SETTINGS: tuple[Setting, ...] = (
    Setting("dir", "str", default_directory,
            "Directory of the region's files, its lock and the sockets (default: /dev/shm/kvtierd, else "
            "$XDG_RUNTIME_DIR/kvtierd, else /tmp/kvtierd-UID)."),
    Setting("name", "str", DEFAULT_NAME, "Base name of <dir>/<name>.region, .meta, .lock and .sock; one daemon per name."),
    Setting("size", "size", "512MiB", "Size of the region: its metadata file plus its region file (the pages).", lo=8 << 20, hi=1 << 50),
    Setting("page_size", "size", "64KiB", "Fixed page size of the data area (a power of two).",
            lo=4096, hi=1 << 30),
    Setting("pin", "choice", "auto", "Pin the region: auto (cudaHostRegister, else mlock, else unpinned "
            "with a warning), cuda, mlock or off.", choices=("auto", "cuda", "mlock", "off")),
    Setting("hugepages", "choice", "auto", "Huge pages for the region: auto (2 MiB or 1 GiB pages when the region's "
            "filesystem gives them: hugetlbfs, a tmpfs mounted huge=always/within_size/advise; else 4 KiB pages "
            "with one info line), on (refuse to start without them, naming the mount command or sysctl) or off "
            "(4 KiB pages). Decided when the region file is created.", choices=("auto", "on", "off")),
    Setting("group", "str", "", "Client group (name or numeric gid): may reach the socket and map the region "
            "(empty: the daemon's user only)."),
    Setting("job_timeout", "float", "30", "Seconds a store or load job may stay open before it is aborted "
            "(its pins drop; pages its writer may still copy into stay fenced).", lo=0.05, hi=86400),
    Setting("heartbeat_timeout", "float", "15", "Seconds without a request or heartbeat after which the session "
            "of a client the daemon cannot watch through a pidfd (another PID namespace) ends: its votes and pins "
            "go, its uncommitted pages stay fenced (fence_grace).", lo=0.5, hi=86400),
    Setting("fence_grace", "float", "600", "Seconds the pages a writer the daemon cannot watch (another PID "
            "namespace) was copying into stay fenced after it was last seen, when it neither re-attaches nor is "
            "proven dead. A writer the daemon can watch keeps its pages for as long as it lives. Lower values "
            "free pages sooner and widen the residual risk (docs/reliability.md).", lo=1, hi=86400 * 7),
    Setting("lease_ttl", "float", "5", "Seconds a lookup's lease holds its hits for the engine when the client "
            "names no ttl (a lease ends earlier when a load consumes it or the engine releases it). Leased "
            "entries cannot be evicted: longer leases make loads safer and leave less room.", lo=0.01, hi=3600),
    Setting("max_lease_ttl", "float", "60", "The longest lease a client may ask for, in seconds (longer asks are "
            "cut to it; the shortest is 10 ms).", lo=0.01, hi=86400),
    Setting("max_leased_keys_per_engine", "int", "262144", "Entries one engine's leases may hold, counted per "
            "lease, plus one per lease; a lookup past it leases the prefix that fits (its reply says how many). "
            "Bounds the daemon memory leases take; the capacity an engine keeps from eviction is bounded by "
            "max_held_share_per_engine.", lo=1, hi=1 << 30),
    Setting("max_leased_keys", "int", "1048576", "Entries the leases of all engines may hold together (as "
            "max_leased_keys_per_engine counts them).", lo=1, hi=1 << 32),
    Setting("max_held_share_per_engine", "float", "0.25", "Share of the region's pages one engine may keep out of "
            "eviction through its leases and its load jobs' pins together, each counted on its own. A lookup past it "
            "leases the prefix that fits (its reply says how many), a load pins the prefix that fits (the rest are "
            "misses); a load of leased keys is never cut.", lo=0.01, hi=1.0),
    Setting("max_held_share_per_namespace", "float", "0.4", "The same, for all engines of one namespace together.",
            lo=0.01, hi=1.0),
    Setting("max_held_share", "float", "0.75", "The same, for all engines together: the rest of the region stays "
            "evictable, so that any engine's store finds room.", lo=0.01, hi=1.0),
    Setting("checksums", "bool", "false", "Writers hash each block (xxh64) after copying; the hash is kept in the "
            "entry table and verified when a restarted daemon recovers the region and by kvtierctl check "
            "--checksums. Turned on, a restart drops the entries stored while it was off.", ),
    Setting("policy", "choice", DEFAULT_POLICY, "Eviction policy: slru (segmented LRU that keeps blocks used again "
            "apart from blocks seen once, with a memory of evicted keys; the measured best), lru, s3fifo or tinylfu. "
            "docs/operations.md says how to choose; kvtierctl stats shows its counters.", choices=tuple(POLICIES)),
    Setting("region_check_interval", "float", "5", "Seconds between checks that the region's files are still the "
            "ones mapped (not removed, replaced or truncated; a truncated region file is replaced at once).",
            lo=0.1, hi=3600),
    Setting("drain_timeout", "float", "10", "On SIGTERM: seconds to let in-flight stores and loads finish (new "
            "jobs are refused meanwhile) before stopping.", lo=0, hi=3600),
    Setting("max_connections", "int", "4096", "Connections to the client socket at most, from all peers; more are "
            "closed at once. The daemon raises its open-files limit to the hard limit at start and lowers this "
            "(with a warning) when the limit cannot hold it: set LimitNOFILE in the unit.", lo=16, hi=1 << 20),
    Setting("max_connections_per_peer", "int", "256", "Connections to the client socket at most from one peer (a "
            "process; every process of a uid whose pid the daemon cannot see counts as one peer).", lo=2,
            hi=1 << 20),
    Setting("max_sessions", "int", "2048", "Attached sessions at most (every engine has at least one); a hello past "
            "it gets LIMIT.", lo=1, hi=1 << 20),
    Setting("max_sessions_per_peer", "int", "128", "Attached sessions at most from one peer (see "
            "max_connections_per_peer).", lo=1, hi=1 << 20),
    Setting("max_writer_rows_per_peer", "int", "256", "Rows of the region's writer table one peer (see "
            "max_connections_per_peer) may hold: its writer sessions attached, and its writers gone whose pages stay "
            "fenced until they are proven done (fence_grace for those the daemon cannot watch). A writer hello past "
            "it gets LIMIT; all peers together hold at most 4,096 rows (the region format).", lo=1, hi=4096),
    Setting("max_job_keys_per_engine", "int", "262144", "Keys (plus one per job) one engine's open jobs may hold; "
            "a job past it gets LIMIT. About 120 bytes of daemon memory per key.", lo=1024, hi=1 << 30),
    Setting("max_job_keys", "int", "1048576", "Keys (plus one per job) the open jobs of all engines may hold "
            "together: bounds the memory jobs take (about 120 MiB at the default).", lo=1024, hi=1 << 32),
    Setting("max_tombstones", "int", "131072", "Finished job ids remembered (for a precise error to a late "
            "request), oldest forgotten first, across all engines; about 200 bytes each.", lo=1024, hi=1 << 26),
    Setting("metrics_address", "str", "127.0.0.1:9464", "HOST:PORT of the Prometheus endpoint (/metrics), or "
            "off. Loopback by default: bind elsewhere only behind a firewall."),
    Setting("metrics_cache_seconds", "float", "1", "A scrape of /metrics within this many seconds of the last "
            "rendering gets the same page: scraping in a loop (any local user can) costs the request loop one "
            "snapshot per period.", lo=0, hi=3600),
    Setting("recreate", "bool", "false", "Replace an existing region whose header or geometry does not match "
            "(its cached blocks are lost)."),
    Setting("prefault_threads", "int", "4", "Threads that prefault the region at start.", lo=1, hi=256),
    Setting("log_level", "choice", "info", "Log level.", choices=("debug", "info", "warning", "error")),
    # The second tier (docs/tier.md, docs/operations.md): off unless a backend is named.
    Setting("tier_backend", "choice", "off", "Second tier behind the region: off, mooncake (Mooncake Store), redis "
            "(Valkey/Redis Cluster) or disk (the node's own disk: slab files in a local directory, kept across "
            "restarts and reboots). Evicted blocks are demoted to it and lookup misses promoted from it, through a "
            "companion process the daemon owns.", choices=("off", "mooncake", "redis", "disk")),
    Setting("tier_address", "str", "", "Where the second tier is: the Mooncake master's HOST:PORT, Valkey/Redis "
            "Cluster nodes as HOST:PORT,HOST:PORT (seeds), or the disk tier's directory on a local filesystem."),
    Setting("tier_settings", "json", "{}", "The backend's further settings as a JSON object (a TOML inline table in "
            "the config file), e.g. {\"protocol\": \"tcp\", \"device\": \"\"} for Mooncake, {\"ttl_s\": 3600} for "
            "Redis, {\"capacity\": \"2TiB\"} for disk; docs/operations.md lists them. A key "
            "the backend does not take is an error at start."),
    Setting("tier_key_file", "str", "", "File of the key (64 hex digits, mode 0600) that seals every block in the "
            "second tier, checked before a promoted block becomes READY; generated when the file does not exist. "
            "Give every node that shares a tier the same key. Default: <tier_address>/seal.key for disk, else "
            "<dir>/<name>.tier.key (node-local: other nodes' blocks then fail their check)."),
    Setting("tier_timeout", "float", "0.5", "Seconds an existence check, remove or clear may take in the second tier "
            "before it counts as failed.", lo=0.01, hi=600),
    Setting("tier_data_timeout", "float", "10", "Seconds a batch of block transfers (demote or promote) may take "
            "before the daemon stops waiting for it (its pages stay fenced until the companion answers or is "
            "killed).", lo=0.05, hi=3600),
    Setting("tier_kill_after", "float", "10", "Seconds past tier_data_timeout after which a companion that still has "
            "not answered a transfer is killed (the proof that frees the transfer's pages) and restarted.",
            lo=0.05, hi=3600),
    Setting("tier_restart_backoff", "float", "5", "Seconds before a companion that died, was killed or could not "
            "reach its backend is started again.", lo=0, hi=3600),
    Setting("tier_max_inflight", "int", "64", "Requests to the second tier in flight at once; past it demotes wait "
            "(blocks evicted meanwhile are dropped and counted) and lookups check nothing.", lo=1, hi=4096),
    Setting("tier_failures", "int", "3", "Consecutive failures of the second tier that open its circuit breaker "
            "(calls then fail at once for tier_cooldown).", lo=1, hi=1000),
    Setting("tier_cooldown", "float", "5", "Seconds the second tier's breaker stays open, and the lookups after a "
            "failed existence check check nothing.", lo=0, hi=3600),
    Setting("tier_demote", "bool", "true", "Write blocks chosen for eviction to the second tier before their pages "
            "are reused."),
    Setting("tier_promote", "bool", "true", "Answer lookup misses from the second tier: the blocks it holds are "
            "fetched into the region and reported pending until they are READY."),
    Setting("tier_low_watermark", "float", "0.05", "Share of the region's pages kept free by demoting the eviction "
            "policy's first victims ahead of need (0: demote only what a store's room takes, which it cannot "
            "wait for: those blocks are dropped).", lo=0, hi=0.5),
    Setting("tier_exclude", "str", "", "Models (comma-separated, as a namespace's model field) whose blocks never "
            "go to nor come from the second tier."),
    # KV cache events (docs/events.md).
    Setting("events_log_bytes", "size", "64MiB", "Memory for the event log: per namespace that an engine (or the "
            "daemon's own KV events stream) follows, the keys that became READY and that left, for readers to "
            "catch up from; past it the oldest records go, and a reader that had not read them is resynced "
            "from a snapshot. Besides it, once a namespace is followed, a copy of the entries' keys: 65 bytes "
            "per page of the region (a thousandth of it at 64KiB pages).", lo=1 << 20, hi=1 << 40),
    Setting("kv_events_endpoint", "str", "", "ZMQ endpoint where the daemon publishes the node's KV cache events in "
            "vLLM's KVEventBatch format (e.g. tcp://*:5557, ipc:///run/kvtierd/events.pub), one topic per "
            "namespace, for routers that index per node; empty: off."),
    Setting("kv_events_replay_endpoint", "str", "", "ZMQ endpoint of the stream's replay socket (vLLM's replay "
            "protocol: a subscriber asks for the batches it missed); empty: none."),
    Setting("kv_events_topic", "str", "kv@{node}@{model}", "Topic of a namespace's batches: {node} is "
            "kv_events_node, {model} the namespace's model name (up to its first @), {namespace} its whole name."),
    Setting("kv_events_node", "str", socket.gethostname, "The node's name in the stream's topics (default: the "
            "host name)."),
    Setting("kv_events_hash", "choice", "int", "How the stream names a block: int (the hash's last 8 bytes as an "
            "integer, vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or bytes (the hash as it is).",
            choices=("int", "bytes")),
    Setting("kv_events_buffer_batches", "int", "10000", "Batches the stream keeps for replay requests.", lo=1,
            hi=1 << 20),
    Setting("kv_events_hwm", "int", "100000", "ZMQ high-water mark of the stream's PUB socket: batches queued per "
            "subscriber before ZMQ drops them (the subscriber sees the gap and asks the replay socket).", lo=1,
            hi=1 << 24),
    Setting("kv_events_flush_ms", "float", "5", "Milliseconds between the stream's batches while blocks change: "
            "what became READY and what left meanwhile goes out as one batch per namespace (fewer, larger batches "
            "cost the loop less per block; a block's event waits up to this long).", lo=0, hi=1000),
)

BY_NAME = {s.name: s for s in SETTINGS}


@dataclass
class Config:
    values: dict[str, Any]
    sources: dict[str, str]     # setting → "default" | "file:<path>" | "env:<VAR>" | "flag"

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; flags default to None so that unset ones do not override."""
    for s in SETTINGS:
        doc = f"{s.doc} Sizes take {SIZE_UNITS}." if s.type == "size" else s.doc
        kwargs: dict[str, Any] = {"dest": s.name, "default": None, "help": f"{doc} [env {s.env}]"}
        if s.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = s.type.upper() if not s.choices else "{" + ",".join(s.choices) + "}"
        parser.add_argument(s.flag, **kwargs)


def load(args: argparse.Namespace | None = None, config_file: str | None = None,
         environ: dict[str, str] | None = None) -> Config:
    """Effective config: defaults, then the TOML file, then KVTIERD_* variables, then flags."""
    environ = os.environ if environ is None else environ
    values = {s.name: s.default_value() for s in SETTINGS}
    sources = {s.name: "default" for s in SETTINGS}
    path = config_file or environ.get("KVTIERD_CONFIG")
    if path is None and os.path.exists(DEFAULT_CONFIG_FILE):
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {path} not found (--config / KVTIERD_CONFIG)") from None
        except OSError as exc:      # a directory, a file this user may not read
            raise ValueError(f"config file {path}: {exc.strerror} (--config / KVTIERD_CONFIG names a TOML "
                             "file)") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {path}: {exc}") from None
        table = table.get("kvtierd", table)
        unknown = sorted(set(table) - set(BY_NAME))
        if unknown:
            raise ValueError(f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(BY_NAME)}")
        for name, raw in table.items():
            values[name] = BY_NAME[name].parse(raw)
            sources[name] = f"file:{path}"
    for s in SETTINGS:
        if s.env in environ:
            values[s.name] = s.parse(environ[s.env])
            sources[s.name] = f"env:{s.env}"
    if args is not None:
        for s in SETTINGS:
            raw = getattr(args, s.name, None)
            if raw is not None:
                values[s.name] = s.parse(raw)
                sources[s.name] = "flag"
    return Config(values, sources)


# ------------------------------------------------------------------ rendering the table
def _shown_default(s: Setting) -> str:
    if callable(s.default):
        return "(computed, see description)"
    return str(s.default)


def markdown() -> str:
    """docs/configuration.md, generated from the table (``make docs`` rewrites the file)."""
    lines = [
        "# Configuration",
        "",
        "<!-- generated from kvtierd/config.py by `make docs`; do not edit by hand -->",
        "",
        "Every setting can be given, from lowest to highest precedence, as its built-in default, in the",
        f"TOML file (`--config FILE`, `KVTIERD_CONFIG`, or `{DEFAULT_CONFIG_FILE}` when it exists; keys",
        "at top level or under a `[kvtierd]` table), as an environment variable, or as a flag.",
        "`kvtierd --print-config` shows the effective value of each and where it came from.",
        f"Sizes take {SIZE_UNITS}; durations are seconds.",
        "",
        "| setting | flag | environment | type | default | bounds | description |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        bounds = " ".join(filter(None, [
            f"≥ {s.describe_bound(s.lo)}" if s.lo is not None else "",
            f"≤ {s.describe_bound(s.hi)}" if s.hi is not None else "",
            " \\| ".join(s.choices)]))
        lines.append(f"| `{s.name}` | `{s.flag}` | `{s.env}` | {s.type} | `{_shown_default(s)}` | {bounds or '-'} "
                     f"| {s.doc} |")
    return "\n".join(lines) + "\n"


# What the shipped deployment (deploy/systemd: user kvtierd, group kvtier) needs, set in the example
# config rather than commented out: the unit sets no KVTIERD_* variable, which would override the file.
DEPLOYED = {"dir": "/dev/shm/kvtierd", "group": "kvtier"}


def example_toml() -> str:
    """deploy/kvtierd.example.toml, generated from the table (``make docs``)."""
    lines = ["# kvtierd configuration (TOML). Generated from kvtierd/config.py by `make docs`.",
             f"# Install as {DEFAULT_CONFIG_FILE}. Every key is optional; shown commented out are the defaults,",
             "# set are the values the systemd unit and deploy/systemd/kvtierd.sysusers.conf go with.", ""]
    for s in SETTINGS:
        lines.append(f"# {s.doc}")
        if s.name in DEPLOYED:
            lines.append(f"{s.name} = \"{DEPLOYED[s.name]}\"")
        elif callable(s.default):
            lines.append(f"# {s.name} = \"{s.default()}\"")
        elif s.type in ("int", "float", "bool"):
            lines.append(f"# {s.name} = {s.default}")
        else:
            lines.append(f"# {s.name} = \"{s.default}\"")
        lines.append("")
    return "\n".join(lines)


def describe(cfg: Config) -> str:
    """The effective settings and where each came from (``kvtierd --print-config``)."""
    width = max(len(s.name) for s in SETTINGS)
    out = []
    for s in SETTINGS:
        value = cfg.values[s.name]
        shown = format_size(value) if s.type == "size" else value
        out.append(f"{s.name:<{width}} = {shown!s:<28} # {cfg.sources[s.name]}")
    return "\n".join(out)
