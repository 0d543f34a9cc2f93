"""What a region's tables hold, judged record by record: the one judge of what a restart keeps.

``scan`` decides, for every namespace and entry record, whether it is sound, and which pages the
fence table holds for a writer that may still copy into them. A restarting daemon
(``kvtierd.index``) keeps the sound READY entries, parks the fenced pages (``kvtierd.fence``) and
frees the rest; ``kvtierctl check`` (``kvtierd.offline``) reports the rest. So ``check`` says
exactly what a restart would discard. Nothing here changes the region, and nothing in its bytes
can make it raise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .contract.namespace import NamespaceId
from .contract.protocol import PAGES_DTYPE
from .contract.region_format import EntryState, FENCE_NONE, NS_CHECKSUMS, TICK_LIMIT, WRITER_SLOTS, WriterState
from .contract.region_sums import entry_checksum, namespace_identities, namespace_record_sums, shard_checksum
from .contract.region_view import RegionView, namespace_from_record
from .records import judge_ready, judge_related, keys_of, rows_as_bytes


@dataclass
class RegionScan:
    """What the tables of a region hold, judged record by record (see ``scan``).

    The sound READY entries, least recently used first, as parallel arrays: ``ready_slots``,
    ``ready_ns`` (namespace slots), ``ready_fps`` (each key's fingerprint: Python's ``hash`` of
    its bytes) and ``ready_chains`` (each entry's chain, ``ready_counts`` pages of a row of
    PAGES_DTYPE). Nothing is built per entry: a restart indexes the slots (the keys stay in the
    records), and ``ready_keys``, ``ready_pages`` and ``ready`` (tuples of slot, namespace slot,
    key, pages array) build Python objects per entry only when asked (``kvtierctl``).
    ``problems`` holds the records a restarted daemon would discard, as (slot, reason);
    ``writing`` the WRITING slots (unfinished: discarded on restart).

    The fence: ``fenced`` are the pages that no sound entry holds and that the fence table gives
    to a writer row in use (``fenced_rows``, one per page): a restart keeps them from everyone
    until that writer is proven unable to write. ``writers`` are the rows in use; ``stale_fence``
    the pages whose fence names no row in use (a restart clears them).
    """

    namespaces: dict[int, NamespaceId]
    damaged_namespaces: dict[int, str]
    ready_slots: np.ndarray
    ready_ns: np.ndarray
    ready_fps: np.ndarray
    ready_chains: np.ndarray
    ready_counts: np.ndarray
    states: np.ndarray          # every record's state as the scan read it (a copy, one byte per slot)
    writing: np.ndarray
    problems: list[tuple[int, str]]
    owner: np.ndarray           # page → slot of the sound entry holding it, or -1
    fenced: np.ndarray
    fenced_rows: np.ndarray
    writers: np.ndarray
    stale_fence: np.ndarray
    header_problems: list[str]  # what is wrong with the header's own fields (the tick)
    view: RegionView = field(repr=False)

    @property
    def ready_keys(self) -> list[bytes]:
        return keys_of(self.view, self.ready_slots)

    @property
    def ready_pages(self) -> list[bytes]:
        """Each entry's chain as little-endian uint32 bytes (PAGES_DTYPE)."""
        return rows_as_bytes(self.ready_chains.view(np.uint8), 4 * self.ready_counts)

    @property
    def ready(self) -> list[tuple[int, int, bytes, np.ndarray]]:
        return [(slot, ns, key, np.frombuffer(pages, PAGES_DTYPE)) for slot, ns, key, pages in
                zip(self.ready_slots.tolist(), self.ready_ns.tolist(), self.ready_keys, self.ready_pages)]

    @property
    def pages_held(self) -> int:
        return int((self.owner >= 0).sum())

    @property
    def pages_fenced(self) -> int:
        return len(self.fenced)


# Why scan() judges a READY record unsound, by code (0: sound): records.judge_ready's codes, then
# records.judge_related's (the holder of the shared page goes into its reason).
_REASONS = ("", "bad key length", "unknown or damaged namespace", "page count differs from its namespace's",
            "chain leaves the data area", "chain longer than its page count", "tick out of range",
            "record checksum mismatch", "stored without a data checksum", "shares a page with entry {}",
            "duplicate key in its namespace", "checksum mismatch")


