"""kvtierd.server: dispatch without sockets (``Server.handle``, ``Server.handle_admin``), and every
reply the daemon builds matching the shape ``protocol`` declares for it.

A real region (a small file in a tmp directory, unpinned) and a real store; the server is built
but never ``listen``\\ s, so frames go straight into ``handle`` and replies come straight out.
"""

from __future__ import annotations

import itertools
import os
import typing

import msgpack
import numpy as np
import pytest

from kvtierd.attachments import SessionEnd
from kvtierd.contract import protocol as P
from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.replies import (ADMIN_REPLIES, REPLIES, ClientsReply, HelloReply, JobsReply, LookupReply, Reply,
                                      StatsReply)
from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.codes import ErrorCode
from kvtierd.peers import Conn
from kvtierd.processes import own_pid_namespace
from kvtierd.region import Region
from kvtierd.server import Server
from kvtierd.store import Store

NS = NamespaceId("server-model", "bfloat16", 16, 4096)
KEYS = [bytes([i]) * 36 for i in range(4)]
ME = (os.getuid(), os.getpid())     # what the socket's peer credentials say of this process
UNSEEN = (os.getuid(), 0)           # ... of a process of this user in a PID namespace the daemon cannot see


class Dispatch:
    def __init__(self, directory: str):
        self.region = Region.open(directory, "srv", 16 << 20, 65536, pin="off")
        self.store = Store(self.region.view, job_timeout=30.0)
        self.server = Server(self.store, self.region, heartbeat_timeout=6.0)
        self.rids = iter(range(1, 1 << 30))
        self.conns: dict[bytes, Conn | None] = {}
        self.serials = itertools.count(1)

    def call(self, op: str, identity: bytes = b"rank-0", admin: bool = False, peer: tuple | None = None,
             **fields) -> dict:
        """One request; ``peer``: for a hello, the (uid, pid) its connection's peer credentials
        would give (default UNSEEN: this user, a pid the daemon cannot see). Each identity speaks on
        one connection, that of its last hello."""
        rid = next(self.rids)
        frame = P.encode({"op": op, "rid": rid, **fields})
        if admin:
            reply = self.server.handle_admin(identity, frame)
        else:
            if op == "hello":
                conn, peer = self.conns.get(identity), peer or UNSEEN
                if conn is None or conn.peer != peer:         # another process: another connection
                    conn = Conn(next(self.serials), -1, peer[1], peer[0], os.getgid())
                self.conns[identity] = conn
            conn = self.conns.get(identity)
            reply = self.server.handle(identity, frame, lambda fresh: conn)
        assert reply["rid"] == rid
        P.encode(reply)                                      # every reply goes on the wire as it is
        return reply

    def ok(self, op: str, identity: bytes = b"rank-0", admin: bool = False, peer: tuple | None = None,
           **fields) -> dict:
        reply = self.call(op, identity, admin, peer, **fields)
        assert reply["ok"], reply
        return reply

    def hello(self, identity: bytes = b"rank-0", rank: int | None = 0, world_size: int = 1, peer: tuple = ME,
              **fields) -> dict:
        """This process's hello (its peer credentials known): a session the daemon watches."""
        return self.ok("hello", identity, peer=peer, version=P.PROTOCOL_VERSION, engine="e", rank=rank,
                       world_size=world_size, namespace=NS.to_wire(), pid=os.getpid(), pidns=own_pid_namespace(),
                       **fields)

    def close(self) -> None:
        self.server.close()
        self.store.shutdown()
        self.region.close()


@pytest.fixture
def d(tmp_path):
    dispatch = Dispatch(str(tmp_path / "d"))
    yield dispatch
    dispatch.store.verify()
    dispatch.close()


def assert_shape(reply: dict, shape: type[Reply]) -> None:
    """The reply holds exactly the declared fields (and rid, ok), each of its declared type."""
    assert set(reply) == set(shape.FIELDS) | {"rid", "ok"}, shape.__name__
    hints = typing.get_type_hints(shape)
    for name in shape.FIELDS:
        assert isinstance(reply[name], hints[name]), (shape.__name__, name, reply[name])
    assert shape.from_wire(reply).to_wire() == {name: reply[name] for name in shape.FIELDS}


