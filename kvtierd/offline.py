"""Reading a region without the daemon: status, namespaces, entries, inspect, check.

The files are mapped read-only, so these work whether or not a daemon runs on them (while one
does, the tables may change under the reader; every answer is a snapshot). The metadata file
holds what they read; the data file is mapped too when it is there and whole (``inspect page``
shows bytes of a page, ``check --checksums`` rehashes entries). Every function returns plain
data; ``kvtierd.cli`` formats it. The judging of records is ``recovery.scan``, the same code a
restarting daemon uses, so ``check`` reports exactly what a restart would discard.
"""

from __future__ import annotations

import mmap
import os
from contextlib import ExitStack, contextmanager
from typing import Iterator

import numpy as np

from .contract.paths import DaemonPaths
from .contract.region_format import EntryState, FormatError
from .contract.region_view import RegionView
from .recovery import scan


def _map(path: str, what: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise FormatError(f"{what} {path} is empty")
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


@contextmanager
def open_region(paths: DaemonPaths) -> Iterator[RegionView]:
    """A read-only view of the region at ``paths`` (raises FormatError, OSError); its ``data`` is
    None when the data file is missing or shorter than the metadata says."""
    with ExitStack() as stack:
        meta = _map(paths.meta, "metadata file")
        stack.callback(_close, meta)
        view = RegionView(meta)
        try:
            data = _map(paths.region, "region file")
        except (OSError, FormatError):
            data = None
        if data is not None:
            stack.callback(_close, data)
            if len(data) >= view.geometry.data_bytes:
                view.attach_data(data)
        try:
            yield view
        finally:
            view.data = view.data_file = None
            del view


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:   # a caller still holds a NumPy view; the mapping dies with it
        pass


def status(view: RegionView, paths: DaemonPaths) -> dict:
    h, geo = view.header, view.geometry
    found = scan(view)
    return {
        "region": paths.region,
        "metadata": paths.meta,
        "format_version": int(h["version"]),
        "generation": int(h["generation"]),
        "clean_shutdown": bool(h["clean_shutdown"]),
        "file_bytes": geo.data_bytes,
        "meta_bytes": geo.meta_bytes,
        "page_size": geo.page_size,
        "pages_total": geo.num_pages,
        "pages_held": found.pages_held,
        "pages_fenced": found.pages_fenced,
        "writer_rows": len(found.writers),
        "capacity_bytes": geo.capacity_bytes,
        "data_offset": geo.data_offset,
        "entries_ready": len(found.ready),
        "entries_writing": len(found.writing),
        "entries_damaged": len(found.problems),
        "namespaces": len(found.namespaces),
        "created_unix_ns": int(h["created_unix_ns"]),
    }


def namespaces(view: RegionView) -> list[dict]:
    found = scan(view)
    counts: dict[int, int] = {}
    for _, ns_slot, _, _ in found.ready:
        counts[ns_slot] = counts.get(ns_slot, 0) + 1
    page = view.geometry.page_size
    out = [{"slot": slot, "name": ns_id.name(), "model": ns_id.model, "dtype": ns_id.dtype,
            "block_tokens": ns_id.block_tokens, "block_bytes": ns_id.block_bytes, "sharding": ns_id.sharding.value,
            "world_size": ns_id.world_size, "entry_pages": ns_id.entry_pages(page),
            "entries": counts.get(slot, 0)} for slot, ns_id in sorted(found.namespaces.items())]
    out += [{"slot": slot, "name": f"(damaged: {why})", "entries": 0} for slot, why in found.damaged_namespaces.items()]
    return out


def _entry(view: RegionView, slot: int, names: dict[int, str], pages: np.ndarray | None) -> dict:
    rec = view.entries[slot]
    state = int(rec["state"])
    return {
        "slot": slot,
        "namespace": names.get(int(rec["ns"]), f"slot {int(rec['ns'])}"),
        "key": bytes(rec["key"][: min(int(rec["key_len"]), len(rec["key"]))]).hex(),
        "state": EntryState(state).name if state in EntryState._value2member_map_ else f"?{state}",
        "length": int(rec["length"]),
        "page_count": int(rec["page_count"]),
        "last_access_tick": int(rec["tick"]),
        "pages": None if pages is None else pages.tolist(),
    }


def entries(view: RegionView, namespace: str | None = None, sort: str = "age", limit: int | None = None,
            with_pages: bool = False) -> list[dict]:
    """Entries that a restart would keep, plus WRITING ones; oldest first or largest first."""
    found = scan(view)
    names = {slot: ns_id.name() for slot, ns_id in found.namespaces.items()}
    rows = [_entry(view, slot, names, pages if with_pages else None) for slot, _, _, pages in found.ready]
    rows += [_entry(view, int(slot), names, None) for slot in found.writing]
    if namespace is not None:
        rows = [r for r in rows if r["namespace"] == namespace]
    if sort == "age":
        rows.sort(key=lambda r: r["last_access_tick"])
    elif sort == "size":
        rows.sort(key=lambda r: -r["length"])
    else:
        raise ValueError(f"sort by age or size, not {sort!r}")
    return rows if limit is None else rows[:limit]


def inspect_key(view: RegionView, key: bytes) -> list[dict]:
    """Every entry holding ``key`` (one per namespace), with its pages."""
    found = scan(view)
    names = {slot: ns_id.name() for slot, ns_id in found.namespaces.items()}
    return [_entry(view, slot, names, pages) for slot, _, k, pages in found.ready if k == key]


def inspect_page(view: RegionView, page: int, dump_bytes: int = 64) -> dict:
    geo = view.geometry
    if not 0 <= page < geo.num_pages:
        raise ValueError(f"page {page} is outside 0..{geo.num_pages - 1}")
    found = scan(view)
    owner = int(found.owner[page])
    names = {slot: ns_id.name() for slot, ns_id in found.namespaces.items()}
    start = page * geo.page_size
    out = {"page": page, "offset": geo.data_offset + start,
           "head": None if view.data is None else bytes(view.data[start:start + dump_bytes]).hex(),
           "owner": None}
    if owner >= 0:
        pages = next(p for slot, _, _, p in found.ready if slot == owner)
        out["owner"] = _entry(view, owner, names, pages)
        out["index_in_entry"] = int(np.flatnonzero(pages == page)[0])
    return out


def check(view: RegionView, daemon_running: bool, verify_checksums: bool = False) -> dict:
    """Consistency of the tables and chains. ``ok`` is False when a restart would discard a
    damaged record. WRITING entries are not damage: while a daemon runs they are copies in
    flight; after a crash, unfinished writes that a restart discards. ``verify_checksums`` also
    rehashes every entry that carries a checksum (reads its bytes). Fenced pages are not damage
    either: a writer may still copy into them, and a restart keeps them from everyone until it is
    proven unable to."""
    if verify_checksums and view.data is None:
        raise FormatError("check --checksums reads the entries' bytes: the region file is missing or truncated")
    found = scan(view, verify_checksums)
    return {
        "ok": not found.problems and not found.damaged_namespaces and not found.header_problems,
        "header_problems": found.header_problems,
        "entries_sound": len(found.ready),
        "entries_writing": len(found.writing),
        "pages_held": found.pages_held,
        "pages_fenced": found.pages_fenced,
        "pages_total": view.geometry.num_pages,
        "damaged_namespaces": [{"slot": s, "reason": r} for s, r in found.damaged_namespaces.items()],
        "problems": [{"slot": s, "reason": r} for s, r in found.problems],
        "daemon_running": daemon_running,
        "checksums_verified": verify_checksums,
    }
