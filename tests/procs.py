"""Child processes driven over a pipe: how tests get one real OS process per TP rank.

The parent sends ``(command, kwargs)``; the child answers ``("ok", value)`` or
``("error", info)`` with info = {"type", "message", "traceback"}. Children are *spawned* (not
forked), so each is a clean process with its own ZMQ context, region mapping, CUDA context and
pid, as in a real engine. ``ChildProcess`` is the parent's handle, ``serve`` the child's loop.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from typing import Any, Callable

CTX = mp.get_context("spawn")


def error_info(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


class ChildError(Exception):
    """A command failed in the child; ``type`` is the name of the exception it raised there."""

    def __init__(self, info: dict):
        super().__init__(f"{info['type']}: {info['message']}")
        self.type = info["type"]
        self.info = info


def serve(conn, commands: dict[str, Callable[..., Any]], close: Callable[[], Any] = lambda: None,
          after: Callable[[], Any] = lambda: None) -> None:
    """In the child: answer commands until "exit" (which runs ``close`` first) or the pipe closes.
    ``after`` runs after every command (e.g. to park a child that must hang until killed)."""
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:
            return
        if name == "exit":
            close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[name](**kwargs)))
        except Exception as exc:
            conn.send(("error", error_info(exc)))
        after()


class ChildProcess:
    """The parent's handle on a spawned child running ``target(conn, *args)``."""

    def __init__(self, target: Callable[..., None], *args: Any, timeout: float = 120):
        self.timeout = timeout
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, name: str, **kwargs: Any) -> None:
        self.conn.send((name, kwargs))

    def result(self, timeout: float | None = None) -> Any:
        if not self.conn.poll(self.timeout if timeout is None else timeout):
            raise TimeoutError("child process did not answer")
        status, value = self.conn.recv()
        if status == "error":
            raise ChildError(value)
        return value

    def call(self, name: str, timeout: float | None = None, **kwargs: Any) -> Any:
        self.send(name, **kwargs)
        return self.result(timeout)

    def kill(self) -> None:
        """SIGKILL the child (no chance to clean up) and reap it."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not self.proc.is_alive(), "child process survived SIGKILL"

    def stop(self, timeout: float = 10) -> None:
        """Ask the child to exit (it cleans up), then make sure it is gone."""
        if self.proc.is_alive():
            try:
                self.send("exit")
                self.conn.poll(timeout)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def all_call(children: list[ChildProcess], name: str, per_rank: list[dict] | None = None, **kwargs: Any) -> list:
    """Send the same command to every child (rank) at once, so they run concurrently, then
    gather; ``per_rank[i]`` adds arguments for child i."""
    for i, child in enumerate(children):
        child.send(name, **{**kwargs, **(per_rank[i] if per_rank else {})})
    return [child.result() for child in children]