def test_every_reply_matches_its_declared_shape(d):
    replies = {"hello": d.hello(world_size=1)}
    replies["ping"] = d.ok("ping")
    replies["lookup"] = d.ok("lookup", keys=KEYS)
    replies["store"] = d.ok("store", job=1, keys=KEYS)
    replies["commit"] = d.ok("commit", job=1, ok=True)
    leased = d.ok("lookup", keys=KEYS, lease=5, ttl_ms=1500)
    assert_shape(leased, LookupReply)
    assert (leased["hits"], leased["lease"], leased["leased"], leased["ttl_ms"]) == (4, 5, 4, 1500)
    d.ok("lookup", keys=KEYS, lease=6)
    replies["unlease"] = d.ok("unlease", leases=[6, 7])
    assert replies["unlease"]["released"] == 1
    replies["load"] = d.ok("load", job=2, keys=KEYS, lease=5)
    replies["release"] = d.ok("release", job=2)
    d.ok("store", job=3, keys=[b"other"])
    replies["abort"] = d.ok("abort", job=3)
    replies["jobs"] = d.ok("jobs", jobs=[1, 2, 3, 4])
    replies["stats"] = d.ok("stats")
    d.hello(b"coordinator", rank=None)
    replies["events"] = d.ok("events", b"coordinator")
    assert replies["events"]["reset"] and replies["events"]["snapshot_next"] is None
    assert replies["events"]["snapshot"] == [[len(KEYS[0]), b"".join(KEYS)]]      # committed by job 1
    admin = {op: d.ok(op, b"admin", admin=True, **fields) for op, fields in
             [("stats", {}), ("ping", {}), ("clients", {}), ("evict", {"count": 1}), ("clear", {})]}
    replies["bye"] = d.ok("bye")
    assert replies.keys() == REPLIES.keys() and admin.keys() == ADMIN_REPLIES.keys()
    for op, reply in replies.items():
        assert_shape(reply, REPLIES[op])
    for op, reply in admin.items():
        assert_shape(reply, ADMIN_REPLIES[op])
    assert (replies["lookup"]["hits"], replies["lookup"]["lease"], replies["lookup"]["leased"]) == (0, None, 0)
    assert replies["load"]["hits"] == 4
    assert admin["stats"]["lease_ends"] == {"consumed": 1, "released": 1} and admin["stats"]["leases_open"] == 0
    assert np.frombuffer(replies["store"]["outcomes"], np.uint8).tolist() == [StoreOutcome.WRITE] * 4
    assert replies["load"]["pages"] == replies["store"]["pages"] and len(replies["store"]["pages"]) == 4 * 4
    assert [j["state"] for j in replies["jobs"]["jobs"]] == ["done", "done", "aborted", "unknown"]
    assert admin["evict"]["evicted"] == 1 and admin["clear"]["evicted"] == 3
    assert admin["clear"]["skipped_leased"] == admin["clear"]["revoked_leases"] == 0


def test_hello_reply(d):
    h = HelloReply.from_wire(d.hello())
    geo = d.region.geometry
    assert (h.version, h.daemon_pid, h.region, h.generation) == (P.PROTOCOL_VERSION, os.getpid(),
                                                                 d.region.paths.region, d.region.generation)
    assert (h.file_bytes, h.page_size, h.num_pages, h.data_offset) == (geo.data_bytes, geo.page_size,
                                                                        geo.num_pages, geo.data_offset)
    assert (h.namespace, h.pages_per_shard, h.writers) == (NS.name(), 1, [0])
    assert h.watched and h.heartbeat_interval is None and h.job_timeout == 30.0 and h.checksums is False
    other = HelloReply.from_wire(d.ok("hello", b"far", version=P.PROTOCOL_VERSION, engine="f", rank=None,
                                      world_size=1, namespace=NS.to_wire()))      # pid not visible: heartbeats
    assert not other.watched and other.heartbeat_interval == pytest.approx(2.0)
    assert other.session != h.session and other.token != h.token


def test_requests_before_hello_and_admin_ops_on_the_client_socket(d):
    for op, fields in [("lookup", {"keys": KEYS}), ("store", {"job": 1, "keys": KEYS}), ("bye", {})]:
        reply = d.call(op, **fields)
        assert (reply["ok"], reply["code"]) == (False, ErrorCode.NOT_ATTACHED)
    assert d.ok("ping")["attached"] is False
    assert d.call("clients")["code"] == ErrorCode.FORBIDDEN
    assert d.call("stats", admin=True)["ok"]
    assert d.call("lookup", admin=True, keys=KEYS)["code"] == ErrorCode.BAD_REQUEST
    errors = StatsReply.from_wire(d.ok("stats")).errors
    assert errors == {"NOT_ATTACHED": 3, "FORBIDDEN": 1, "BAD_REQUEST": 1}


