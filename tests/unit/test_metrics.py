"""kvtierd.metrics: the /metrics page is rendered at most once per metrics_cache_seconds."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import CollectorRegistry

from kvtierd.metrics import CachedPage


class Counting:
    """A collector whose one counter counts how often it was collected."""

    def __init__(self):
        self.collected = 0

    def collect(self):
        self.collected += 1
        yield CounterMetricFamily("kvtierd_collected", "collections", value=self.collected)


def test_a_scrape_within_the_period_gets_the_same_page_without_a_collection():
    # Issue 11 item 8: every scrape took a snapshot on the request loop; a scrape loop slowed it.
    registry, source, now = CollectorRegistry(auto_describe=False), Counting(), [100.0]
    registry.register(source)
    page = CachedPage(registry, 1.0, clock=lambda: now[0])
    first = page.page()
    for _ in range(100):
        now[0] += 0.005
        assert page.page() == first
    assert source.collected == 1 and b"kvtierd_collected_total 1.0" in first
    now[0] += 1.0
    assert b"kvtierd_collected_total 2.0" in page.page() and page.renders == 2

    status = []
    body = page({"PATH_INFO": "/metrics"}, lambda s, headers: status.append(s))
    assert status == ["200 OK"] and body == [page.page()]
    assert page({"PATH_INFO": "/other"}, lambda s, headers: status.append(s)) and status[-1].startswith("404")


def test_the_second_tier_exports_every_error_and_call_series_before_the_first_call():
    # Issue 27 item 2: kvtierd_tier_errors_total{op,code} had no sample before a first failure, so
    # increase() could not see it. Compared with every series the code can emit (test_deploy).
    import dataclasses

    from kvtierd.metrics import DaemonCollector
    from tests.unit.test_deploy import snapshot, tier_snapshot
    full = snapshot("mlock")
    fresh = dataclasses.replace(full, tier={**tier_snapshot(), "errors": [], "call_seconds": {}})

    def series(reply):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in DaemonCollector(lambda: reply).collect() if family.name.startswith("kvtierd_tier_")
                for s in family.samples}

    every, at_start = series(full), series(fresh)
    counted = [key for key in every if key[0].endswith(("_total", "_count", "_bucket"))]
    assert counted and all(key in at_start for key in counted), sorted(set(counted) - set(at_start))
    assert at_start[("kvtierd_tier_errors_total", (("code", "timeout"), ("op", "get")))] == 0
