"""Fixtures for the second-tier tests: real engines on loopback, a real disk directory, and
regions to move blocks from.

Each engine fixture starts a real engine in its own fresh directory (``kvtierbench.tierservers``:
free loopback ports, every process started and stopped by its own pid) and stops it and removes
the directory at teardown. A test skips, with the reason, only when the engine's programs are not
installed here (``make test-tier`` installs them: tools/install-tier.sh). The disk tier's
"engine" is a fresh directory on a real filesystem (``DiskDir``: under the system's temporary
directory, which here is the root filesystem, ext4 — O_DIRECT for real).

Blocks are sealed with ``KEY`` (``seals``): the same fixed test key in every process, as every
node of a fleet shares one.

``Region`` stands in for the daemon's region file: a file under /dev/shm of fixed pages after a
header, mapped by the test (the "engine" writing and checking blocks) and by a companion process
(``kvtierd.tier.service``), exactly the way the daemon's region is mapped by both.
"""

from __future__ import annotations

import gc
import hashlib
import mmap
import os
import shutil
import tempfile

import numpy as np
import pytest

from kvtierbench.tierservers import MooncakeCluster, RedisCluster, ServerUnavailable
from kvtierd.tier.backend import Owner, page_extents
from kvtierd.tier.keys import Keyspace
from kvtierd.tier.seal import SealKey, Sealer, Seals

from .cgroups import CgroupUnavailable, Freezer, Throttle
from .mounts import Mount, MountUnavailable

NETWORKED = ("mooncake", "redis")        # engines shared by several nodes
BACKENDS = NETWORKED + ("disk",)
KEY = SealKey(bytes(range(32)))
OWNER = Owner("kvtierd", KEY.id_hex)