def test_malformed_frames_get_typed_errors_and_their_rid(d):
    reply = d.server.handle(b"x", msgpack.packb({"op": "store", "rid": 77, "job": -1, "keys": KEYS}))
    assert (reply["rid"], reply["code"]) == (77, ErrorCode.BAD_REQUEST)
    assert d.server.handle(b"x", b"\xc1")["code"] == ErrorCode.BAD_REQUEST
    assert d.server.handle_admin(b"x", b"\x93")["code"] == ErrorCode.BAD_REQUEST


def test_version_and_stopping(d):
    reply = d.call("hello", version=P.MIN_PROTOCOL_VERSION - 1, engine="e", rank=0, world_size=1,
                   namespace=NS.to_wire())
    assert reply["code"] == ErrorCode.VERSION and "install matching kvtierd versions" in reply["message"]
    # The protocol before node_ranks is still served (one release): its engines are on one node.
    old = HelloReply.from_wire(d.ok("hello", b"old", version=P.MIN_PROTOCOL_VERSION, engine="old", rank=0,
                                      world_size=2, namespace=NS.to_wire()))
    assert (old.writers, old.node_ranks) == ([0], [0, 1])
    d.ok("bye", b"old")
    d.hello()
    d.ok("store", job=1, keys=KEYS)
    d.server.request_stop()
    assert d.call("store", job=2, keys=KEYS)["code"] == ErrorCode.SHUTTING_DOWN      # no new jobs
    assert d.ok("commit", job=1, ok=True)                                          # open ones finish
    assert d.call("hello", b"new", version=P.PROTOCOL_VERSION, engine="n", rank=0, world_size=1,
                  namespace=NS.to_wire())["code"] == ErrorCode.SHUTTING_DOWN


def test_a_stopping_daemon_grants_no_lease_it_could_not_honour(d):
    """A lease promises a load, which would be a new job, which a stopping daemon refuses: so it
    refuses the lease (SHUTTING_DOWN: the engine re-attaches to the daemon that follows) rather
    than report a hit whose load then fails. Plain lookups are still answered."""
    d.hello()
    d.ok("store", job=1, keys=KEYS)
    d.ok("commit", job=1, ok=True)
    assert d.ok("lookup", keys=KEYS, lease=1)["hits"] == len(KEYS)
    d.server.request_stop()
    assert d.call("lookup", keys=KEYS, lease=2)["code"] == ErrorCode.SHUTTING_DOWN
    assert d.call("lookup", keys=KEYS, lease=1)["code"] == ErrorCode.SHUTTING_DOWN   # nor a renewal
    assert d.ok("lookup", keys=KEYS)["hits"] == len(KEYS)


def test_rehello_and_replacing_a_lost_session(d):
    first = HelloReply.from_wire(d.hello())
    again = HelloReply.from_wire(d.hello())                 # the same socket: the old session ends
    assert again.session != first.session and len(d.store.attachments.sessions) == 1
    assert d.call("hello", b"new-socket", version=P.PROTOCOL_VERSION, engine="e", rank=0, world_size=1,
                  namespace=NS.to_wire())["code"] == ErrorCode.LAYOUT_MISMATCH       # rank 0 is taken
    wrong = d.call("hello", b"new-socket", version=P.PROTOCOL_VERSION, engine="e", rank=0, world_size=1,
                   namespace=NS.to_wire(), replaces=again.session, replaces_token=again.token ^ 1)
    assert wrong["code"] == ErrorCode.LAYOUT_MISMATCH                                # a wrong token proves nothing
    third = HelloReply.from_wire(d.ok("hello", b"new-socket", version=P.PROTOCOL_VERSION, engine="e", rank=0,
                                      world_size=1, namespace=NS.to_wire(), replaces=again.session,
                                      replaces_token=again.token))
    assert [s.id for s in d.store.attachments.sessions.values()] == [third.session]
    assert d.ok("ping", b"rank-0")["attached"] is False and d.ok("ping", b"new-socket")["attached"] is True


