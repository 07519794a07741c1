"""Observability: what the pipeline tells operators.

- `metrics`: every Prometheus metric the pipeline defines (names, labels, buckets) in one place.
- `task_metrics`: task outcomes, runtimes and queue wait, counted from Celery's signals.
- `endpoint`: the worker node's /metrics endpoint (prometheus-client multiprocess mode for prefork children).
- `multiproc`: the multiprocess directory a worker started without one prepares before its pool forks.
- `exporter`: `pipeline exporter`, queue depth, in-flight jobs, oldest job age and DLQ size read from Redis.
- `logs`: structured (JSON) logs with the task bound, secrets scrubbed.
- `sentry`: error reports with payloads and secrets scrubbed.
"""
