"""What a failure means for the job, decided once where the error is raised.

::

    PipelineError
    ├── TransientError        retried with exponential backoff and jitter (see pipeline.retry)
    └── PermanentError        never retried: the job goes straight to the dead-letter queue
        ├── PayloadInvalid    the payload failed validation (at enqueue, or on the worker for foreign clients)
        └── DeliveryLimitExceeded  delivered more than MAX_DELIVERIES times without an outcome (a worker-killing job)

    BrokerWriteRefused        the broker did not take a write as durable (an enqueue fails; nothing is retried
    ├── NotReplicated         fewer replicas than REDIS_WAIT_REPLICAS confirmed it within REDIS_WAIT_TIMEOUT_MS
    └── BrokerFull            Redis is at maxmemory (policy noeviction) and refused it

    PriorityInvalid           a job's priority is not an integer from 0 to 9 (refused at enqueue; nothing is sent)

    ConfigError               the process's settings are invalid; it stops at start with one clear message

    JobCancelled              raised inside a running job that was cancelled (`pipeline cancel`): Celery's Ignore,
                              so the job is neither a failure nor dead-lettered; its state is `cancelled`
    LeaseLost                 raised inside a running job whose lease this worker could not renew before it lapses
                              (cut off from Redis): Celery's Ignore; the attempt is abandoned here (nothing stored,
                              acknowledged, retried or dead-lettered: the job runs again once its lease has lapsed)

Tasks raise these from their pure logic (or declare third-party exceptions as transient in their
`RetryPolicy`). Celery's own control-flow exceptions (Retry, Ignore, Reject) are not failures.
Every exception keeps its arguments in `args`, so it survives JSON serialisation in the result backend.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import Ignore


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose."""


class TransientError(PipelineError):
    """A failure that may pass: connection refused, timeout, 5xx, SMTP 4xx. The job is retried.

    `retry_after` (seconds) sets the earliest next attempt, e.g. from an HTTP Retry-After header: the
    retry waits the longer of it and the policy's backoff (a wait longer than a worker holds a message,
    RETRY_MAX_DELAY, is parked like a delayed job).
    """

    def __init__(self, *args: Any, retry_after: float | None = None) -> None:
        super().__init__(*args)
        self.retry_after = retry_after


class PermanentError(PipelineError):
    """A failure that will not pass by retrying: bad input, 4xx, missing template, corrupt file."""


class PayloadInvalid(PermanentError):
    """The payload does not match the task's model. `errors` holds pydantic's error list (JSON-safe)."""

    def __init__(self, task: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(task, errors)
        self.task = task
        self.errors = errors

    def __str__(self) -> str:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ())) or '<payload>'}: {e.get('msg')}" for e in self.errors]
        return f"invalid payload for {self.task}: " + "; ".join(parts)


class DeliveryLimitExceeded(PermanentError):
    """The message was delivered more than MAX_DELIVERIES times and no delivery ended with an outcome: each time,
    the worker holding it stopped (out of memory, a native crash, kill -9). It is dead-lettered, not run again."""


class JobCancelled(Ignore):
    """The job was cancelled while it ran (a solo worker raises it in the job: `pipeline.runtime.cancels`). Celery
    treats an `Ignore` as control flow: nothing is stored as a failure, nothing is dead-lettered; the worker records
    the job as cancelled. A job that catches it and goes on finishes, but its result is not stored over `cancelled`."""


class WorkerStopping(JobCancelled):
    """The worker stopped the job at a shutdown: it could not finish within the soft-shutdown timeout. Nothing of it is
    stored or acknowledged: its message goes back to its queue when the worker closes its connection, and it runs
    again (on a peer, or here once restarted)."""


class LeaseLost(Ignore):
    """This worker could not renew the job's lease in time (see docs/leases.md, "Cut off from Redis"): raised in the
    running job before the lease lapses, the way a soft time limit is. Celery's `Ignore`: the job is neither a failure
    nor retried nor dead-lettered, and nothing of it is stored or acknowledged here: the attempt is abandoned, and the
    job runs again (on a peer, or here) once its lease has lapsed. A job may clean up, but must not go on: past the
    lapse its process is stopped (`pipeline.runtime.lapses`)."""


class PriorityInvalid(PipelineError, ValueError):
    """A job's priority is not an integer from 0 (most urgent) to 9: refused at enqueue, nothing is published."""


class BrokerWriteRefused(PipelineError):
    """The broker did not take a producer's write as durable: the caller gets an error, never a job id."""


class NotReplicated(BrokerWriteRefused):
    """Fewer than REDIS_WAIT_REPLICAS replicas confirmed a write within REDIS_WAIT_TIMEOUT_MS. The write reached the
    primary and may survive, or be lost with it in a failover: retry with the same idempotency key, which never
    makes a second job."""

    def __init__(self, reached: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(reached, wanted, timeout_ms)
        self.reached, self.wanted, self.timeout_ms = reached, wanted, timeout_ms

    def __str__(self) -> str:
        return (
            f"only {self.reached} of {self.wanted} Redis replica(s) confirmed the write within {self.timeout_ms} ms "
            "(REDIS_WAIT_REPLICAS): it may be lost in a failover; retry (with the same idempotency key)"
        )


class BrokerFull(BrokerWriteRefused):
    """Redis is at `maxmemory` and refused a write (OOM): nothing was stored. Workers drain the backlog meanwhile."""

    def __str__(self) -> str:
        detail = f" ({self.args[0]})" if self.args else ""
        return f"the broker is out of memory (Redis maxmemory reached){detail}; nothing was stored, retry later"


class ConfigError(SystemExit):
    """Invalid settings. A SystemExit, so the process stops with the message and no traceback."""