def test_heartbeat_from_another_socket(d):
    h = HelloReply.from_wire(d.ok("hello", version=P.PROTOCOL_VERSION, engine="e", rank=0, world_size=1,
                                  namespace=NS.to_wire(), pid=os.getpid(), pidns=1))
    assert not h.watched
    assert d.ok("ping", b"heartbeat-socket", session=h.session, token=h.token)["attached"] is True
    reply = d.call("ping", b"heartbeat-socket", session=h.session, token=h.token ^ 1)
    assert reply["code"] == ErrorCode.NOT_ATTACHED
    s = StatsReply.from_wire(d.ok("stats"))
    assert (s.sessions_heartbeat, s.clients_watched, s.sessions) == (1, 0, 1)


def test_stats_and_clients(d):
    d.hello()
    d.ok("hello", b"coord", version=P.PROTOCOL_VERSION, engine="e", rank=None, world_size=1, namespace=NS.to_wire())
    d.ok("store", job=1, keys=KEYS[:2])
    s = d.server.stats()
    assert isinstance(s, StatsReply)
    assert (s.entries_writing, s.open_jobs, s.engines, s.sessions) == (2, 1, 1, 2)
    assert s.session_roles == {"rank": 1, "coordinator": 1} and s.clients_watched == 1
    assert s.requests == {"hello": 2, "store": 1} and set(s.latency) == {"hello", "store"}
    assert (s.region, s.socket, s.admin_socket) == (d.region.paths.region, d.region.paths.socket,
                                                    d.region.paths.admin_socket)
    assert s.region_problem is None and s.stopping is False and s.namespace_list[0]["name"] == NS.name()
    clients = ClientsReply.from_wire(d.ok("clients", b"admin", admin=True)).clients
    assert sorted((c["role"], c["watched"], c["namespace"]) for c in clients) == [
        ("coordinator", False, NS.name()), ("rank 0", True, NS.name())]


def test_bye_ends_the_session_and_aborts_its_jobs(d):
    d.hello(world_size=2)
    d.ok("hello", b"rank-1", version=P.PROTOCOL_VERSION, engine="e", rank=1, world_size=2, namespace=NS.to_wire())
    d.ok("store", job=1, keys=KEYS)
    d.ok("bye", b"rank-1")
    jobs = JobsReply.from_wire(d.ok("jobs", jobs=[1])).jobs
    assert jobs == [{"job": 1, "kind": "store", "state": "aborted", "cause": "rank_left"}]
    assert d.call("commit", b"rank-1", job=1, ok=True)["code"] == ErrorCode.NOT_ATTACHED


def test_store_hints_reach_the_policy(d):
    """chain and cold_tail on the wire: validated, set by the job's first request, and heard by
    the policy (slru counts the cold keys it placed first in line as refused)."""
    d.hello()
    d.ok("store", job=1, keys=KEYS, cold_tail=2)
    d.ok("commit", job=1, ok=True)
    s = d.ok("stats")
    assert (s["policy"], s["policy_admitted_keys"], s["policy_refused_keys"]) == ("slru", 2, 2)
    assert s["policy_segments"] == {"probation": 4, "protected": 0}
    # The two cold keys go first, the deepest first; then the chain from its tail.
    slot = d.store.index.find(d.store.jobs.engines["e"].ns, KEYS).tolist()
    assert np.frombuffer(d.store.index.policy.victims(), np.int32).tolist() == [slot[3], slot[2], slot[1], slot[0]]
    more = [bytes([i]) * 36 for i in range(10, 14)]
    d.ok("store", job=2, keys=more, chain=False, cold_tail=99)     # capped at the job's keys
    d.ok("commit", job=2, ok=True)
    assert d.ok("stats")["policy_refused_keys"] == 6
    for bad in ({"chain": 1}, {"cold_tail": -1}, {"cold_tail": P.MAX_KEYS_PER_REQUEST + 1}, {"cold_tail": True}):
        reply = d.call("store", job=3, keys=more, **bad)
        assert not reply["ok"] and reply["code"] == ErrorCode.BAD_REQUEST, (bad, reply)


