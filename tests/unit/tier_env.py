"""What the second tier's unit tests share: a store with a tier whose companion is scripted.

``ScriptedLink`` stands in for ``TierLink`` (as tests/unit/test_tier.py scripts a backend for the
guard): it records what the daemon asks and lets the test answer — in time, late, failed, or with
the companion gone. ``MemoryCompanion`` is a scripted link that also does what the companion does
to the region: a ``put`` reads the pages it names into a dict standing in for the tier, a ``get``
writes the tier's bytes into the pages it names, at the moment the test lets it answer — so a page
reused too early shows as foreign bytes. ``TierEnv`` is ``store_env.Env`` with such a tier wired
in. The companion, the engines and the bytes are tested for real in tests/tier/.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os

import numpy as np

from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.region_format import EntryState
from kvtierd.tier.backend import TierUnavailable
from kvtierd.tier.link import LinkBusy, LinkDown, Outcome, Request
from kvtierd.tier.keys import identity
from kvtierd.tiering.interface import TierConfig
from kvtierd.tiering.promote import CHECK_DELAY
from kvtierd.tiering.tier import CompanionTier

from .store_env import PAGE, Env, per_entry


class ScriptedLink:
    """Records the requests it is given; ``answer`` queues their outcomes for the next ``collect``."""

    def __init__(self, max_inflight: int = 8):
        self.state = "ready"
        self.pid: int | None = os.getpid()      # a living process: the fence's writer row needs one
        self.max_inflight = max_inflight
        self.inflight: dict[int, Request] = {}
        self.sent: list[tuple[int, str, dict]] = []
        self.info: dict = {}
        self.last_error = None
        self.counters = {"started": 1, "killed": 0}
        self.restart_backoff = 0.0
        self.restart_at = 0.0
        self.socket = None
        self._ids = itertools.count(1)
        self._out: list[Outcome] = []

    def start(self) -> None: pass
    def stop(self, timeout: float = 0) -> bool:
        return True                             # stopped and reaped

    def submit(self, op: str, context=None, **fields) -> int:
        if self.state != "ready":
            raise LinkDown("down")
        if len(self.inflight) >= self.max_inflight:
            raise LinkBusy("busy")
        rid = next(self._ids)
        self.inflight[rid] = Request(rid, op, 0.0, context)
        self.sent.append((rid, op, fields))
        return rid

    def collect(self, now=None) -> list[Outcome]:
        out, self._out = self._out, []
        return out

    def last(self, op: str) -> tuple[int, dict]:
        rid, _, fields = [s for s in self.sent if s[1] == op][-1]
        return rid, fields

    def fields(self, rid: int) -> dict:
        return next(f for r, _, f in self.sent if r == rid)

    def answer(self, rid: int, ok: bool = True, final: bool = True, error=None, **result) -> None:
        req = self.inflight.pop(rid) if final else self.inflight[rid]
        self._out.append(Outcome(req.op, req.context, final, ok, result, error))

    def die(self) -> None:
        """The companion died and was reaped: every request ends (final, failed); a new one starts."""
        for rid in list(self.inflight):
            self.answer(rid, ok=False, error=TierUnavailable("the tier companion exited (-9)"))
        self.state, self.pid = "down", None

    @property
    def unreaped(self) -> int | None:
        """The companion's pid until it is reaped (``die``)."""
        return self.pid

    def abandon(self) -> None:
        """``TierLink.abandon``: every request ends now; the process is killed but not reaped yet."""
        for rid in list(self.inflight):
            self.answer(rid, ok=False, error=TierUnavailable("the region's data file was replaced"))
        self.state = "killed"


