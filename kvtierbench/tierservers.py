"""Real second-tier servers on loopback, for the tests, the benchmark and a developer's shell.

``MooncakeCluster``  a ``mooncake_master`` (P2P handshake: no metadata server, no etcd) and one
                     ``mooncake_client`` storage process contributing the segment memory
``RedisCluster``     N ``valkey-server`` (or ``redis-server``: Debian 12 ships only Redis 7.0)
                     primaries in cluster mode, slots spread by ``valkey-cli/redis-cli --cluster
                     create``, ``cluster-require-full-coverage no`` so the live nodes keep serving
                     their slots when one dies

Everything binds 127.0.0.1 on free ports and lives in one directory (logs, cluster configs)
that ``stop()`` removes; every process is started in its own session and stopped by its own
pid (TERM, then KILL), and dies with the process that started it (``PR_SET_PDEATHSIG``) should
that one crash before stopping it. Each server can kill and restart a part of itself, as the fault tests do.

    python -m kvtierbench.tierservers {mooncake,redis} [--dir DIR]

runs one in the foreground until Ctrl-C or SIGTERM, printing the address the tier settings take.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvtierd.tier.link import die_with_parent

HOST = "127.0.0.1"


class ServerUnavailable(RuntimeError):
    """The server's programs are not installed here (the reason says what installs them)."""


def free_port(bus_offset: int = 0) -> int:
    """A free loopback port (and, with ``bus_offset``, port + bus_offset free too: a cluster bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not bus_offset:
            return port
        if port + bus_offset < 65536:
            try:
                with socket.socket() as s:
                    s.bind((HOST, port + bus_offset))
                return port
            except OSError:
                continue
    raise RuntimeError("no free loopback port pair")


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((HOST, port), timeout=0.2).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the process for port {port} exited with status {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {HOST}:{port} after {timeout} s") from None
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _program(name: str) -> str | None:
    """A program from this interpreter's environment first (the Mooncake wheel's scripts), then PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


