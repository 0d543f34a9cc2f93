"""Peers that misbehave may only hurt themselves (issue 10, items 6 and 7): a namespace string the
region could not store faithfully is refused, and a peer that never reads its replies cannot
grow the daemon's memory."""

from __future__ import annotations

import pytest
import zmq

from kvtier import BadRequest, Client, NamespaceId
from kvtierd.contract import protocol as P

from .test_jobs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

UNREAD = 60_000


@pytest.mark.parametrize("model", ["m\0", "m\0\0", "m\n"])
def test_a_control_character_in_a_namespace_string_is_refused(daemon, model):
    """The region's fixed-width model field drops trailing NULs: "m\\0" came back from a restart as
    "m" and was served another engine's blocks. Refused at hello, with a typed error."""
    with pytest.raises(BadRequest) as info:
        Client(daemon.socket, engine_id="nul", rank=0, world_size=1, namespace=NamespaceId(model, "uint8", 16, 4096),
               timeout=10)
    assert "control character" in str(info.value)
    assert daemon.call("stats", admin=True)["sessions"] == 0


def test_unread_replies_leave_the_daemon_bounded(daemon):
    """A peer sends 60,000 stats requests and reads no reply. The daemon answers every one, keeps
    at most a bounded queue of replies for that peer (dropping the rest), and serves others."""
    before = daemon.rss()["RssAnon"]
    ctx = zmq.Context.instance()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.SNDHWM, 0)
    peer.connect(f"ipc://{daemon.socket}")
    try:
        frame = P.encode({"op": "stats", "rid": 1})
        for _ in range(UNREAD):
            peer.send(frame)
        # The admin socket's stats are not counted as client requests.
        wait_for(lambda: daemon.call("stats", admin=True)["requests"].get("stats", 0) >= UNREAD, timeout=90,
                 what="the daemon to answer every request")
        grown = daemon.rss()["RssAnon"] - before
        assert grown < 32 << 20, f"the daemon's anonymous memory grew by {grown >> 20} MiB for one unread peer"
        stats = daemon.stats()                     # another peer is served as usual
        assert stats["requests"]["stats"] >= UNREAD + 1
    finally:
        peer.close(linger=0)
