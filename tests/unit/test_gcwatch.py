"""kvtierd.gcwatch: every collection counted under its generation, with its pause."""

from __future__ import annotations

import gc

from kvtierd.gcwatch import GcWatch


def test_collections_are_counted_per_generation_with_their_pauses():
    watch = GcWatch()
    try:
        before = watch.snapshot()
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        after = watch.snapshot()
        assert after["collections"][0] - before["collections"][0] >= 1
        assert after["collections"][2] - before["collections"][2] == 2
        assert after["pause_seconds_total"][2] >= after["pause_seconds_max"][2] > 0
        assert len(after["pending"]) == 3 and after["frozen"] >= 0
    finally:
        watch.close()
    assert watch._observe not in gc.callbacks
