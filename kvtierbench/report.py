"""The bench's results as text: a table per section (``COLUMNS``), notes, and the targets."""

from __future__ import annotations

from typing import Any

from .harness import MiB

COLUMNS: dict[str, list[tuple[str, str, str]]] = {   # section → (header, row key, format)
    "control": [("op", "op", "{}"), ("B", "keys", "{}"), ("C", "clients", "{}"),
                ("p50 us", "kvtierd_p50_us", "{:.1f}"), ("p99 us", "kvtierd_p99_us", "{:.1f}"),
                ("keys/s", "kvtierd_keys_per_s", "{:,.0f}"), ("echo p50", "echo_p50_us", "{:.1f}"),
                ("echo p99", "echo_p99_us", "{:.1f}"), ("echo keys/s", "echo_keys_per_s", "{:,.0f}"),
                ("p50 x", "p50_ratio", "{:.2f}"), ("keys/s x", "throughput_ratio", "{:.2f}")],
    "data": [("blocks", "blocks", "{}"), ("block MiB", "block_bytes", "MiB"), ("store GB/s", "store_gbps", "{:.2f}"),
             ("load GB/s", "load_gbps", "{:.2f}"), ("store+load", "store_load_gbps", "{:.2f}"),
             ("memcpy", "memcpy_gbps", "{:.2f}"), ("x memcpy", "ratio", "{:.2f}")],
    "capacity": [("TP", "tp", "{}"), ("layout", "kind", "{}"), ("blocks held", "blocks_held", "{}"),
                 ("D2H B/block", "d2h_bytes_per_block", "{:,.0f}"), ("x block", "d2h_per_block_vs_block", "{:.2f}"),
                 ("H2D B/rank/block", "h2d_bytes_per_rank_per_block", "{:,.0f}"),
                 ("held x sharded", "capacity_vs_sharded", "{:.2f}")],
    "eviction": [("B", "keys_per_job", "{}"), ("entries", "entries", "{:,}"),
                 ("stores/s full", "full_stores_per_s", "{:,.0f}"), ("stores/s room", "room_stores_per_s", "{:,.0f}"),
                 ("evictions/store", "evictions_per_store", "{:.2f}"), ("job p50 us", "job_p50_us", "{:,.0f}"),
                 ("job p99 us", "job_p99_us", "{:,.0f}"), ("job max us", "job_max_us", "{:,.0f}"),
                 ("room p99 us", "room_job_p99_us", "{:,.0f}"), ("p99 x room", "p99_vs_room", "{:.2f}"),
                 ("daemon max us <=", "daemon_max_us", "{:,.0f}"), ("gc full", "gc_full_collections", "{}"), ("gc pause max us", "gc_pause_max_us", "{:,.0f}"),
                 ("x room", "ratio", "{:.2f}")],
    "recovery": [("entries", "recovered", "{:,}"), ("restart s", "restart_s", "{:.2f}"),
                 ("daemon s", "daemon_started_in_s", "{:.2f}"), ("Store() s", "store_recovery_s", "{:.2f}"),
                 ("scan s", "scan_s", "{:.2f}"), ("fresh start s", "fresh_start_s", "{:.2f}"),
                 ("interpreter s", "interpreter_s", "{:.2f}")],
    "restart": [("restart", "restart", "{}"), ("engines", "engines", "{}"), ("rounds", "rounds", "{}"),
                ("down s", "down_s", "{:.2f}"), ("links up ms", "links_ms", "{:.1f}"),
                ("ranks attached ms", "ranks_ms", "{:.1f}"), ("worst ms", "worst_ms", "{:.1f}"),
                ("fresh client ms", "fresh_attach_ms", "{:.1f}")],
    "redis": [("blocks", "blocks", "{}"), ("block MiB", "block_bytes", "MiB"),
              ("kvtierd blocks/s", "kvtierd_blocks_per_s", "{:,.0f}"),
              ("redis blocks/s", "redis_blocks_per_s", "{:,.0f}"),
              ("kvt store", "kvtierd_store_blocks_per_s", "{:,.0f}"),
              ("redis store", "redis_store_blocks_per_s", "{:,.0f}"),
              ("kvt load", "kvtierd_load_blocks_per_s", "{:,.0f}"),
              ("redis load", "redis_load_blocks_per_s", "{:,.0f}"),
              ("x redis", "ratio", "{:.1f}"), ("x MSET/MGET", "ratio_vs_mset_mget", "{:.1f}")],
    "attach": [("pages", "pages", "{}"), ("populate", "populate", "{}"), ("daemon", "daemon_hugepages", "{}"),
               ("client huge MiB", "client_huge_bytes", "MiB"),
               ("attach+populate s/GiB", "attach_populate_s_per_gib", "{:.4f}"), ("cold ms", "cold_ms", "{:.2f}"),
               ("warm ms", "warm_ms", "{:.2f}"), ("cold x warm", "cold_vs_warm", "{:.2f}")],
    "policy": [("trace", "trace", "{}"), ("capacity", "capacity", "{:g}"), ("blocks", "blocks", "{:,}"),
               ("policy", "policy", "{}"), ("hit rate", "hit_rate", "{:.3f}"), ("Belady", "belady", "{:.3f}"),
               ("x Belady", "x_belady", "{:.2f}"), ("x LRU", "x_lru", "{:.2f}"), ("refused", "refused", "{:,}"),
               ("CPU ns/ref", "cpu_ns_per_ref", "{:,.0f}"), ("CPU x LRU", "cpu_x_lru", "{:.2f}")],
    "nodes": [("trace", "trace", "{}"), ("capacity", "capacity", "{:g}"), ("blocks", "blocks", "{:,}"),
              ("setup", "setup", "{}"), ("pressure on B", "pressure", "{:g}"), ("hit rate", "hit_rate", "{:.3f}"),
              ("x one node", "x_one_node", "{:.3f}"), ("A's hits missing on B", "missing_on_b", "{:.4f}")],
    "tier": [("engine", "engine", "{}"), ("blocks", "blocks", "{}"), ("block KiB", "block_bytes", "KiB"),
             ("raw put GB/s", "raw_put_gbps", "{:.2f}"), ("demote GB/s", "demote_gbps", "{:.2f}"),
             ("x raw put", "demote_vs_raw_put", "{:.2f}"), ("raw get GB/s", "raw_get_gbps", "{:.2f}"),
             ("promote GB/s", "promote_gbps", "{:.2f}"), ("x raw get", "promote_vs_raw_get", "{:.2f}")],
    "events": [("B", "keys", "{}"), ("append ns/key", "append_ns_per_key", "{:,.0f}"),
               ("publish ns/key", "publish_ns_per_key", "{:,.0f}"), ("msgpack ns/key", "naive_encode_ns_per_key", "{:,.0f}"),
               ("publish x msgpack", "publish_vs_naive", "{:.2f}")],
    # A section's further tables (its "more" map): "<section> <table>".
    "tier lookup": [("engine", "engine", "{}"), ("keys", "keys", "{}"), ("miss p50 us", "miss_p50_us", "{:.0f}"),
                    ("local p50 us", "local_p50_us", "{:.0f}"), ("miss x local", "miss_vs_local", "{:.2f}"),
                    ("miss p99 us", "miss_p99_us", "{:.0f}"), ("local p99 us", "local_p99_us", "{:.0f}"),
                    ("tier answered p50 us", "answered_p50_us", "{:.0f}")],
    "events latency": [("B", "keys", "{}"), ("batches", "batches", "{}"), ("p50 us", "p50_us", "{:,.0f}"),
                       ("p99 us", "p99_us", "{:,.0f}")],
    "events sustained": [("offered/s", "offered_per_s", "{:,.0f}"), ("published/s", "published_per_s", "{:,.0f}"),
                         ("received/s", "received_per_s", "{:,.0f}"), ("RSS 1/3 KiB", "rss_third_kib", "{:,}"),
                         ("RSS end KiB", "rss_end_kib", "{:,}"), ("log bytes", "log_bytes", "{:,}")],
    "events daemon throughput": [("B", "keys", "{}"), ("keys/s publishing (median slice)", "on_keys_per_s", "{:,.0f}"),
                                 ("keys/s not", "off_keys_per_s", "{:,.0f}"),
                                 ("on / off (median of the sets')", "on_vs_off", "{:.3f}"),
                                 ("each set's on / off", "trials", "{}"),
                                 ("daemon CPU µs/job publishing", "on_cpu_us_per_job", "{:,.0f}"),
                                 ("not", "off_cpu_us_per_job", "{:,.0f}"), ("CPU on / off", "cpu_on_vs_off", "{:.3f}")],
    "events daemon latency": [("B", "keys", "{}"), ("jobs", "batches", "{}"), ("commit -> SUB p50 us", "p50_us",
                                                                              "{:,.0f}"),
                              ("p99 us", "p99_us", "{:,.0f}")],
    "events daemon sustained": [("offered/s", "offered_per_s", "{:,.0f}"), ("stored/s", "stored_per_s", "{:,.0f}"),
                                ("RssAnon 1/3 KiB", "rss_anon_third_kib", "{:,}"),
                                ("RssAnon end KiB", "rss_anon_end_kib", "{:,}"), ("log bytes", "log_bytes", "{:,}"),
                                ("events published", "published_events", "{:,}")],
    "tier disk lookup": [("blocks", "blocks", "{}"), ("block KiB", "block_bytes", "KiB"),
                         ("N keys on disk us", "lookup_pending_us", "{:.0f}"), ("N keys local us", "lookup_local_us",
                                                                               "{:.0f}"),
                         ("x local", "lookup_pending_vs_local", "{:.2f}"),
                         ("1 key on disk p50 us", "lookup1_pending_p50_us", "{:.0f}"),
                         ("1 key local p50 us", "lookup1_local_p50_us", "{:.0f}"),
                         ("x local", "lookup1_pending_vs_local", "{:.2f}")],
    "tier disk restart": [("blocks on disk", "blocks", "{:,}"), ("daemon serving s", "daemon_serving_s", "{:.2f}"),
                          ("companion ready s", "companion_ready_s", "{:.2f}"),
                          ("first disk block READY s", "first_block_ready_s", "{:.2f}"),
                          ("index load s", "companion_load_s", "{:.2f}")],
    "eviction memory": [("entries", "entries", "{:,}"), ("RSS growth MiB", "rss_growth", "MiB"),
                        ("RSS B/entry", "rss_per_entry", "{:.0f}"), ("heap B/entry", "anon_per_entry", "{:.0f}")],
    "policy cost": [("op", "op", "{}"), ("B", "keys", "{}"), ("policy", "policy", "{}"),
                    ("CPU ns/key", "cpu_ns_per_key", "{:,.0f}"), ("x LRU", "x_lru", "{:.2f}")],
}


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "MiB":
        return f"{value / MiB:g}"
    if fmt == "KiB":
        return f"{value / 1024:g}"
    return fmt.format(value)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    cells = [[cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, (h, _, _) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return lines


def format_results(result: dict) -> str:
    m = result["machine"]
    lines = [f"kvtierctl bench{' --quick' if result['quick'] else ''}: {m.get('cpu', '?')}, {m['cpus']} CPUs, "
             f"{m.get('mem_total', 0) / (1 << 30):.1f} GiB, Python {m['python']}, load average "
             f"{m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}, {result['seconds']:.1f} s"]
    targets = []
    for name, section in result["sections"].items():
        lines += ["", f"== {name}"]
        if "skipped" in section:
            lines.append(f"skipped: {section['skipped']}")
            continue
        lines += table(section["rows"], COLUMNS[name])
        for title, rows in section.get("more", {}).items():
            if rows:
                lines += ["", f"== {name}: {title}", *table(rows, COLUMNS[f"{name} {title}"])]
        lines += [f"note: {n}" for n in section["notes"]]
        targets += section["targets"]
    if targets:
        lines += ["", "== targets"]
        for t in targets:
            lines.append(f"{'MET   ' if t['met'] else 'MISSED'} {t['name']}: {t['value']:,.3g} (goal {t['goal']})")
    return "\n".join(lines)