class DiskDir:
    """The disk tier's "engine": a fresh directory on a real filesystem, removed at ``stop``."""

    def __init__(self, parent: str | None = None):
        self.root = tempfile.mkdtemp(prefix="kvt-disk-", dir=parent)
        self.address = os.path.join(self.root, "tier")

    def start(self) -> None:
        pass

    def stop(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def start_engine(kind: str, **kwargs):
    if kind == "disk":
        return DiskDir(**kwargs)
    try:
        engine = (MooncakeCluster if kind == "mooncake" else RedisCluster)(**kwargs)
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        engine.start()
    except BaseException:
        engine.stop()
        raise
    return engine


def settings_for(kind: str, engine, **extra) -> dict:
    """The backend settings that reach ``engine`` (its address, as tier_address gives it)."""
    return {"address": engine.address, **extra}


def write_key_file(directory: str) -> str:
    """``KEY`` in a key file (mode 0600) under ``directory``, as tier_key_file names one."""
    path = os.path.join(directory, "test.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(KEY.secret.hex())
    return path


def seals(ks: Keyspace, keys: list[bytes], memory: memoryview, extents: list, shards: int = 1) -> Seals:
    """The seals of one put or get of ``keys`` in ``ks``'s namespace under the test key."""
    return Sealer(KEY, ks.identity).seals(keys, memory, extents, shards)


def move(b, op: str, ks: Keyspace, keys: list[bytes], region, pages, length: int) -> list[bool]:
    """``b.put``/``b.get`` of ``keys`` at ``pages`` (blocks × pages of ``region``), sealed."""
    extents = page_extents(np.asarray(pages), region.page_size, length)
    return getattr(b, op)(ks.names(keys), extents, seals(ks, keys, region.memory, extents))


@pytest.fixture
def disk():
    """A fresh disk tier directory, removed at teardown."""
    d = DiskDir()
    yield d
    d.stop()


@pytest.fixture(params=NETWORKED)
def engine(request):
    """(kind, a started real engine) for each networked backend."""
    e = start_engine(request.param)
    yield request.param, e
    e.stop()


@pytest.fixture(params=BACKENDS)
def store(request):
    """(kind, a started real engine or a fresh disk directory) for every backend."""
    e = start_engine(request.param)
    yield request.param, e
    e.stop()


def block_bytes(key: bytes, n: int) -> np.ndarray:
    """A block's content derived from its key: any mix-up of keys, pages or offsets shows."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Region:
    """A region-like file: ``header`` bytes, then ``pages`` pages of ``page_size``."""

    def __init__(self, pages: int = 256, page_size: int = 16 << 10, header: int = 2 << 20):
        self.dir = tempfile.mkdtemp(prefix="kvt-tier-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        self.path = os.path.join(self.dir, "node.region")
        self.page_size, self.pages, self.offset = page_size, pages, header
        self.data_bytes = pages * page_size
        with open(self.path, "wb") as f:
            f.truncate(header + self.data_bytes)
        fd = os.open(self.path, os.O_RDWR)
        self.map = mmap.mmap(fd, header + self.data_bytes)
        os.close(fd)
        self.data = np.frombuffer(self.map, np.uint8, self.data_bytes, header)

    @property
    def memory(self) -> memoryview:
        """The data area, as the companion attaches it."""
        return memoryview(self.map)[self.offset:self.offset + self.data_bytes]

    def write(self, key: bytes, pages: list[int], length: int) -> None:
        content = block_bytes(key, length)
        for i, p in enumerate(pages):
            chunk = content[i * self.page_size:(i + 1) * self.page_size]
            self.data[p * self.page_size:p * self.page_size + len(chunk)] = chunk

    def read(self, pages: list[int], length: int) -> np.ndarray:
        return np.concatenate([self.data[p * self.page_size:(p + 1) * self.page_size] for p in pages])[:length]

    def holds(self, key: bytes, pages: list[int], length: int) -> bool:
        return np.array_equal(self.read(pages, length), block_bytes(key, length))

    def scrub(self) -> None:
        self.data[:] = 0

    def close(self) -> None:
        del self.data
        gc.collect()
        try:
            self.map.close()
        except BufferError:     # a view is still held (a traceback's frame): the mapping goes with it
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def make_region():
    made: list[Region] = []

    def make(**kwargs) -> Region:
        made.append(Region(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def kill_engine(kind: str, e) -> None:
    """The engine's service gone (its clients stay): Mooncake's master, every Redis Cluster node."""
    if kind == "mooncake":
        e.kill_master()
    else:
        for i in range(len(e.ports)):
            e.kill_node(i)


def restart_engine(kind: str, e) -> None:
    """``kill_engine`` undone, waiting until the engine serves again."""
    if kind == "mooncake":
        e.start_master()
        e.wait_capacity()
    else:
        for i in range(len(e.ports)):
            e.start_node(i)
        e.wait_ok()


class Made:
    """A fixture's factory: ``kind(*args)`` made, kept and closed at teardown (``close``); the test
    skips, saying ``why`` and the reason, where it cannot be made (``unavailable``)."""

    def __init__(self, kind, unavailable: type[Exception], why: str):
        self.kind, self.unavailable, self.why = kind, unavailable, why
        self.made: list = []

    def __call__(self, *args):
        try:
            self.made.append(self.kind(*args))
        except self.unavailable as exc:
            pytest.skip(f"{self.why}: {exc}")
        return self.made[-1]

    def close(self) -> None:
        for m in self.made:
            m.close()


@pytest.fixture
def mount():
    """Factory: mount(kind, size_mib) → a real small filesystem (``mounts.Mount``), unmounted at
    teardown; the test skips, saying why, where mounting is not allowed."""
    made = Made(Mount, MountUnavailable, "cannot mount a test filesystem here")
    yield made
    made.close()


@pytest.fixture
def throttle():
    """Factory: throttle(device, bps) → a blkio group (``cgroups.Throttle``) slowing the device
    for its members, removed at teardown; the test skips, saying why, where it cannot be made."""
    made = Made(Throttle, CgroupUnavailable, "cannot throttle a disk here")
    yield made
    made.close()


@pytest.fixture
def freezer():
    """A freezer group (``cgroups.Freezer``), thawed and removed at teardown; the test skips,
    saying why, where it cannot be made."""
    try:
        group = Freezer()
    except CgroupUnavailable as exc:
        pytest.skip(f"cannot freeze a process here: {exc}")
    yield group
    group.close()