def test_the_peer_credentials_decide_who_is_watched_not_the_claims(d):
    """A pid claimed in the daemon's PID namespace must be the socket peer's; a claim of another
    namespace is no reason to trust or distrust anything: the peer's pid (0: not visible) decides."""
    hello = dict(version=P.PROTOCOL_VERSION, engine="e", rank=0, world_size=1, namespace=NS.to_wire())
    lie = d.call("hello", peer=ME, pid=os.getpid() + 1, pidns=own_pid_namespace(), **hello)
    assert lie["code"] == ErrorCode.BAD_REQUEST and "peer is pid" in lie["message"]
    child_ns = HelloReply.from_wire(d.ok("hello", peer=ME, pid=7, pidns=12345, **hello))
    assert child_ns.watched                                  # the daemon sees it: a pidfd, no heartbeats
    unseen = HelloReply.from_wire(d.ok("hello", b"far", peer=UNSEEN, **dict(hello, engine="f"),
                                       pid=os.getpid(), pidns=own_pid_namespace()))
    assert not unseen.watched and unseen.heartbeat_interval == pytest.approx(2.0)


def test_a_process_takes_over_its_own_orphaned_rank(d):
    """A Client dropped without close(), or a hello whose reply came too late, leaves a session
    only the process's death ended: the same live process attaching as that rank again now takes it
    over (issue 10 item 5); another process still gets LAYOUT_MISMATCH."""
    orphan = HelloReply.from_wire(d.hello(b"dropped-socket"))
    d.ok("store", b"dropped-socket", job=1, keys=KEYS[:2])              # pages handed, never committed
    other = d.call("hello", b"other-process", peer=(os.getuid(), os.getppid()), version=P.PROTOCOL_VERSION,
                   engine="e", rank=0, world_size=1, namespace=NS.to_wire())
    assert other["code"] == ErrorCode.LAYOUT_MISMATCH
    again = HelloReply.from_wire(d.hello(b"new-socket"))
    assert again.session != orphan.session and [s.id for s in d.store.attachments.sessions.values()] == [again.session]
    stats = StatsReply.from_wire(d.ok("stats"))
    assert stats.aborted_jobs == {"rank_taken_over": 1}
    # The orphan's process lives (it is this one) and might still be copying: its pages stay fenced.
    assert stats.pages_fenced == 2 and stats.fenced_pages["writer_alive"] == 2
    assert d.ok("ping", b"dropped-socket")["attached"] is False


def test_a_hello_naming_a_gone_session_releases_its_writers_pages(d):
    first = HelloReply.from_wire(d.hello(b"a", peer=UNSEEN))    # unwatchable
    d.ok("store", b"a", job=1, keys=KEYS[:3])
    d.server.sessions.end(d.store.attachments.sessions[first.session], SessionEnd.HEARTBEAT_LOST)
    assert StatsReply.from_wire(d.ok("stats")).fenced_pages["grace"] == 3
    d.hello(b"b", peer=UNSEEN, replaces=first.session, replaces_token=first.token)
    stats = StatsReply.from_wire(d.ok("stats"))
    assert stats.pages_fenced == 0 and stats.fence_released_pages["reattached"] == 3


def test_a_reply_that_does_not_encode_costs_its_request_not_the_loop(d):
    # A numpy integer in the second tier's stats once stopped the daemon: the reply was encoded
    # outside the handler's guard, and msgpack's TypeError ended the loop.
    frame = d.server._encode({"rid": 9, "ok": True, "count": np.int64(1)})
    reply = msgpack.unpackb(frame)
    assert (reply["rid"], reply["ok"], reply["error"]) == (9, False, "INTERNAL")
    assert "can not serialize" in reply["message"] and d.server.errors["INTERNAL"] == 1


# ------------------------------------------------------------------------------ engines that span nodes
def node_hello(d: Dispatch, rank: int | None, node_ranks: list[int], ns: NamespaceId = NS, engine: str = "tp4",
               world_size: int = 4) -> HelloReply:
    return HelloReply.from_wire(d.ok("hello", f"{engine}-{rank}".encode(), version=P.PROTOCOL_VERSION,
                                       engine=engine, rank=rank, world_size=world_size, namespace=ns.to_wire(),
                                       node_ranks=node_ranks))


