"""Entry points: ``kvtierd`` (the daemon) and ``kvtierctl`` (talks to a running daemon).

Fetching and formatting are kept apart: each ctl command fetches a dict over the protocol, then
prints it either as a human table or, with ``--json``, as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from . import __version__, config


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
def _socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return args.socket
    directory = args.dir or os.environ.get("KVTIERD_DIR") or config.default_directory()
    name = args.name or os.environ.get("KVTIERD_NAME") or "kvtierd"
    return os.path.join(directory, f"{name}.sock")


def fetch_stats(socket_path: str, timeout: float) -> dict[str, Any]:
    from kvtier.session import Channel
    channel = Channel(socket_path, timeout)
    try:
        reply = channel.call("stats")
    finally:
        channel.close()
    for meta in ("rid", "ok"):
        reply.pop(meta, None)
    return reply


def _human_bytes(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_stats(stats: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    for key, value in stats.items():
        if key == "namespace_list":
            continue
        if isinstance(value, dict):
            text = ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
        elif key.endswith("_bytes") or key in ("bytes_written", "bytes_saved_dedup"):
            text = f"{value} ({_human_bytes(int(value))})"
        elif isinstance(value, float):
            text = f"{value:.1f}"
        else:
            text = str(value)
        rows.append((key, text))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    namespaces = stats.get("namespace_list") or []
    if namespaces:
        lines.append("")
        lines.append(f"{'slot':>4}  {'entries':>8}  {'pages/entry':>11}  namespace")
        for ns in namespaces:
            lines.append(f"{ns['slot']:>4}  {ns['entries']:>8}  {ns['entry_pages']:>11}  {ns['name']}")
    return "\n".join(lines)


COMMANDS: dict[str, tuple[str, Callable[[str, float], dict], Callable[[dict], str]]] = {
    "stats": ("counters and occupancy of a running daemon", fetch_stats, format_stats),
}


def ctl_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtierctl", description="Inspect a running kvtierd.")
    parser.add_argument("--socket", help="daemon socket (default: <dir>/<name>.sock of a default daemon) "
                                         "[env KVTIERD_SOCKET]", default=os.environ.get("KVTIERD_SOCKET"))
    parser.add_argument("--dir", help="daemon directory, to find its socket [env KVTIERD_DIR]")
    parser.add_argument("--name", help="daemon name, to find its socket [env KVTIERD_NAME]")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    parser.add_argument("--version", action="version", version=f"kvtierctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, _, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def ctl_main(argv: list[str] | None = None) -> int:
    args = ctl_parser().parse_args(argv)
    _, fetch, fmt = COMMANDS[args.command]
    from kvtier.errors import KvtierError
    try:
        data = fetch(_socket_path(args), args.timeout)
    except KvtierError as exc:
        print(f"kvtierctl: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else fmt(data))
    return 0
