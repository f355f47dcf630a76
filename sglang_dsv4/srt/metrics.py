"""Prometheus metrics of the V4 cache, on SGLang's ``/metrics`` endpoint (``--enable-metrics``).

Created in the scheduler process after SGLang set ``PROMETHEUS_MULTIPROC_DIR``; counters follow
the cache's own event counts, gauges its current usage, refreshed after every forward.
"""

from __future__ import annotations

from .state import SglangV4Cache

_COUNTERS = {
    "prompt_tokens_cached": "Prompt tokens served from the V4 cache (not recomputed).",
    "prompt_tokens_computed": "Prompt tokens computed by prefill (cache misses and new tokens).",
    "snapshots_taken": "Fork-point snapshots taken.",
    "snapshots_restored": "Requests resumed from a snapshot.",
    "snapshots_evicted": "Snapshots evicted by the LRU under the snapshot budget.",
    "snapshots_dropped": "Snapshots freed with their token slot (radix-tree eviction or release).",
    "integrity_checks": "Integrity checks of the V4 cache (SGLang's idle self-check; per step too when on).",
    "integrity_failures": "Integrity checks that found a leak or an inconsistency (logged).",
}
_GAUGES = {
    "snapshot_bytes": "Bytes held by snapshots.",
    "compressed_pool_bytes": "Bytes of compressed KV entries in use (C4 main + indexer, C128).",
    "rings_in_use": "Request rows holding a window ring and compressor state.",
}


class V4CacheMetrics:
    """Exports ``sglang_dsv4:*`` series for one cache."""

    def __init__(self, cache: SglangV4Cache, labels: dict[str, str] | None = None):
        from prometheus_client import Counter, Gauge

        self.cache, self.labels = cache, labels or {}
        names = list(self.labels)
        self.counters = {k: Counter(f"sglang_dsv4:{k}", doc, labelnames=names) for k, doc in _COUNTERS.items()}
        self.gauges = {k: Gauge(f"sglang_dsv4:{k}", doc, labelnames=names, multiprocess_mode="mostrecent")
                       for k, doc in _GAUGES.items()}
        self._seen = {k: 0 for k in _COUNTERS}

    def update(self) -> None:
        for k, counter in self.counters.items():
            now = self.cache.stats[k]
            if now > self._seen[k]:
                (counter.labels(**self.labels) if self.labels else counter).inc(now - self._seen[k])
                self._seen[k] = now
        usage = self.cache.usage()
        values = {"snapshot_bytes": usage["snapshot_bytes"],
                  "compressed_pool_bytes": usage["compressed_bytes"],
                  "rings_in_use": usage["rings_in_use"]}
        for k, gauge in self.gauges.items():
            (gauge.labels(**self.labels) if self.labels else gauge).set(values[k])
