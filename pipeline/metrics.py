"""Metric definitions (names, labels, buckets). No business logic lives here.

Names use base units and `_total` for counters; labels are `task`, `queue`, `outcome`, `exception`
(and `handler` for the signal-handler error counter) — never ids, addresses or host names.
"""

from __future__ import annotations

from prometheus_client import Counter

signal_handler_errors = Counter(
    "pipeline_signal_handler_errors",
    "Exceptions raised inside pipeline signal handlers (Celery would otherwise swallow them).",
    ["handler"],
)

rate_limit_throttled = Counter(
    "pipeline_rate_limit_throttled",
    "Jobs deferred by a cluster-wide rate limit to a later slot (not failures, not retries).",
    ["task"],
)