def test_a_node_half_of_a_replicated_engine_writes_with_its_lowest_rank_and_counts_its_own_votes(d):
    """Ranks 2-3 of a TP=4 engine on this daemon (0-1 on another node's): rank 2 writes the node's
    copy, and the entries are READY once ranks 2 and 3 voted (issue 25: rank 0, on the other
    node, was the writer, and the job waited for four votes)."""
    hellos = [node_hello(d, r, [2, 3]) for r in (2, 3, None)]
    assert all((h.writers, h.node_ranks) == ([2], [2, 3]) for h in hellos)
    written = d.ok("store", b"tp4-2", job=1, keys=KEYS)
    assert len(written["pages"]) == 4 * 4                                 # a page id of each block
    assert d.ok("store", b"tp4-3", job=1, keys=KEYS)["pages"] == b""                # a vote
    assert d.ok("lookup", b"tp4-None", keys=KEYS)["hits"] == 0                     # rank 2 has not committed
    d.ok("commit", b"tp4-2", job=1, ok=True)
    assert d.ok("lookup", b"tp4-None", keys=KEYS)["hits"] == 4
    stats = d.ok("stats", b"admin", admin=True)
    assert (stats["open_jobs"], stats["entries_writing"], stats["entries_ready"]) == (0, 0, 4)
    assert stats["bytes_saved_dedup"] == 4 * NS.block_bytes                        # rank 3's copy
    for r in (2, 3):
        assert d.ok("load", f"tp4-{r}".encode(), job=2, keys=KEYS)["hits"] == 4
    d.ok("release", b"tp4-2", job=2)
    assert d.ok("jobs", b"tp4-2", jobs=[2])["jobs"][0]["waiting"] == 1
    d.ok("release", b"tp4-3", job=2)
    assert d.ok("stats", b"admin", admin=True)["entries_pinned"] == 0


def test_a_node_half_of_a_sharded_engine_holds_its_ranks_shards_in_a_namespace_of_its_own(d):
    sharded = NamespaceId("server-model", "bfloat16", 16, 4096, "sharded")
    for r in (2, 3):
        assert node_hello(d, r, [2, 3], sharded).writers == [2, 3]
    pages = {r: d.ok("store", f"tp4-{r}".encode(), job=1, keys=KEYS[:1])["pages"] for r in (2, 3)}
    assert len(pages[2]) == len(pages[3]) == 4 and pages[2] != pages[3]           # each its own shard
    for r in (2, 3):
        d.ok("commit", f"tp4-{r}".encode(), job=1, ok=True)
    (ns,) = d.ok("stats", b"admin", admin=True)["namespace_list"]
    assert ns["name"].endswith("sharded/tp4[2-3]") and ns["entries"] == 1
    # A single-node TP=2 engine of the same model holds other shards: it never sees these.
    for r in (0, 1):
        d.ok("hello", f"tp2-{r}".encode(), version=P.PROTOCOL_VERSION, engine="tp2", rank=r, world_size=2,
             namespace=sharded.to_wire())
    assert d.ok("lookup", b"tp2-0", keys=KEYS[:1])["hits"] == 0
    assert d.ok("load", b"tp4-3", job=2, keys=KEYS[:1])["pages"] == pages[3]


def test_every_session_of_an_engine_on_one_daemon_names_the_same_node_ranks(d):
    node_hello(d, 2, [2, 3])
    (row,) = d.ok("clients", b"admin", admin=True)["clients"]
    assert (row["world_size"], row["node_ranks"]) == (4, "2-3")                   # kvtierctl clients shows them
    wrong = d.call("hello", b"tp4-3", version=P.PROTOCOL_VERSION, engine="tp4", rank=3, world_size=4,
                   namespace=NS.to_wire(), node_ranks=[1, 3])
    assert wrong["code"] == ErrorCode.LAYOUT_MISMATCH and "KVTIER_NODE_RANKS" in wrong["message"]
    whole = d.call("hello", b"tp4-c", version=P.PROTOCOL_VERSION, engine="tp4", rank=None, world_size=4,
                   namespace=NS.to_wire())
    assert whole["code"] == ErrorCode.LAYOUT_MISMATCH and "2-3" in whole["message"]
    outside = d.call("hello", b"tp4-0", version=P.PROTOCOL_VERSION, engine="tp4", rank=0, world_size=4,
                     namespace=NS.to_wire(), node_ranks=[2, 3])
    assert outside["code"] == ErrorCode.BAD_REQUEST and "own node" in outside["message"]
