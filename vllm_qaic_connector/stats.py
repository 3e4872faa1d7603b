"""Transfer counters, gauges and timings, reported through vLLM's KV-connector stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS = {
    "loaded_requests": "Requests whose prompt KV was loaded from a prefill engine",
    "loaded_tokens": "Prompt tokens whose KV was loaded from a prefill engine",
    "load_failures": "Requests whose KV load failed (handled by kv_load_failure_policy)",
    "saved_requests": "Requests whose KV was staged for a decode engine",
    "saved_tokens": "Tokens whose KV was staged for a decode engine",
    "bytes_copied": "KV bytes copied by the connector (staging writes and loads)",
    "read_descriptors": "Transport reads (NIXL descriptors) by loads, ticket headers included",
    "direct_reads": "Loads copied straight out of the prefill's KV cache, without staging",
    "lease_expiries": "Staged requests whose lease ran out before every decode read them (prefill)",
    "handshakes": "Handshakes completed with peer engines",
    "preempted_handoffs": "Prompts preempted once staging began, resumed from there (prefill)",
    "kept_turns": "Finished turns whose KV a decode kept for the conversation's next prefill",
    "evicted_turns": "Kept turns released early because running requests needed the blocks",
}

# Counted per prefill engine the KV came from: ``loaded_requests_from:<engine_id>``.
PER_PEER_PREFIX = "loaded_requests_from:"
PER_PEER_DOC = "Requests whose prompt KV was loaded, by the prefill engine it came from"

# Latest value wins when aggregating; exported as Prometheus gauges.
GAUGES = {
    "staging_pages_in_use": "Staging pool pages held by staged requests (prefill)",
    "staging_pages_total": "Staging pool size in pages (prefill)",
}


# One sample per request; exported as Prometheus histograms ``vllm:qaic_kv_<name>``.
HISTOGRAMS = {
    "load_seconds": "Time from a load's start to its KV in the decode's blocks",
    "read_seconds": "Of a load's time, the transport's reads (NIXL READs; shm: none)",
    "save_seconds": "Time to stage a finished prompt's KV (prefill; direct: its ticket only)",
}
SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]


@dataclass
class QAICConnectorStats(KVConnectorStats):
    def add(self, name: str, value: int = 1) -> None:
        if value:  # a zero would make the stats non-empty for nothing
            self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = {}

    def set(self, name: str, value: int) -> None:
        self.data[name] = value

    def sample(self, name: str, value: float) -> None:
        self.data.setdefault(name, []).append(value)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in GAUGES:
                self.set(key, value)
            elif key in HISTOGRAMS:
                self.data.setdefault(key, []).extend(value)
            else:
                self.add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: counters as they are, timings as count and mean ms."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if key in HISTOGRAMS:
                out[f"{key}_count"] = len(value)
                out[f"{key}_mean_ms"] = round(1000 * sum(value) / max(len(value), 1), 3)
            else:
                out[key] = value
        return out

    def is_empty(self) -> bool:
        return not self.data


class QAICPromMetrics(KVConnectorPromMetrics):
    """Exposes the counters as ``vllm:qaic_kv_<name>_total``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls: Any, docs: dict[str, str], **kw: Any) -> dict[str, dict[int, Any]]:
            """One metric per name, labelled once per engine."""
            out = {}
            for name, doc in docs.items():
                metric = cls(
                    name=f"vllm:qaic_kv_{name}", documentation=doc, labelnames=labelnames, **kw
                )
                out[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
            return out

        self._counters = per_engine(self._counter_cls, COUNTERS)
        self._gauges = per_engine(self._gauge_cls, GAUGES, multiprocess_mode="mostrecent")
        self._histograms = per_engine(self._histogram_cls, HISTOGRAMS, buckets=SECONDS_BUCKETS)
        self._per_peer: Any = self._counter_cls(
            name="vllm:qaic_kv_loaded_requests_by_peer",
            documentation=PER_PEER_DOC,
            labelnames=[*labelnames, "remote_engine"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name.startswith(PER_PEER_PREFIX):
                peer = name[len(PER_PEER_PREFIX) :]
                self._per_peer.labels(*self.per_engine_labelvalues[engine_idx], peer).inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
            elif name in self._histograms:
                for seconds in value:
                    self._histograms[name][engine_idx].observe(seconds)
            elif name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
