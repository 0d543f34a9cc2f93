"""Entry points: ``kvtierd`` (the daemon) and ``kvtierctl`` (talks to a running daemon).

Fetching and formatting are kept apart: each ctl command fetches a dict over the protocol, then
prints it either as a human table or, with ``--json``, as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from . import __version__, config
from .contract.paths import DaemonPaths, access_problem
from .contract.replies import StatsReply


# ------------------------------------------------------------------ kvtierd
def daemon_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtierd",
        description="Run the kvtierd shared KV-cache tier in the foreground. With no settings it creates a "
                    "512 MiB region in /dev/shm/kvtierd (or $XDG_RUNTIME_DIR/kvtierd) and prints its socket "
                    "path and geometry. Settings come from flags, KVTIERD_* variables and a TOML file.",
    )
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML config file (default {config.DEFAULT_CONFIG_FILE} when it exists) "
                             "[env KVTIERD_CONFIG]")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective settings and where each came from, then exit")
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    config.add_flags(parser)
    return parser


def daemon_main(argv: list[str] | None = None) -> int:
    args = daemon_parser().parse_args(argv)
    try:
        cfg = config.load(args, args.config)
    except ValueError as exc:
        print(f"kvtierd: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.describe(cfg))
        return 0
    from .daemon import run
    return run(cfg)


# ------------------------------------------------------------------ kvtierctl
# Each command: (help, add_arguments, fetch(args) -> data, format(data, args) -> str, exit code(data)).
# Live commands talk the protocol (the admin socket for admin ones); status, namespaces, entries,
# inspect and check read the region's files, so they also work when the daemon is down.


def daemon_paths(args: argparse.Namespace, environ: dict[str, str] | None = None) -> DaemonPaths:
    """The files of the daemon the command line points at: one way for every command.

    ``--socket`` (or ``$KVTIERD_SOCKET``) names the daemon by its client socket, <dir>/<name>.sock;
    else ``--dir``/``--name`` do; what they leave unset comes from the daemon's own settings, read as
    the daemon reads them: its config file (``--config``, ``$KVTIERD_CONFIG``, or
    /etc/kvtierd/kvtierd.toml when it exists), then ``$KVTIERD_DIR``/``$KVTIERD_NAME``. Flags beat
    the environment: ``--dir``, ``--name`` or ``--config`` set ``$KVTIERD_SOCKET`` aside."""
    environ = os.environ if environ is None else environ
    if args.socket:
        return DaemonPaths.of_socket(args.socket)
    if environ.get("KVTIERD_SOCKET") and not (args.dir or args.name or args.config):
        return DaemonPaths.of_socket(environ["KVTIERD_SOCKET"])
    # The settings of the daemon's that name its files, from its file and environment alone (other
    # KVTIERD_* variables are no business of kvtierctl's).
    env = {var: environ[var] for var in ("KVTIERD_DIR", "KVTIERD_NAME") if var in environ}
    cfg = config.load(None, args.config or environ.get("KVTIERD_CONFIG"), environ=env)
    return DaemonPaths(args.dir or cfg.dir, args.name or cfg.name)


def _paths(args: argparse.Namespace) -> tuple[str, str, DaemonPaths, str]:
    """(socket, admin socket, the region's paths, lock) of the daemon the flags/env point at."""
    paths = daemon_paths(args)
    return paths.socket, paths.admin_socket, paths, paths.lock


def _call(path: str, timeout: float, op: str, **fields: Any) -> dict[str, Any]:
    from .contract.channel import Channel
    channel = Channel(path, timeout)
    try:
        reply = channel.call(op, **fields)
    finally:
        channel.close()
    for meta in ("rid", "ok"):
        reply.pop(meta, None)
    return reply


def daemon_running(lock_path: str) -> bool:
    """True while a daemon holds the region's lock (it holds it for its whole life)."""
    import fcntl
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except PermissionError:
        raise SystemExit(f"kvtierctl: {access_problem(lock_path) or f'permission denied: {lock_path}'}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _human_bytes(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _pairs(data: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    rows: list[tuple[str, str]] = []
    for key, value in data.items():
        if key in skip:
            continue
        if isinstance(value, dict):
            text = ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
        elif isinstance(value, int) and not isinstance(value, bool) and (
                key.endswith("_bytes") or key.startswith("bytes_")):
            text = f"{value} ({_human_bytes(value)})"
        elif isinstance(value, float):
            text = f"{value:.6g}"       # 0.05 stays 0.05 (a fixed one decimal showed 0.1)
        else:
            text = "-" if value is None else str(value)
        rows.append((key, text))
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


# --- fetchers -----------------------------------------------------------------------------------
# The fields of replies.StatsReply that `kvtierctl status` shows of a running daemon.
STATUS_FIELDS = ("daemon_pid", "socket", "admin_socket", "metrics_address", "region", "generation", "pinned",
                 "hugepages", "huge_page_size", "huge_bytes", "file_bytes", "capacity_bytes", "used_bytes",
                 "pages_total", "pages_free", "pages_fenced", "entries_ready", "entries_writing", "entries_pinned",
                 "namespaces", "engines", "sessions", "open_jobs",
                 "uptime_seconds", "stopping")


def _stats(socket: str, timeout: float) -> StatsReply:
    return StatsReply.from_wire(_call(socket, timeout, "stats"))


def fetch_stats(args: argparse.Namespace) -> dict:
    return _stats(_paths(args)[0], args.timeout).to_wire()


# What `kvtierctl status` shows of the second tier (replies.StatsReply.tier; all of it: stats).
TIER_STATUS_FIELDS = ("backend", "address", "state", "pid", "last_error", "breaker", "inflight", "restarts",
                      "demoted_blocks", "demoting_blocks", "demote_dropped_blocks", "promoted_blocks",
                      "promoting_blocks", "promote_failed_blocks", "seal_rejected_blocks", "lookup_keys")
# What it shows of the disk tier's own state (the companion's latest stats), as disk_<name>.
DISK_STATUS_FIELDS = ("direct", "writable", "blocks", "used_bytes", "capacity_bytes", "errors")


def tier_status(tier: dict) -> dict:
    """The second tier's line of ``kvtierctl status``: its state, errors summed, the main counters."""
    if tier.get("backend", "off") == "off":
        return {"backend": "off"}
    out = {name: tier[name] for name in TIER_STATUS_FIELDS if name in tier}
    out["errors"] = sum(e["calls"] for e in tier.get("errors", []))
    engine = tier.get("engine", {})
    out["seal_key_id"] = engine.get("seal_key_id")
    if engine.get("engine") == "disk":
        out.update({f"disk_{name}": engine[name] for name in DISK_STATUS_FIELDS if name in engine})
    return {k: " ".join(f"{a}:{b}" for a, b in sorted(v.items())) if isinstance(v, dict) else v
            for k, v in out.items()}


def fetch_status(args: argparse.Namespace) -> dict:
    socket, _, region, lock = _paths(args)
    if daemon_running(lock):
        s = _stats(socket, args.timeout)
        return {"daemon": "running", **{name: getattr(s, name) for name in STATUS_FIELDS},
                "tier": tier_status(s.tier)}
    return {"daemon": "not running", **_read_region(region, lambda off, view: off.status(view, region))}


def _read_region(paths: DaemonPaths, fn):
    """``fn(offline, view)`` on a read-only view of the region's files; a file this user may not
    read is explained (the metadata file is the daemon user's alone), not shown as a raw EACCES."""
    from . import offline
    try:
        with offline.open_region(paths) as view:
            return fn(offline, view)
    except PermissionError:
        problem = access_problem(paths.meta) or access_problem(paths.region)
        if problem is None:
            raise
        raise SystemExit(f"kvtierctl: {problem}. Commands that read the region's files (status with the daemon "
                         "down, namespaces, entries, inspect, check) need to; stats talks to a running daemon "
                         "instead") from None


def _offline(fn):
    def fetch(args: argparse.Namespace):
        return _read_region(_paths(args)[2], lambda off, view: fn(off, view, args))
    return fetch


def _key(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise SystemExit(f"kvtierctl: key {text!r} is not hex (e.g. the key column of kvtierctl entries)") from None


fetch_namespaces = _offline(lambda off, view, args: off.namespaces(view))
fetch_entries = _offline(lambda off, view, args: off.entries(view, args.namespace, args.sort, args.limit))


def _page(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"kvtierctl: page {text!r} is not a page number (0 .. pages_total - 1, "
                         "as kvtierctl status shows)") from None


def fetch_inspect(args: argparse.Namespace) -> dict:
    # The value is checked before the region is read: a typo is a usage error wherever the files are.
    if args.what == "key":
        key = _key(args.value)
        return _offline(lambda off, view, a: {"entries": off.inspect_key(view, key)})(args)
    page = _page(args.value)
    return _offline(lambda off, view, a: off.inspect_page(view, page))(args)


fetch_check = _offline(lambda off, view, args: off.check(view, daemon_running(_paths(args)[3]), args.checksums))


def fetch_clients(args: argparse.Namespace) -> dict:
    return _call(_paths(args)[1], args.timeout, "clients")


def fetch_evict(args: argparse.Namespace) -> dict:
    return _call(_paths(args)[1], args.timeout, "evict", namespace=args.namespace, count=args.count)


def fetch_clear(args: argparse.Namespace) -> dict:
    if args.namespace is None and not args.all:
        raise SystemExit("kvtierctl: clear needs --namespace NAME, or --all to clear every namespace")
    return _call(_paths(args)[1], args.timeout, "clear", namespace=args.namespace, force=args.force)


def format_eviction(data: dict, args: argparse.Namespace) -> str:
    text = f"evicted {data['evicted']} entries"
    if data["revoked_leases"]:
        text += f"; revoked {data['revoked_leases']} leases first (their loads come back short)"
    if data["skipped_leased"]:
        text += (f"; skipped {data['skipped_leased']} leased entries (engines looked them up and will load them; "
                 "they stay until loaded, released or expired: clear --force revokes the leases)")
    return text + ("; pinned and in-flight ones stay" if args.command == "clear" else "") + _tier_said(data)


# --- formatters ---------------------------------------------------------------------------------
def _hit_rate(hits: int, misses: int) -> str:
    return f"{hits / (hits + misses):.3f} of {hits + misses} keys" if hits + misses else "-"


def format_stats(data: dict, args: argparse.Namespace) -> str:
    # The hit rates (what the eviction policy is for) beside the counters they come from.
    rows: dict[str, Any] = {}
    for key, value in data.items():
        rows[key] = value
        if key in ("lookup_miss_keys", "load_miss_keys"):
            op = key.split("_")[0]
            rows[f"{op}_hit_rate"] = _hit_rate(data[f"{op}_hit_keys"], value)
    text = _pairs(rows, skip=("namespace_list", "latency", "vote_wait", "tier"))
    if data.get("tier", {}).get("backend", "off") != "off":
        tier = {k: v for k, v in data["tier"].items() if k not in ("call_seconds", "errors", "engine")}
        errors = {f"{e['op']}/{e['code']}": e["calls"] for e in data["tier"].get("errors", [])}
        text += "\n\nsecond tier:\n" + _pairs({**tier, "errors": errors, **{f"engine_{k}": v for k, v in
                                                                          data["tier"].get("engine", {}).items()}})
    if data.get("namespace_list"):
        text += "\n\n" + _table(data["namespace_list"], ["slot", "entries", "entry_pages", "name"])
    return text


def format_inspect(data: dict, args: argparse.Namespace) -> str:
    if "entries" in data:
        if not data["entries"]:
            return "no READY entry holds this key"
        return "\n\n".join(_pairs(e) for e in data["entries"])
    owner = data.get("owner")
    text = _pairs({k: v for k, v in data.items() if k != "owner"})
    return text + ("\nowner   free (no sound entry holds this page)" if owner is None else "\n\nowner:\n" + _pairs(owner))


def format_check(data: dict, args: argparse.Namespace) -> str:
    lines = [f"{'OK' if data['ok'] else 'DAMAGED'}: {data['entries_sound']} sound entries holding "
             f"{data['pages_held']} of {data['pages_total']} pages; {data['entries_writing']} being written"
             + (" (in flight)" if data["daemon_running"] else " (unfinished: a restart discards them)")]
    lines += data["header_problems"]
    for ns in data["damaged_namespaces"]:
        lines.append(f"namespace slot {ns['slot']}: {ns['reason']}")
    for p in data["problems"]:
        lines.append(f"entry {p['slot']}: {p['reason']}")
    return "\n".join(lines)


TIER_SAID = {"off": "", "local": "; the second tier keeps its copies (evict is local; clear removes them)",
             "excluded": "; the namespace does not use the second tier (tier_exclude)",
             "failed": "; the second tier could not be cleared (kvtierctl status shows its state): run clear again"}


def _tier_said(reply: dict) -> str:
    """What an evict or clear did to the second tier, in words."""
    if reply.get("tier") == "removed":
        return f"; {reply['tier_removed']} blocks removed from the second tier"
    return TIER_SAID.get(reply.get("tier", "off"), "")


COMMANDS: dict[str, tuple] = {
    "status": ("the daemon's state (live, with its second tier), or the region's files' (daemon down)", None,
               fetch_status,
               lambda d, a: _pairs(d), None),
    "stats": ("all counters and occupancy of a running daemon", None, fetch_stats, format_stats, None),
    "namespaces": ("namespaces recorded in the region, with their entry counts", None, fetch_namespaces,
                   lambda d, a: _table(d, ["slot", "entries", "entry_pages", "name"]), None),
    "entries": ("list entries (reads the region's metadata file)",
                lambda p: (p.add_argument("--namespace", help="only this namespace (as kvtierctl namespaces names it)"),
                           p.add_argument("--sort", choices=("age", "size"), default="age",
                                          help="age: least recently used first; size: largest first"),
                           p.add_argument("--limit", type=_count, help="at most this many rows (0 or more)")),
                fetch_entries,
                lambda d, a: _table(d, ["slot", "state", "length", "page_count", "last_access_tick", "key",
                                        "namespace"]), None),
    "inspect": ("show the entry of a KEY (hex) or what holds a PAGE",
                lambda p: (p.add_argument("what", choices=("key", "page")), p.add_argument("value")),
                fetch_inspect, format_inspect, None),
    "check": ("consistency of the entry table and page chains (offline; exit 1 when damaged)",
              lambda p: p.add_argument("--checksums", action="store_true",
                                       help="also rehash every entry that carries a checksum (reads its bytes)"),
              fetch_check, format_check, lambda d: 0 if d["ok"] else 1),
    "clients": ("attached sessions (admin socket)", None, fetch_clients,
                lambda d, a: _table(d["clients"], ["session", "engine", "role", "pid", "world_size", "watched",
                                                   "leases", "leased_keys", "namespace"]), None),
    "evict": ("evict entries, the eviction policy's first victims first; leased, pinned and in-flight ones stay "
              "(admin socket; the second tier keeps its copies)",
              lambda p: (p.add_argument("--count", type=_count, required=True, help="how many entries (0 or more)"),
                         p.add_argument("--namespace", help="only from this namespace")),
              fetch_evict, format_eviction, None),
    "clear": ("evict every evictable entry of a namespace, or of all, and remove its blocks from the second tier; "
              "leased, pinned and in-flight ones stay (admin socket)",
              lambda p: (p.add_argument("--namespace", help="the namespace to clear"),
                         p.add_argument("--all", action="store_true", help="clear every namespace"),
                         p.add_argument("--force", action="store_true",
                                        help="revoke the leases in it first, so that leased entries go too (loads "
                                             "that counted on them come back short and are recomputed)")),
              fetch_clear, format_eviction, None),
    "bench": ("benchmark kvtierd against this machine's floors and Redis, each figure a ratio measured in the "
              "same run (starts its own daemons; docs/benchmarks.md)",
              lambda p: _bench().add_arguments(p), lambda a: _bench().fetch(a),
              lambda d, a: _bench().report.format_results(d), None),
}


def _count(text: str) -> int:
    """A count on the command line: a whole number, 0 or more (a negative one used to slice rows off
    the end: entries --limit -1 dropped the last entry)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    return value


def _json(data: Any) -> str:
    """JSON for scripts: a histogram's +Inf bound (and any other non-finite float) as the string
    Prometheus writes it, since JSON has no Infinity (strict parsers, Node's among them, reject it)."""
    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value
    return json.dumps(finite(data), indent=2, sort_keys=True, allow_nan=False)


def _bench():
    import kvtierbench  # the bench's dependencies (torch, redis) only when benchmarking
    return kvtierbench


def ctl_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtierctl",
        description="Inspect and manage a kvtierd. status, namespaces, entries, inspect and check read the region's "
                    "files and work with the daemon down; stats, clients, evict and clear talk to the daemon "
                    "(clients, evict and clear on its admin socket, which only the daemon's user can open); bench "
                    "starts daemons of its own. Every command finds the daemon the same way: --socket names it by "
                    "its client socket; else --dir and --name; else the daemon's config file (--config) and "
                    "KVTIERD_* variables, read as the daemon reads them.")
    parser.add_argument("--socket", help="the daemon's client socket <dir>/<name>.sock: names the daemon for every "
                                         "command [env KVTIERD_SOCKET]")
    parser.add_argument("--dir", help="the daemon's directory [env KVTIERD_DIR; else its config file's; default as "
                                      "kvtierd's]")
    parser.add_argument("--name", help="the daemon's name [env KVTIERD_NAME; else its config file's; default kvtierd]")
    parser.add_argument("--config", metavar="FILE", help=f"the daemon's TOML config file, for its dir and name "
                                                         f"[env KVTIERD_CONFIG; default {config.DEFAULT_CONFIG_FILE} "
                                                         "when it exists]")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    parser.add_argument("--version", action="version", version=f"kvtierctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, *_rest) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if add_args:
            add_args(p)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def ctl_main(argv: list[str] | None = None) -> int:
    args = ctl_parser().parse_args(argv)
    _, _, fetch, fmt, exit_code = COMMANDS[args.command]
    from .contract.errors import KvtierError
    from .contract.region_format import FormatError
    try:
        data = fetch(args)
    except KvtierError as exc:
        print(f"kvtierctl: {exc}", file=sys.stderr)
        return 1
    except (OSError, FormatError, ValueError) as exc:
        print(f"kvtierctl: {exc}", file=sys.stderr)
        return 1
    try:
        print(_json(data) if args.json else fmt(data, args))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (kvtierctl status | head -1): stop quietly, as a shell tool does. The
        # interpreter's last flush at exit would fail again, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141      # 128 + SIGPIPE, what a shell reports for a writer whose reader left
    return exit_code(data) if exit_code else 0
