"""What an operator sees of the second tier (issue 27): bad settings stop the daemon at start with
the reason, and a tier that goes down and comes back says so in the daemon's log once per
change, while the companion's log says why.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.integration.conftest import _rank_pool, new_daemon, ranks  # noqa: F401  (fixtures)
from tests.integration.test_faults import wait_for
from tests.integration.test_tp_roundtrip import keys_for

from .conftest import DiskDir, kill_engine, restart_engine, start_engine, write_key_file
from .daemons import SMALL, connect, tier_stats, wait_ready

pytestmark = pytest.mark.timeout(180)


def refused(*args: str) -> str:
    """Start a daemon that must refuse to start; its log."""
    d = new_daemon(*args)
    try:
        with pytest.raises(RuntimeError, match="kvtierd exited with"):
            d.start(timeout=60)
        return d.log()
    finally:
        d.cleanup()


@pytest.mark.parametrize("backend, settings, said", [
    ("redis", {"ttl": 5}, "tier_settings: unknown key 'ttl' for the redis backend; its keys are timeout, "
                          "node_cooldown, ttl_s"),
    ("mooncake", {"protocl": "tcp"}, "unknown key 'protocl' for the mooncake backend; its keys are local_hostname, "
                                     "metadata_server, protocol,"),
    ("disk", {"capcity": "1GiB", "io_thread": 2}, "unknown keys 'capcity', 'io_thread' for the disk backend; its "
                                                 "keys are capacity, free_floor, io_threads, direct, timeout"),
    ("redis", {"address": "127.0.0.1:1"}, "set the redis backend's address with tier_address"),
])
def test_unknown_tier_settings_are_an_error_at_start(backend, settings, said):
    d = DiskDir()
    try:
        address = d.address if backend == "disk" else "127.0.0.1:1"
        log = refused("--tier-backend", backend, "--tier-address", address, "--tier-settings", json.dumps(settings),
                      "--tier-key-file", write_key_file(d.root))
        assert said in log, log
    finally:
        d.stop()


def test_a_key_file_open_to_others_is_an_error_at_start():
    d = DiskDir()
    try:
        key = write_key_file(d.root)
        os.chmod(key, 0o644)
        log = refused("--tier-backend", "disk", "--tier-address", d.address, "--tier-key-file", key)
        assert f"the tier key file {key} is open to others (mode 0644): chmod 600 {key}" in log, log
    finally:
        d.stop()


def test_the_tier_going_down_and_up_is_logged_once_per_change(ranks, tmp_path):
    engine = start_engine("redis")
    try:
        d = new_daemon("--tier-backend", "redis", "--tier-address", engine.address, "--tier-timeout", "0.3",
                       "--tier-failures", "1", "--tier-cooldown", "0.5", "--tier-key-file", write_key_file(str(tmp_path)))
        try:
            d.start()
            wait_ready(d)
            wait_for(lambda: "second tier up" in d.log(), 10, "the tier up in the daemon's log")
            procs = ranks(1)
            connect(procs, d, "engine-a", SMALL, "logged")
            kill_engine("redis", engine)
            for i in range(12):                  # lookups' existence checks fail, the breaker opens
                procs[0].call("lookup_detail", keys=keys_for(f"down-{i}", 2))
                if "second tier down" in d.log():
                    break
                time.sleep(0.3)
            wait_for(lambda: "second tier down" in d.log(), 30, "the tier down in the daemon's log")
            for i in range(6):                   # more failures: no more lines about it
                procs[0].call("lookup_detail", keys=keys_for(f"still-down-{i}", 2))
            restart_engine("redis", engine)

            def up_again():
                procs[0].call("lookup_detail", keys=keys_for("probe", 1))
                return len(re.findall("second tier up", d.log())) == 2
            wait_for(up_again, 60, "the tier up again in the daemon's log")
            log = d.log()
            assert log.count("second tier down") == 1 and "breaker open on the meta lane" in log, log
            with open(os.path.join(d.dir, f"{d.name}.tier.log")) as f:
                companion = f.read()
            assert "redis meta lane:" in companion                          # the first failure, and why
            assert "redis meta lane: breaker open" in companion
            assert "succeeded after" in companion and "breaker closed" in companion
            assert tier_stats(d)["state"] == "ready"
        finally:
            d.cleanup()
    finally:
        engine.stop()