@functools.lru_cache(maxsize=1 << 14)
def page_content(ns: bytes, key: bytes, page: int) -> bytes:
    """Page ``page`` of the block ``key`` of the namespace whose tier identity is ``ns``."""
    seed = int.from_bytes(hashlib.sha256(ns + b"/" + key + b"/%d" % page).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def write_pages(view, pages, blocks: list[bytes]) -> None:
    for page, data in zip(np.asarray(pages).tolist(), blocks):
        view.data[page * PAGE:(page + 1) * PAGE] = np.frombuffer(data, np.uint8)


def read_pages(view, pages) -> list[bytes]:
    return [view.data[page * PAGE:(page + 1) * PAGE].tobytes() for page in np.asarray(pages).tolist()]


class MemoryCompanion(ScriptedLink):
    """A scripted companion whose tier is a dict: ``finish`` does a request's work on the region's
    pages (a put reads them, a get writes them) and answers it. ``foreign`` counts the blocks a put
    read that did not hold their own key's bytes: a demote's pages handed to someone else."""

    def __init__(self, view, max_inflight: int = 8):
        super().__init__(max_inflight)
        self.view = view
        self.tier: dict[tuple[bytes, bytes], list[bytes]] = {}
        self.foreign = 0

    def finish(self, rid: int, ok: bool = True) -> None:
        """The request's work is done now (``ok``), or it failed without touching a page."""
        req, fields = self.inflight[rid], self.fields(rid)
        if not ok:
            self.answer(rid, ok=False, error=TierUnavailable("failed"))
            return
        op = req.op
        if op in ("put", "get"):
            keys = fields["keys"]
            chains = np.frombuffer(fields["pages"], PAGES_DTYPE).reshape(len(keys), -1)
            ns = fields["ns"]
        if op == "put":
            for key, chain in zip(keys, chains):
                got = read_pages(self.view, chain)
                if got != [page_content(ns, key, i) for i in range(len(chain))]:
                    self.foreign += 1
                self.tier[(ns, key)] = got
            self.answer(rid, done=b"\x01" * len(keys))
        elif op == "get":
            done = bytearray(len(keys))
            for i, (key, chain) in enumerate(zip(keys, chains)):
                if (ns, key) in self.tier:
                    write_pages(self.view, chain, self.tier[(ns, key)])
                    done[i] = 1
            self.answer(rid, done=bytes(done))
        elif op == "exists":
            self.answer(rid, present=bytes((fields["ns"], k) in self.tier for k in fields["keys"]))
        elif op == "clear":
            gone = [k for k in self.tier if k[0] == fields["ns"]]
            for k in gone:
                del self.tier[k]
            self.answer(rid, removed=len(gone))
        else:
            self.answer(rid)


class TierEnv(Env):
    """A store over a region in memory with a tier whose companion is scripted (``companion``:
    a ``MemoryCompanion``, else a ``ScriptedLink``)."""

    def __init__(self, num_pages: int = 32, companion: bool = False, ns_slots: int | None = None, **config):
        config = TierConfig("scripted", "nowhere", **{"low_watermark": 0.25, "cooldown": 5.0, **config})

        def tier(index, writes, events, clock) -> CompanionTier:
            self.link = MemoryCompanion(index.view) if companion else ScriptedLink()
            return CompanionTier(index, writes, events, self.link, config, clock)
        super().__init__(num_pages, ns_slots=ns_slots, tier=tier)
        self.tier = self.store.tier
        self.pump()

    def pump(self) -> None:
        self.tier.pump(self.clock())
        self.store.verify()

    def lookup(self, session, ks: list[bytes]) -> tuple[int, int]:
        """A lookup as the server serves it: the reply, then the loop's turn after CHECK_DELAY
        (which sends the existence checks the lookup promised)."""
        hits = self.store.lookup(session, ks)
        reply = hits, self.store.pending(session, ks, hits)
        self.clock.advance(CHECK_DELAY)
        self.pump()
        return reply

    def ready(self, session, key: bytes) -> bool:
        index = self.store.index
        slot = int(index.find(session.engine.ns, [key])[0])
        return slot >= 0 and int(index.states(slot)) == EntryState.READY

    def fill(self, sessions: list, job: int, ks: list[bytes]) -> list:
        """The whole store protocol with the writers' copies: every rank stores, each writer writes
        its share of every block it is handed (``page_content``), then commits. Returns the outcomes."""
        outcomes, handed = None, {}
        for s in sessions:
            outcomes, handed[s.rank] = self.store.store(s, job, ks)
        for s in sessions:
            if s.rank in s.engine.writers:
                self.copy(s, [k for k, o in zip(ks, outcomes) if o == StoreOutcome.WRITE], handed[s.rank])
                self.store.commit(s, job, True)
        return outcomes

    def copy(self, session, ks: list[bytes], handed: bytes) -> None:
        """What a writer rank copies into the pages it was handed for ``ks`` (one run per key)."""
        ns = session.engine.ns
        first = session.rank * ns.pages_per_shard if ns.shards > 1 else 0
        owner = identity(ns.id)
        for key, chain in zip(ks, per_entry(handed, len(ks))):
            pages = np.frombuffer(chain, PAGES_DTYPE)
            write_pages(self.view, pages, [page_content(owner, key, first + i) for i in range(len(pages))])

    def holds_own_bytes(self, session, key: bytes, pages: bytes) -> bool:
        """Whether the pages a load of ``key`` gave ``session`` hold that block's bytes."""
        ns = session.engine.ns
        first = session.rank * ns.pages_per_shard if ns.shards > 1 else 0
        chain = np.frombuffer(pages, PAGES_DTYPE)
        owner = identity(ns.id)
        return read_pages(self.view, chain) == [page_content(owner, key, first + i) for i in range(len(chain))]