class _Server:
    def __init__(self, directory: str | None):
        self.dir = directory or tempfile.mkdtemp(prefix="kvt-tier-")
        os.makedirs(self.dir, exist_ok=True)

    def _spawn(self, argv: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        with open(os.path.join(self.dir, log), "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, cwd=self.dir, start_new_session=True,
                                    preexec_fn=die_with_parent)

    def _tail(self, log: str, lines: int = 5) -> str:
        try:
            with open(os.path.join(self.dir, log), errors="replace") as f:
                return " | ".join(f.read().splitlines()[-lines:])
        except OSError:
            return f"(no {log})"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MooncakeCluster(_Server):
    def __init__(self, directory: str | None = None, segment_bytes: int = 256 << 20, lease_ttl_ms: int | None = None):
        super().__init__(directory)
        self.master_bin = _program("mooncake_master")
        self.client_bin = _program("mooncake_client")
        if self.master_bin is None or self.client_bin is None:
            raise ServerUnavailable("mooncake_master/mooncake_client are not installed in this environment; run "
                                    "tools/install-tier.sh VENV (make tier-install)")
        self.segment_bytes = segment_bytes
        self.lease_ttl_ms = lease_ttl_ms
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.master: subprocess.Popen | None = None
        self.storage: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """The master address the tier's ``master`` setting takes."""
        return f"{HOST}:{self.rpc_port}"

    def start(self, timeout: float = 30.0) -> "MooncakeCluster":
        self.start_master(timeout)
        self.storage = self._spawn(
            [self.client_bin, f"--host={HOST}", f"--global_segment_size={self.segment_bytes // (1 << 20)} MB",
             "--metadata_server=P2PHANDSHAKE", f"--master_server_address={self.address}", f"--port={free_port()}",
             "--protocol=tcp"], "storage.log", {"MC_TCP_BIND_ADDRESS": HOST, "MC_STORE_CLIENT_SETUP_RETRIES": "3"})
        self.wait_capacity(timeout)
        return self

    def start_master(self, timeout: float = 30.0) -> None:
        """(Re)start the master on its port. A restarted master has lost every key; the storage
        process remounts its segment by itself within about a second (``wait_capacity``)."""
        # The master's default lease (10 s) unless told: a get whose transfer outlives the lease
        # fails with LEASE_EXPIRED (seen: every key of a 256 x 1 MiB batch with a 200 ms lease).
        # Removals use force, so leases never hold them up.
        lease = [f"--default_kv_lease_ttl={self.lease_ttl_ms}"] if self.lease_ttl_ms else []
        self.master = self._spawn(
            [self.master_bin, f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}", f"--metrics_host={HOST}",
             f"--metrics_port={self.metrics_port}", *lease], "master.log")
        try:
            wait_port(self.rpc_port, timeout, self.master)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}: {self._tail('master.log')}") from None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=2) as r:
            lines = r.read().decode().splitlines()
        out = {}
        for line in lines:
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def wait_capacity(self, timeout: float = 30.0) -> None:
        """Wait until the master has segment memory to store into."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.metrics().get("master_total_capacity_bytes", 0) > 0:
                    return
            except OSError:
                pass
            if self.storage is not None and self.storage.poll() is not None:
                raise RuntimeError(f"mooncake_client exited ({self.storage.returncode}); see {self.dir}/storage.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the mooncake master has no capacity after {timeout} s; see {self.dir}")
            time.sleep(0.1)

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait(10)

    def kill(self) -> None:
        """SIGKILL every process of the server (the master and the storage client): a tier gone."""
        for proc in (self.storage, self.master):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def stop(self) -> None:
        stop_process(self.storage)
        stop_process(self.master)
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster(_Server):
    BUS_OFFSET = 10000         # the cluster bus listens on port + 10000

    def __init__(self, directory: str | None = None, nodes: int = 3, maxmemory: str = "256mb"):
        super().__init__(directory)
        flavour = "valkey" if shutil.which("valkey-server") else "redis"
        self.server_bin, self.cli_bin = shutil.which(f"{flavour}-server"), shutil.which(f"{flavour}-cli")
        if self.server_bin is None or self.cli_bin is None:
            raise ServerUnavailable("neither valkey-server/valkey-cli nor redis-server/redis-cli is installed; run "
                                    "tools/install-tier.sh VENV (apt-get install redis-server redis-tools)")
        if nodes < 3:
            raise ValueError("a Redis/Valkey cluster needs at least 3 primaries")
        self.maxmemory = maxmemory
        self.ports = [free_port(self.BUS_OFFSET) for _ in range(nodes)]
        self.procs: list[subprocess.Popen | None] = [None] * nodes

    @property
    def address(self) -> str:
        """The seed addresses the tier's ``nodes`` setting takes."""
        return ",".join(f"{HOST}:{p}" for p in self.ports)

    def version(self) -> str:
        out = subprocess.run([self.server_bin, "--version"], capture_output=True, text=True).stdout
        return out.split()[2].removeprefix("v=") if out else "unknown"

    def start_node(self, i: int, timeout: float = 15.0) -> None:
        """(Re)start node i. Its nodes-<port>.conf keeps its identity and slots, so a restarted node
        rejoins the cluster empty (no persistence) but owning its slots again."""
        port = self.ports[i]
        self.procs[i] = self._spawn(
            [self.server_bin, "--bind", HOST, "--port", str(port), "--protected-mode", "yes",
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
             "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
             "--save", "", "--appendonly", "no", "--dir", self.dir, "--logfile", f"{port}.log",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
             "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb"], f"{port}.out")
        try:
            wait_port(port, timeout, self.procs[i])
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}: {self._tail(f'{port}.log')}") from None

    def cli(self, *args: str, port: int | None = None, timeout: float = 30) -> str:
        return subprocess.run([self.cli_bin, "-h", HOST, "-p", str(port or self.ports[0]), *args],
                              capture_output=True, text=True, timeout=timeout, check=True).stdout

    def start(self, timeout: float = 30.0) -> "RedisCluster":
        for i in range(len(self.ports)):
            self.start_node(i, timeout)
        self.cli("--cluster", "create", *(f"{HOST}:{p}" for p in self.ports), "--cluster-replicas", "0",
                 "--cluster-yes", timeout=timeout)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30.0, nodes: list[int] | None = None) -> None:
        """Wait until every (given) node says cluster_state:ok and knows every slot's owner."""
        deadline = time.monotonic() + timeout
        for i in range(len(self.ports)) if nodes is None else nodes:
            while True:
                try:
                    info = self.cli("cluster", "info", port=self.ports[i], timeout=5)
                    if "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info:
                        break
                except (subprocess.SubprocessError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the cluster is not ok after {timeout} s; see {self.dir}")
                time.sleep(0.1)

    def kill_node(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def kill(self) -> None:
        """SIGKILL every node: a tier gone."""
        for i in range(len(self.procs)):
            self.kill_node(i)

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)
        shutil.rmtree(self.dir, ignore_errors=True)


SERVERS = {"mooncake": MooncakeCluster, "redis": RedisCluster}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtierbench.tierservers", description=__doc__.split("\n\n")[0])
    parser.add_argument("server", choices=sorted(SERVERS))
    parser.add_argument("--dir", help="working directory (default: a fresh one under the temp directory); removed "
                                      "at the end")
    args = parser.parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        with SERVERS[args.server](args.dir) as server:
            print(f"{args.server} ready at {server.address} (files in {server.dir}); Ctrl-C stops it", flush=True)
            while not stopping:
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    except ServerUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
