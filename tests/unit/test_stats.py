"""The connector's stats: aggregation across workers and steps, and their Prometheus export
with prometheus_client's own metric classes (the live servers' /metrics are scraped by
tests/live/test_faults.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_qaic_connector.stats import QAICConnectorStats, QAICPromMetrics


def test_counters_add_gauges_keep_the_latest_and_timings_pool_their_samples():
    a, b = QAICConnectorStats(), QAICConnectorStats()
    a.add("loaded_requests"), a.set("staging_pages_in_use", 5), a.sample("load_seconds", 0.01)
    b.add("loaded_requests", 2), b.set("staging_pages_in_use", 3), b.sample("load_seconds", 0.03)
    b.add("handshakes", 0)  # nothing happened: must not make the stats non-empty
    merged = a.aggregate(b)
    assert merged.data == {
        "loaded_requests": 3, "staging_pages_in_use": 3, "load_seconds": [0.01, 0.03],
    }  # fmt: skip
    assert merged.reduce()["load_seconds_mean_ms"] == 20.0
    empty = QAICConnectorStats()
    empty.add("handshakes", 0)
    assert empty.is_empty()


def test_prometheus_export_names_every_kind_of_metric():
    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        class Registered(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, multiprocess_mode: str = "", **kw: Any) -> None:
                super().__init__(*args, registry=registry, **kw)

        return Registered

    types = {t: bound(t) for t in (Counter, Gauge, Histogram)}
    prom = QAICPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    stats = QAICConnectorStats()
    stats.add("loaded_requests", 2)
    stats.add("loaded_requests_from:pf1")
    stats.set("staging_pages_in_use", 4)
    stats.sample("save_seconds", 0.004)
    stats.sample("save_seconds", 0.3)
    prom.observe(stats.data)
    text = generate_latest(registry).decode()
    for line in (
        'vllm:qaic_kv_loaded_requests_total{engine="0"} 2.0',
        'vllm:qaic_kv_loaded_requests_by_peer_total{engine="0",remote_engine="pf1"} 1.0',
        'vllm:qaic_kv_staging_pages_in_use{engine="0"} 4.0',
        'vllm:qaic_kv_save_seconds_count{engine="0"} 2.0',
        'vllm:qaic_kv_save_seconds_bucket{engine="0",le="0.005"} 1.0',
    ):
        assert line in text.splitlines(), line
