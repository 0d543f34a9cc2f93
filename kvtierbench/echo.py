"""The control plane's floor: a ROUTER server with the daemon's loop shape that decodes each
request and answers a reply of kvtierd's size, doing no work (``kvtierctl bench`` control section,
and bench/loop_choice.py)."""

from __future__ import annotations

def echo_reply(msg: dict) -> dict:
    """What a daemon doing no work answers: a reply of kvtierd's size for the request.

    Lookup → {hits}; store → {outcomes: B bytes, pages: 4·B bytes}; load → {hits, pages: 4·B};
    anything else (commit, release, hello, ping) → {} (one-page blocks: one uint32 page per key).
    """
    op, n = msg["op"], len(msg.get("keys", ()))
    if op == "lookup":
        reply = {"hits": n}
    elif op == "store":
        reply = {"outcomes": bytes(n), "pages": bytes(4 * n)}
    elif op == "load":
        reply = {"hits": n, "pages": bytes(4 * n)}
    else:
        reply = {}
    reply.update(rid=msg["rid"], ok=True)
    return reply


def echo_server(path: str) -> None:
    """The floor of the control plane: the daemon's own loop shape (a zmq.Poller draining bursts
    of up to 256 requests), decoding each request and answering ``echo_reply``."""
    import msgpack
    import zmq
    sndmore = int(zmq.SNDMORE)
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        poller.poll(1000)
        for _ in range(256):
            try:
                ident, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = msgpack.unpackb(frame, raw=False)
            sock.send(ident, sndmore)         # as the daemon sends (kvtierd.server.SNDMORE)
            sock.send(msgpack.packb(echo_reply(msg), use_bin_type=True))


