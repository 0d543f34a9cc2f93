"""What a region's tables hold, judged record by record: the one judge of what a restart keeps.

``scan`` decides, for every namespace and entry record, whether it is sound, and which pages the
fence table holds for a writer that may still copy into them. A restarting daemon
(``kvtierd.index``) keeps the sound READY entries, parks the fenced pages (``kvtierd.fence``) and
frees the rest; ``kvtierctl check`` (``kvtierd.offline``) reports the rest. So ``check`` says
exactly what a restart would discard. Nothing here changes the region, and nothing in its bytes
can make it raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .contract.namespace import NamespaceId
from .contract.protocol import MAX_KEY_BYTES, PAGES_DTYPE
from .contract.region_format import (CHAIN_END, ENTRY_DTYPE, FENCE_NONE, NS_CHECKSUMS, TICK_LIMIT, WRITER_SLOTS,
                                     EntryState, WriterState)
from .contract.region_sums import (entry_checksum, entry_record_sums, namespace_identities, namespace_record_sums,
                                   shard_checksum)
from .contract.region_view import RegionView, namespace_from_record


@dataclass
class RegionScan:
    """What the tables of a region hold, judged record by record (see ``scan``).

    The sound READY entries, least recently used first, are four parallel sequences:
    ``ready_slots``, ``ready_ns`` (namespace slots), ``ready_keys`` and ``ready_pages`` (each
    entry's chain as little-endian uint32 bytes, PAGES_DTYPE); ``ready`` zips them into
    (slot, namespace slot, key, pages array) tuples. ``problems`` holds the records a
    restarted daemon would discard, as (slot, reason); ``writing`` the WRITING slots
    (unfinished: discarded on restart).

    The fence: ``fenced`` are the pages that no sound entry holds and that the fence table gives
    to a writer row in use (``fenced_rows``, one per page): a restart keeps them from everyone
    until that writer is proven unable to write. ``writers`` are the rows in use; ``stale_fence``
    the pages whose fence names no row in use (a restart clears them).
    """

    namespaces: dict[int, NamespaceId]
    damaged_namespaces: dict[int, str]
    ready_slots: np.ndarray
    ready_ns: np.ndarray
    ready_keys: list[bytes]
    ready_pages: list[bytes]
    writing: np.ndarray
    problems: list[tuple[int, str]]
    owner: np.ndarray           # page → slot of the sound entry holding it, or -1
    fenced: np.ndarray
    fenced_rows: np.ndarray
    writers: np.ndarray
    stale_fence: np.ndarray
    header_problems: list[str]  # what is wrong with the header's own fields (the tick)

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


# Why scan() judges a READY record unsound, by code (0: sound so far).
_REASONS = ("", "bad key length", "unknown or damaged namespace", "page count differs from its namespace's",
            "chain leaves the data area", "chain longer than its page count", "tick out of range",
            "record checksum mismatch", "stored without a data checksum")
_BAD_KEY, _BAD_NS, _BAD_COUNT, _CHAIN_OUT, _CHAIN_LONG, _BAD_TICK, _BAD_SUM, _NO_CHECKSUM = range(1, len(_REASONS))


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

    Every check is vectorised over all records (a region holds millions): only records that
    share a page or a key fingerprint with another candidate are judged one by one, oldest
    first, since whether they are kept depends on which older ones were.
    """
    geo = view.geometry
    namespaces, damaged, ns_pages, ns_identity, ns_checksums = _namespaces(view)
    ents = view.entries
    states = ents["state"]
    writing = np.flatnonzero(states == EntryState.WRITING)
    garbage = np.flatnonzero((states != EntryState.FREE) & (states != EntryState.READY)
                             & (states != EntryState.WRITING))
    problems = [(int(s), f"unknown state {int(states[s])}") for s in garbage]
    ready = np.flatnonzero(states == EntryState.READY)
    ready = ready[np.argsort(ents["tick"][ready], kind="stable")]
    counts = ents["page_count"][ready].astype(np.int64)
    key_len = ents["key_len"][ready].astype(np.int64)
    ns_of = ents["ns"][ready].astype(np.int64)
    why = np.zeros(len(ready), dtype=np.int8)
    # Records whose count, namespace or key is not sound are judged before any chain walk: a
    # damaged count must not size the walk.
    why[(key_len == 0) | (key_len > MAX_KEY_BYTES)] = _BAD_KEY
    wrong_count = (counts != ns_pages[ns_of]) & (why == 0)
    why[wrong_count & (ns_pages[ns_of] < 0)] = _BAD_NS
    why[wrong_count & (ns_pages[ns_of] >= 0)] = _BAD_COUNT
    why[(why == 0) & (ents["tick"][ready] >= TICK_LIMIT)] = _BAD_TICK
    chains = _walk(view, ents["first_page"][ready].astype(np.int64), np.where(why == 0, counts, 0), why)
    records = ents.view(np.uint8).reshape(len(ents), ENTRY_DTYPE.itemsize)
    whole = np.flatnonzero(why == 0)
    for lo in range(0, len(whole), 1 << 16):     # the record sums, 64 Ki records at a time
        at = whole[lo:lo + (1 << 16)]
        sums = entry_record_sums(records[ready[at]], chains[at], counts[at], ns_identity[ns_of[at]])
        why[at[sums != ents["record_sum"][ready[at]]]] = _BAD_SUM
    no_sum = (why == 0) & (ents["checksum"][ready] == 0)
    why[no_sum & (ns_checksums[ns_of] | require_checksums)] = _NO_CHECKSUM

    # The candidates (sound so far), oldest first: their keys, and which of them meet another
    # candidate on a page or on a key of the same namespace (equal fingerprints).
    cand = np.flatnonzero(why == 0)
    slots, counts, ns_of = ready[cand], counts[cand], ns_of[cand]
    key_at = ENTRY_DTYPE.fields["key"][1]        # gathering byte rows is ~10x faster than the field
    keys, fingerprint = _keys(records[slots, key_at:key_at + MAX_KEY_BYTES], key_len[cand], ns_of)
    pages, holder, involved = _meetings(chains[cand], counts, fingerprint, geo.num_pages)

    judged: list[tuple[int, int, str]] = [(int(i), int(ready[i]), _REASONS[why[i]])
                                          for i in np.flatnonzero(why).tolist()]
    checksum = np.where(ns_checksums[ns_of], ents["checksum"][slots], 0)   # what verification checks
    keep, owner = _judge_in_order(view, namespaces, chains, cand, slots, counts, ns_of, keys, involved,
                                  checksum if verify_checksums else np.zeros_like(checksum), judged)
    alone = ~involved & keep
    owner[pages[alone[holder]]] = np.repeat(slots[alone], counts[alone])
    problems += [(slot, reason) for _, slot, reason in sorted(judged)]
    kept = np.flatnonzero(keep)
    fenced, fenced_rows, writers, stale = _fence(view, owner)
    header_tick = int(view.header["tick"])
    return RegionScan(namespaces, damaged, slots[kept], ns_of[kept],
                      keys if len(kept) == len(keys) else [keys[i] for i in kept.tolist()],
                      _rows_as_bytes(chains[cand[kept]].view(np.uint8), 4 * counts[kept]),
                      writing, problems, owner, fenced, fenced_rows, writers, stale,
                      [f"header tick {header_tick} out of range"] if header_tick >= TICK_LIMIT else [])


def _namespaces(view: RegionView) -> tuple[dict[int, NamespaceId], dict[int, str], np.ndarray, np.ndarray,
                                            np.ndarray]:
    """The namespace records judged: (sound ones by slot, damaged ones' reasons by slot, and by
    slot: entry pages (-1: none), identities, whether their entries carry data checksums)."""
    geo = view.geometry
    namespaces: dict[int, NamespaceId] = {}
    damaged: dict[int, str] = {}
    ns_pages = np.full(1 << 16, -1, dtype=np.int64)   # entry pages by namespace slot (u2)
    ns_identity = np.zeros(1 << 16, dtype=np.uint64)  # namespace_identities by slot
    ns_checksums = np.zeros(1 << 16, dtype=bool)      # the slot's entries carry data checksums
    seen: set[NamespaceId] = set()
    in_use = np.flatnonzero(view.namespaces["in_use"])
    ns_sound = namespace_record_sums(view.namespaces[in_use]) == view.namespaces["record_sum"][in_use]
    ns_identity[in_use] = namespace_identities(view.namespaces[in_use])
    for slot, sound in zip(in_use.tolist(), ns_sound.tolist()):
        if not sound:
            damaged[slot] = "record checksum mismatch"
            continue
        try:
            ns_id = namespace_from_record(view.namespaces[slot])
            if not 1 <= ns_id.entry_pages(geo.page_size) <= geo.num_pages:
                raise ValueError(f"{ns_id.entry_pages(geo.page_size)} pages per entry")
            if ns_id in seen:
                raise ValueError("same namespace as an earlier slot")
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            damaged[slot] = str(exc) or type(exc).__name__
            continue
        seen.add(ns_id)
        namespaces[slot] = ns_id
        ns_pages[slot] = ns_id.entry_pages(geo.page_size)
        ns_checksums[slot] = bool(int(view.namespaces[slot]["flags"]) & NS_CHECKSUMS)
    return namespaces, damaged, ns_pages, ns_identity, ns_checksums


def _walk(view: RegionView, first: np.ndarray, walk: np.ndarray, why: np.ndarray) -> np.ndarray:
    """Every chain at once, one link per step (steps = the longest chain): [record, link], ``walk``
    links each (0: not walked). A chain that leaves the data area or goes on past its count is
    judged in ``why`` (_CHAIN_OUT, _CHAIN_LONG)."""
    max_count = int(walk.max()) if len(walk) else 0
    chains = np.full((len(walk), max_count), CHAIN_END, dtype=PAGES_DTYPE)
    cur = first
    for step in range(max_count):
        active = (walk > step) & (why == 0)
        out = active & (cur >= view.geometry.num_pages)
        why[out] = _CHAIN_OUT
        active &= ~out
        chains[active, step] = cur[active]
        nxt = cur.copy()        # a finished chain keeps its last link, checked below
        nxt[active] = view.chain[cur[active]]
        cur = nxt
    why[(why == 0) & (cur != CHAIN_END)] = _CHAIN_LONG
    return chains


def _meetings(chains: np.ndarray, counts: np.ndarray, fingerprint: np.ndarray, num_pages: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every candidate's pages in order, the candidate each belongs to, which candidates meet
    another on a page or on a key fingerprint) for the candidates' ``chains``."""
    in_chain = np.arange(chains.shape[1])[None, :] < counts[:, None]
    pages = chains[in_chain]
    holder = np.repeat(np.arange(len(counts)), counts)
    involved = np.zeros(len(counts), dtype=bool)
    involved[holder[np.bincount(pages, minlength=num_pages)[pages] > 1]] = True
    ordered = np.sort(fingerprint)
    if (ordered[1:] == ordered[:-1]).any():              # rare: find which candidates they are
        order = np.argsort(fingerprint, kind="stable")
        twins = np.flatnonzero(fingerprint[order][1:] == fingerprint[order][:-1])
        involved[order[twins]] = involved[order[twins + 1]] = True
    return pages, holder, involved


def _judge_in_order(view: RegionView, namespaces: dict[int, NamespaceId], chains: np.ndarray, cand: np.ndarray,
                    slots: np.ndarray, counts: np.ndarray, ns_of: np.ndarray, keys: list[bytes], involved: np.ndarray,
                    checksum: np.ndarray, judged: list) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (``cand``: rows of ``chains``) that meet another on a page or a key, judged
    one by one, oldest first (whether one is kept depends on which older ones were), and every
    candidate's data ``checksum`` (0: none to verify). Returns (kept, the page owners so far); what
    is not kept is added to ``judged``."""
    keep = np.ones(len(slots), dtype=bool)
    owner = np.full(view.geometry.num_pages, -1, dtype=np.int64)
    keys_seen: set[tuple[int, bytes]] = set()
    for i in np.flatnonzero(involved).tolist():
        slot, entry_pages = int(slots[i]), chains[cand[i], : counts[i]]
        problem = None
        if (owner[entry_pages] >= 0).any():
            problem = f"shares a page with entry {int(owner[entry_pages][owner[entry_pages] >= 0][0])}"
        elif (int(ns_of[i]), keys[i]) in keys_seen:
            problem = "duplicate key in its namespace"
        elif checksum[i] and not _checksum_matches(view, namespaces[int(ns_of[i])], entry_pages, int(checksum[i])):
            problem = "checksum mismatch"
        if problem:
            keep[i] = False
            judged.append((int(cand[i]), slot, problem))
        else:
            keys_seen.add((int(ns_of[i]), keys[i]))
            owner[entry_pages] = slot
    for i in np.flatnonzero(~involved & (checksum != 0)).tolist():
        if not _checksum_matches(view, namespaces[int(ns_of[i])], chains[cand[i], : counts[i]], int(checksum[i])):
            keep[i] = False
            judged.append((int(cand[i]), int(slots[i]), "checksum mismatch"))
    return keep, owner


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


def _rows_as_bytes(rows: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """``bytes(rows[i, :lengths[i]])`` for every row, one NumPy pass per distinct length."""
    out: list[bytes] = [b""] * len(rows)
    for n, at in _by_length(lengths):
        values = np.ascontiguousarray(rows[at, :n]).view(f"V{n}").ravel().tolist() if n else [b""] * len(at)
        if len(at) == len(rows):
            return values
        for i, value in zip(at.tolist(), values):
            out[i] = value
    return out


def _by_length(lengths: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(length, rows of that length) per distinct length; a single length is the usual case."""
    distinct = np.unique(lengths)
    if len(distinct) == 1:
        return [(int(distinct[0]), np.arange(len(lengths)))]
    return [(int(n), np.flatnonzero(lengths == n)) for n in distinct]


def _keys(key_rows: np.ndarray, key_len: np.ndarray, ns: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """The keys (``key_rows[i, :key_len[i]]``) and a 64-bit fingerprint of (namespace, key) each.

    Equal keys have equal fingerprints; unequal ones almost never do, and those that do are
    only judged one by one (the bytes past a key's length are not part of it, so are left out).
    """
    keys = _rows_as_bytes(key_rows, key_len)
    fingerprint = np.empty(len(key_rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for n, at in _by_length(key_len):
            words = np.zeros((len(at), -(-n // 8) * 8), dtype=np.uint8)
            words[:, :n] = key_rows[at, :n]
            h = ns[at].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(n)
            for word in words.view("<u8").T:
                h = (h ^ word) * np.uint64(0x100000001B3)
                h ^= h >> np.uint64(29)
            fingerprint[at] = h
    return keys, fingerprint


def _checksum_matches(view: RegionView, ns_id: NamespaceId, pages: np.ndarray, expected: int) -> bool:
    page_size = view.geometry.page_size
    per_shard = ns_id.pages_per_shard(page_size)
    sums = [shard_checksum(view.data, pages[r * per_shard:(r + 1) * per_shard], page_size, ns_id.block_bytes)
            for r in range(ns_id.shards)]
    return entry_checksum(sums) == expected