def scan(view: RegionView, verify_checksums: bool = False, require_checksums: bool = False) -> RegionScan:
    """Judge every namespace and entry record without changing anything.

    One piece of logic serves the daemon's recovery (which keeps ``ready`` and frees the rest)
    and ``kvtierctl check`` (which reports ``problems``). A namespace record is sound when its
    record_sum matches and its fields make a namespace. A READY record is sound when its
    namespace record is sound, its key length is 1..MAX_KEY_BYTES, its page count is its
    namespace's, its tick is below TICK_LIMIT, its chain stays in the data area and ends exactly
    after page_count links, its record_sum matches (its fields, its chain, its namespace's
    identity), it shares no page with an older sound entry and no older sound entry of its
    namespace has its key. An entry of a namespace flagged NS_CHECKSUMS must carry a data
    checksum; with ``require_checksums`` every entry must (the daemon's checksums setting is on);
    with ``verify_checksums`` each data checksum must match the entry's bytes (this reads them:
    ``view.data`` must be there). Nothing in the bytes can make this raise.

    Two compiled passes over all records (a region holds millions): each READY record judged on
    its own (``records.judge_ready``), then the sound ones against each other, oldest first
    (``records.judge_related``), since whether one is kept depends on which older ones were.
    """
    tables = _namespaces(view)
    ready = judge_ready(view, tables.pages, tables.identity, tables.checksums, require_checksums)
    states = ready["states"]
    writing = np.flatnonzero(states == EntryState.WRITING)
    garbage = np.flatnonzero((states != EntryState.FREE) & (states != EntryState.READY)
                             & (states != EntryState.WRITING))
    problems = [(int(s), f"unknown state {int(states[s])}") for s in garbage]
    verify = None
    if verify_checksums:
        def verify(i: int) -> bool:
            chain = ready["chains"][i, : ready["counts"][i]]
            return _checksum_matches(view, tables.namespaces[int(ready["ns"][i])], chain, int(ready["checksum"][i]))
    kept = judge_related(view, ready, tables.checksums, verify)
    problems += [(slot, _REASONS[why].format(other)) for slot, why, other in zip(
        ready["slots"][kept["problem_at"]].tolist(), kept["problem_why"].tolist(), kept["problem_other"].tolist())]
    fenced, fenced_rows, writers, stale = _fence(view, kept["owner"])
    header_tick = int(view.header["tick"])
    return RegionScan(tables.namespaces, tables.damaged, kept["slots"], kept["ns"], kept["fps"], kept["chains"],
                      kept["counts"], states, writing, problems, kept["owner"], fenced, fenced_rows, writers, stale,
                      [f"header tick {header_tick} out of range"] if header_tick >= TICK_LIMIT else [], view)


@dataclass
class _Namespaces:
    """The namespace table judged: the sound namespaces, the damaged ones, and per namespace slot
    (all 2**16 a record's u2 can name) its entries' page count (-1: none), identity and checksum flag."""

    namespaces: dict[int, NamespaceId]
    damaged: dict[int, str]
    pages: np.ndarray
    identity: np.ndarray
    checksums: np.ndarray


def _namespaces(view: RegionView) -> _Namespaces:
    geo = view.geometry
    tables = _Namespaces({}, {}, np.full(1 << 16, -1, dtype=np.int64), np.zeros(1 << 16, dtype=np.uint64),
                         np.zeros(1 << 16, dtype=bool))
    seen: set[NamespaceId] = set()
    in_use = np.flatnonzero(view.namespaces["in_use"])
    ns_sound = namespace_record_sums(view.namespaces[in_use]) == view.namespaces["record_sum"][in_use]
    tables.identity[in_use] = namespace_identities(view.namespaces[in_use])
    for slot, sound in zip(in_use.tolist(), ns_sound.tolist()):
        if not sound:
            tables.damaged[slot] = "record checksum mismatch"
            continue
        try:
            ns_id = namespace_from_record(view.namespaces[slot])
            if not 1 <= ns_id.entry_pages(geo.page_size) <= geo.num_pages:
                raise ValueError(f"{ns_id.entry_pages(geo.page_size)} pages per entry")
            if ns_id in seen:
                raise ValueError("same namespace as an earlier slot")
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            tables.damaged[slot] = str(exc) or type(exc).__name__
            continue
        seen.add(ns_id)
        tables.namespaces[slot] = ns_id
        tables.pages[slot] = ns_id.entry_pages(geo.page_size)
        tables.checksums[slot] = bool(int(view.namespaces[slot]["flags"]) & NS_CHECKSUMS)
    return tables


def _fence(view: RegionView, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(fenced pages, their rows, rows in use, stale pages): see ``RegionScan``. A page a sound
    entry holds is that entry's whatever its fence says: READY means every writer committed. A page
    of a WRITING record, or of a READY one judged unsound, is judged by the fence table alone: no
    record checksum is asked of it (a WRITING record carries none)."""
    writers = np.flatnonzero(view.writers["state"] != WriterState.FREE)
    in_use = np.zeros(WRITER_SLOTS + 1, dtype=bool)     # the last slot stands for any row out of range
    in_use[writers] = True
    candidates = np.flatnonzero((view.fence != FENCE_NONE) & (owner < 0))
    rows = view.fence[candidates].astype(np.int64)
    named = in_use[np.minimum(rows, WRITER_SLOTS)]
    return candidates[named], rows[named], writers, candidates[~named]


def _checksum_matches(view: RegionView, ns_id: NamespaceId, pages: np.ndarray, expected: int) -> bool:
    page_size = view.geometry.page_size
    per_shard = ns_id.pages_per_shard(page_size)
    sums = [shard_checksum(view.data, pages[r * per_shard:(r + 1) * per_shard], page_size, ns_id.block_bytes)
            for r in range(ns_id.shards)]
    return entry_checksum(sums) == expected
