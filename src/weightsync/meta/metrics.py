"""Prometheus metrics of one meta server (``GET /metrics``).

Request counters and latencies are recorded by the server's middleware; job gauges (participants,
latest version, reader lag, time since the last sync, each reader's validity: invalid since when,
its failed version and error) are computed from the state at scrape
time, so they are never stale and cost nothing between scrapes. Each server has its own
registry, so several embedded servers in one process do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weightsync.meta.state import MetaState
from weightsync.meta.views import completion_rows

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StateCollector(Collector):
    def __init__(self, state: MetaState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        participants = GaugeMetricFamily("weightsync_meta_participants", "registered participants",
                                         labels=["job", "role"])
        latest = GaugeMetricFamily("weightsync_meta_latest_version", "latest published version", labels=["job"])
        max_lag = GaugeMetricFamily("weightsync_meta_reader_max_lag_versions",
                                    "largest (latest - applied) over readers with a valid version", labels=["job"])
        invalid = GaugeMetricFamily("weightsync_meta_readers_without_valid_version",
                                    "readers that never applied a version or reported a failure", labels=["job"])
        since = GaugeMetricFamily("weightsync_meta_seconds_since_last_sync",
                                  "seconds since a reader last reported an applied version", labels=["job"])
        mixed = GaugeMetricFamily("weightsync_meta_reader_invalid",
                                  "1 while a failed update leaves the reader's engine serving a mix of versions "
                                  "(until a later version is applied in full), else 0", labels=["job", "rank"])
        mixed_since = GaugeMetricFamily("weightsync_meta_reader_invalid_since_seconds",
                                        "unix time at which an invalid reader became invalid", labels=["job", "rank"])
        mixed_info = GaugeMetricFamily("weightsync_meta_reader_invalid_info",
                                       "an invalid reader's failed version and error (first 200 characters)",
                                       labels=["job", "rank", "version", "error"])
        applied = GaugeMetricFamily("weightsync_meta_completion_applied_readers",
                                    "readers that applied the newest version decided under a quorum or fraction "
                                    "policy", labels=["job", "version"])
        missed = GaugeMetricFamily("weightsync_meta_completion_missed_readers",
                                   "readers that missed the newest version decided under a quorum or fraction policy "
                                   "(failed it, died, or still applying when the quorum was met)",
                                   labels=["job", "version"])
        failed = GaugeMetricFamily("weightsync_meta_completion_failed_versions",
                                   "of the newest versions kept, those whose policy was not met", labels=["job"])
        now = time.time()
        for name, job in sorted(self.state.jobs.items()):
            completions = [c for c in completion_rows(job, []) if "error" not in c]
            if completions:
                newest = completions[0]
                applied.add_metric([name, str(newest["version"])], len(newest["applied"]))
                missed.add_metric([name, str(newest["version"])], len(newest["missed"]))
                failed.add_metric([name], sum(1 for c in completions if c["state"] == "failed"))
            for role, rows in job.rows.items():
                participants.add_metric([name, role], len(rows))
            if job.latest is not None:
                latest.add_metric([name], job.latest.version)
            readers = self.state.readers(name)
            lags = [r["lag"] for r in readers if r["lag"] is not None]
            if lags:
                max_lag.add_metric([name], max(lags))
            invalid.add_metric([name], sum(1 for r in readers if r["version"] is None))
            synced = [r["last_sync_at"] for r in readers if r["last_sync_at"] is not None]
            if synced:
                since.add_metric([name], now - max(synced))
            for r in readers:
                rank = str(r["rank"])
                mixed.add_metric([name, rank], float(r["state"] == "invalid"))
                if r["state"] == "invalid":
                    mixed_since.add_metric([name, rank], r["invalid_since"])
                    mixed_info.add_metric([name, rank, str(r["failed_version"]), (r["error"] or "")[:200]], 1.0)
        yield from (participants, latest, max_lag, invalid, since, mixed, mixed_since, mixed_info, applied, missed,
                    failed)
        yield GaugeMetricFamily("weightsync_meta_jobs", "job namespaces", value=len(self.state.jobs))
        yield GaugeMetricFamily("weightsync_meta_waiting_requests", "long-polls being held",
                                value=self.state.watch.waiting)
        store = self.state.store
        if store.durable:
            yield CounterMetricFamily("weightsync_meta_store_commits", "changes committed (an fsynced transaction "
                                      "each)", value=store.stats.commits)
            yield CounterMetricFamily("weightsync_meta_store_commit_seconds", "time spent committing",
                                      value=store.stats.commit_seconds)
            yield GaugeMetricFamily("weightsync_meta_store_log_bytes", "changes logged since the last compaction",
                                    value=store.stats.log_bytes)


class ServerMetrics:
    """The registry of one server: request metrics plus the state collector."""

    def __init__(self, state: MetaState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("weightsync_meta_requests", "HTTP requests", ["route", "method", "status"],
                                registry=self.registry)
        self.latency = Histogram("weightsync_meta_request_seconds", "HTTP request latency (long-polls included)",
                                 ["route"], registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30))
        self.registry.register(_StateCollector(state))

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
