"""Metric definitions (names, labels, buckets). No business logic lives here.

Names use base units and `_total` for counters; labels are `task`, `queue`, `outcome`, `exception`
(and `handler` for the signal-handler error counter; `flow` and `step` for flows, only declared names) — never ids,
addresses or host names.

Two kinds of figures:

* per-process families below (task outcomes, runtimes, queue wait, ...). Worker processes record
  them; prometheus-client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`: set by the start scripts,
  or prepared by the worker itself, `pipeline.observability.multiproc`) sums the pool children's files
  and the worker's main process serves them (`pipeline.observability.endpoint`). Keep every family
  labelled: the worker switches to multiprocess mode after this module is imported, which is safe only
  while no family holds a value.
* queue-level gauges (`QUEUE_FAMILIES`), read from Redis at scrape time by the single-process
  `pipeline exporter` (`pipeline.observability.exporter`): custom collectors do not work in multiprocess mode.
"""

from __future__ import annotations

from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram

#: Outcomes of `pipeline_tasks_total`.
#: `cancelled`: a job cancelled (`pipeline cancel`, or Celery's revoke) that a worker dropped unrun or stopped.
OUTCOMES: Final = ("succeeded", "failed", "retried", "rejected", "cancelled", "dead_lettered")
#: Task label for messages whose name is not a registered task (keeps the label set bounded).
UNREGISTERED: Final = "unregistered"

tasks = Counter(
    "pipeline_tasks",
    "Task executions by outcome: succeeded, failed, retried, rejected, cancelled, dead_lettered.",
    ["task", "queue", "outcome"],
)
task_runtime = Histogram(
    "pipeline_task_runtime_seconds",
    "Wall time of one task attempt, from start to end, whatever its outcome.",
    ["task", "queue"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
task_queue_wait = Histogram(
    "pipeline_task_queue_wait_seconds",
    "Time from publish (or from its countdown/ETA, when later) to start of an attempt.",
    ["task", "queue"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
signal_handler_errors = Counter(
    "pipeline_signal_handler_errors",
    "Exceptions raised inside pipeline signal handlers (Celery would otherwise swallow them).",
    ["handler"],
)
workers_up = Gauge(
    "pipeline_workers_up",
    "Worker nodes up and consuming each queue (1 per node; summed across a node's processes).",
    ["queue"],
    multiprocess_mode="livesum",
)
rate_limit_throttled = Counter(
    "pipeline_rate_limit_throttled",
    "Attempts the cluster-wide rate limiter made wait (the task was deferred, not failed).",
    ["task"],
)
leases = Counter(
    "pipeline_leases",
    "Lease events of a worker: lost (a peer took the job; not run or acknowledged here), restored (a sweep put a"
    " job whose lease expired back on its queue), released (a prefetched job dropped with a lost connection), lapsed"
    " (given up: it could not be renewed before it lapsed; its job is stopped here).",
    ["outcome"],
)
jobs_abandoned = Counter(
    "pipeline_jobs_abandoned",
    "Attempts given up before their end: a job stopped because this worker could not renew its lease before it"
    " lapsed (LeaseLost: it runs again once the lease has lapsed), or an asyncio pool job that ignored its"
    " cancellation (a time limit or a cancel) and was left running (the worker process is recycled after each).",
    ["task"],
)
flows = Counter(
    "pipeline_flows",
    "Flows by outcome: started (the first job of its first step began its first run), succeeded (its last job was"
    " recorded), failed (a step's job was dead-lettered while no other was: replaying it lets the flow go on).",
    ["flow", "outcome"],
)
flow_steps = Counter(
    "pipeline_flow_steps",
    "Jobs of flow steps (a fan-out's items) by outcome: started (first run), succeeded (its result recorded in the"
    " flow, once per job), dead_lettered.",
    ["flow", "step", "outcome"],
)
flow_step_duration = Histogram(
    "pipeline_flow_step_duration_seconds",
    "Wall time of a flow step, from when it was queued to when its last job (a fan-out's last item) was recorded.",
    ["flow", "step"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)

#: Every per-process family above (each has labels, so none holds a value before `.labels()`).
FAMILIES: Final = (
    tasks,
    task_runtime,
    task_queue_wait,
    signal_handler_errors,
    workers_up,
    rate_limit_throttled,
    leases,
    jobs_abandoned,
    flows,
    flow_steps,
    flow_step_duration,
)

_children: dict[tuple[Any, ...], Any] = {}


def child(family: Any, *labels: str) -> Any:
    """`family.labels(*labels)`, kept per process: the per-job figures skip prometheus-client's label checks and
    lock. `forget_children` empties it when the families are cleared (`pipeline.observability.multiproc`)."""
    key = (family, *labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = family.labels(*labels)
    return found


def forget_children() -> None:
    _children.clear()


#: name → (help, labels) of the gauges `pipeline exporter` serves; read from Redis on every scrape.
QUEUE_FAMILIES: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "pipeline_queue_depth": ("Jobs waiting in the queue, summed over its priority sub-queues.", ("queue",)),
    "pipeline_queue_in_flight": ("Jobs delivered to workers and not yet acknowledged (all queues).", ()),
    "pipeline_queue_oldest_age_seconds": ("Age of the oldest waiting job (0 when the queue is empty).", ("queue",)),
    "pipeline_queue_paused": (
        "1 while the queue is paused (it accepts jobs, no worker starts one), else 0.",
        ("queue",),
    ),
    "pipeline_dlq_size": ("Envelopes in the dead-letter queue.", ()),
    "pipeline_delayed_jobs": ("Jobs parked in Redis until they are due (delays, deferrals, long retries).", ()),
    "pipeline_delayed_overdue_seconds": ("How long ago the most overdue parked job was due (0 when none is).", ()),
    "pipeline_redis_memory_used_bytes": ("Memory the broker's Redis uses (INFO memory: used_memory).", ()),
    "pipeline_redis_memory_max_bytes": (
        "The broker's maxmemory (0: no limit). At it, with noeviction, Redis refuses new jobs.",
        (),
    ),
    "pipeline_redis_full": (
        "1 while the broker's Redis is at maxmemory (used memory above it as Redis counts it), else 0: with noeviction "
        "it refuses new jobs while workers drain the backlog.",
        (),
    ),
    "pipeline_broker_up": ("1 when the exporter could read the broker on this scrape, else 0.", ()),
}
