"""The worker's `/metrics` endpoint: one HTTP server per worker node, in the worker's main process.

Started from `worker_ready` (after the pool has forked) on `METRICS_PORT`. The pool's processes record
into prometheus-client's multiprocess directory (`multiproc`): the one the start scripts
(`deploy/docker/start-worker*`) set and wipe, or, for a plain `celery -A pipeline worker`, a fresh one
the worker prepares in `celeryd_init` before the pool forks. The endpoint serves the sum of every
process's files, whatever the pool (prefork, threads, solo, gevent).

A prefork worker that has no directory (an embedded `WorkController`, which sends no `celeryd_init`, or a
directory that could not be created) would count each child into its own memory and report (almost)
nothing, so its metrics are **off** and it logs a warning saying so. Other pools without a directory
serve the ordinary registry: one process records everything.

Dead children: `worker_process_shutdown` (in the child, not guaranteed to run) marks the child dead,
and a sweep thread here marks every PID whose files remain but whose process is gone.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, multiprocess, start_http_server

from pipeline.config import get_settings
from pipeline.observability import metrics, multiproc
from pipeline.pools import pool_kind

log = logging.getLogger(__name__)
_PID_FILE = re.compile(r"_(\d+)\.db$")
_state: dict[str, Any] = {}


def multiprocess_dir() -> Path | None:
    return multiproc.directory()


def _consumed_queues(consumer: Any) -> list[str]:
    return sorted(str(name) for name in consumer.app.amqp.queues.consume_from)


def serve_worker_metrics(consumer: Any) -> None:
    """Start the endpoint for this worker node (no-op when METRICS_PORT is unset)."""
    settings = get_settings()
    directory = multiprocess_dir()
    if settings.metrics_port is None:
        if directory is not None:  # a supervisor serves the directory (`pipeline worker --processes`)
            _mark_up(consumer)
        log.info("METRICS_PORT is not set: this worker serves no /metrics endpoint")
        return
    if directory is None and pool_kind(getattr(consumer, "pool", None)) == "prefork":
        log.warning(
            "worker metrics are OFF: the prefork pool needs a multiprocess directory so that its child "
            "processes' figures can be added up. `celery worker` prepares one when METRICS_PORT is set "
            "(see the log above if it failed), or set PROMETHEUS_MULTIPROC_DIR to an empty directory."
        )
        return
    serve(directory, settings.metrics_port)
    _mark_up(consumer)
    log.info(
        "worker metrics on http://%s:%d/metrics (multiprocess directory: %s)",
        settings.metrics_address,
        settings.metrics_port,
        directory or "none, one process records everything",
    )


def serve(directory: Path | None, port: int) -> None:
    """Serve `directory`'s files added up (and sweep its dead PIDs), or this process's registry, on `port`."""
    settings = get_settings()
    registry: CollectorRegistry = REGISTRY
    if directory is not None:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]  # untyped
        _start_sweeper(directory, settings.metrics_sweep_interval)
    server, _thread = start_http_server(port, settings.metrics_address, registry)
    _state["server"] = server


def _mark_up(consumer: Any) -> None:
    for queue in _consumed_queues(consumer):
        metrics.workers_up.labels(queue=queue).set(1)


def mark_dead(pid: int) -> None:
    """Drop a finished process's live gauges (its counters stay, so totals never go backwards)."""
    directory = multiprocess_dir()
    if directory is not None:
        multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]  # untyped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(directory: Path, swept: set[int]) -> list[int]:
    """Mark every PID with files in `directory` whose process is gone; return the PIDs marked now."""
    found = {int(m.group(1)) for f in directory.glob("*.db") if (m := _PID_FILE.search(f.name))}
    dead = sorted(pid for pid in found - swept if pid != os.getpid() and not _alive(pid))
    for pid in dead:
        multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]  # untyped
        swept.add(pid)
    return dead


def _start_sweeper(directory: Path, interval: float) -> None:
    swept: set[int] = set()

    def loop() -> None:
        while not stop.wait(interval):
            try:
                sweep(directory, swept)
            except OSError:
                log.exception("metrics sweep of %s failed", directory)

    stop = threading.Event()
    _state["stop"] = stop
    threading.Thread(target=loop, name="metrics-sweeper", daemon=True).start()
