"""`pipeline exporter`: queue-level gauges read from Redis at each scrape, in one ordinary process.

Serves `QUEUE_FAMILIES` of `pipeline.observability.metrics`: depth per queue (all priority sub-queues), whether it
is paused (`pipeline.scheduling.pause`), jobs in flight (kombu's `unacked` hash), age of the oldest waiting job per
queue, the dead-letter queue's size, the jobs parked until they are due (`pipeline:delayed`) with how overdue the
earliest one is, the broker's memory used against its `maxmemory` (0 when unlimited: the project's own figures, so
an alert on a full broker needs no redis_exporter) and whether it is at maxmemory now (`pipeline_redis_full`: Redis
refuses new jobs while the workers drain the backlog, `pipeline.delivery.full`), and whether the broker could be
read. Run exactly one per deployment (any number is harmless, but every one reads Redis on every scrape). It is a
custom collector on a registry of its own, so it never mixes with the multiprocess files a worker writes.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline import broker, publish
from pipeline.celery_app import get_app
from pipeline.constants import DEAD_LETTER_QUEUE
from pipeline.observability.metrics import QUEUE_FAMILIES
from pipeline.queues.routed import job_queues

log = logging.getLogger(__name__)


def _family(name: str) -> GaugeMetricFamily:
    help_text, labels = QUEUE_FAMILIES[name]
    return GaugeMetricFamily(name, help_text, labels=list(labels))


class QueueCollector(Collector):
    """The queue gauges of `queues`, by default of every queue the app routes to (`job_queues`), read at each
    scrape."""

    def __init__(self, queues: Sequence[str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.given = tuple(queues) if queues else None
        self.clock = clock

    @property
    def queues(self) -> tuple[str, ...]:
        return self.given or job_queues(get_app())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = _family("pipeline_broker_up")
        try:
            stats = broker.queue_stats((*self.queues, DEAD_LETTER_QUEUE))
            in_flight = broker.unacked_count()
            parked = publish.parked_stats(self.clock())
            memory = broker.memory_stats()
        except (redis.RedisError, OSError) as exc:
            log.warning("exporter could not read the broker: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        depth, age = _family("pipeline_queue_depth"), _family("pipeline_queue_oldest_age_seconds")
        dlq, paused = _family("pipeline_dlq_size"), _family("pipeline_queue_paused")
        for s in stats:
            if s.name == DEAD_LETTER_QUEUE:
                dlq.add_metric([], s.depth)
                continue
            depth.add_metric([s.name], s.depth)
            age.add_metric([s.name], s.oldest_age_s or 0.0)
            paused.add_metric([s.name], 1 if s.paused else 0)
        flight = _family("pipeline_queue_in_flight")
        flight.add_metric([], in_flight)
        delayed, overdue = _family("pipeline_delayed_jobs"), _family("pipeline_delayed_overdue_seconds")
        delayed.add_metric([], parked.count)
        overdue.add_metric([], parked.overdue_s)
        used, limit = _family("pipeline_redis_memory_used_bytes"), _family("pipeline_redis_memory_max_bytes")
        used.add_metric([], memory.used_bytes)
        limit.add_metric([], memory.max_bytes)
        full = _family("pipeline_redis_full")
        full.add_metric([], 1 if memory.full else 0)
        up.add_metric([], 1)
        yield from (depth, age, paused, dlq, flight, delayed, overdue, used, limit, full, up)


def registry_for(queues: Sequence[str] | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(queues))
    return registry


def run_exporter(port: int, address: str, queues: Sequence[str] | None = None) -> None:
    """Serve until SIGTERM/SIGINT (the gauges of `queues`, by default of every queue the app routes to)."""
    stop = threading.Event()

    def on_signal(*_: Any) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server, _thread = start_http_server(port, address, registry_for(queues))
    shown = ", ".join(queues) if queues else "every queue the app routes to"
    log.info("exporter on http://%s:%d/metrics for %s", address, port, shown)
    print(f"pipeline exporter listening on http://{address}:{port}/metrics", flush=True)
    stop.wait()
    server.shutdown()
