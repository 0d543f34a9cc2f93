"""Which event loop should kvtierd's server use? Round-trip cost of a ROUTER echo, measured.

Runs the same msgpack echo server two ways — a plain zmq.Poller loop draining bursts, and
zmq.asyncio on uvloop — each in its own process, and times N sequential round trips from one
DEALER client (the request/reply pattern of a TP rank), plus a burst mode (C clients sending
at once). Prints microseconds per round trip and the ratio. Needs uvloop (pip install uvloop).

    python bench/loop_choice.py [--n 20000] [--clients 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import msgpack
import zmq

from kvtierbench.echo import echo_reply, echo_server


def uvloop_server(path: str) -> None:
    """The same echo as ``kvtierbench.echo.echo_server`` (the daemon's poller loop), on uvloop."""
    import uvloop
    import zmq.asyncio

    async def main() -> None:
        sock = zmq.asyncio.Context().socket(zmq.ROUTER)
        sock.bind(f"ipc://{path}")
        while True:
            ident, frame = await sock.recv_multipart()
            reply = echo_reply(msgpack.unpackb(frame, raw=False))
            await sock.send_multipart([ident, msgpack.packb(reply, use_bin_type=True)])

    uvloop.run(main())


def client(path: str, n: int, out) -> None:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(f"ipc://{path}")
    keys = [os.urandom(36) for _ in range(16)]
    for rid in range(200):  # warm-up
        sock.send(msgpack.packb({"op": "lookup", "rid": rid, "keys": keys}))
        sock.recv()
    t0 = time.perf_counter()
    for rid in range(n):
        sock.send(msgpack.packb({"op": "lookup", "rid": rid, "keys": keys}))
        sock.recv()
    out.put((time.perf_counter() - t0) / n * 1e6)


def measure(server, n: int, clients: int) -> list[float]:
    path = os.path.join(tempfile.mkdtemp(prefix="kvtbench"), "s.sock")
    srv = mp.Process(target=server, args=(path,), daemon=True)
    srv.start()
    while not os.path.exists(path):
        time.sleep(0.01)
    results = []
    for c in (1, clients):
        q = mp.Queue()
        procs = [mp.Process(target=client, args=(path, n, q)) for _ in range(c)]
        for p in procs:
            p.start()
        per = [q.get() for _ in procs]
        for p in procs:
            p.join()
        results.append(sum(per) / len(per))
    srv.kill()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    poll = measure(echo_server, args.n, args.clients)
    uv = measure(uvloop_server, args.n, args.clients)
    print(f"{'loop':<22}{'1 client us/rtt':>18}{f'{args.clients} clients us/rtt':>20}")
    print(f"{'zmq.Poller':<22}{poll[0]:>18.1f}{poll[1]:>20.1f}")
    print(f"{'zmq.asyncio+uvloop':<22}{uv[0]:>18.1f}{uv[1]:>20.1f}")
    print(f"uvloop / poller: {uv[0] / poll[0]:.2f}x (1 client), {uv[1] / poll[1]:.2f}x ({args.clients} clients)")


if __name__ == "__main__":
    main()
