"""The worker's runtime: the wiring a worker, beat or Flower process adds to the Celery app when it starts.

`celery -A pipeline ...` resolves `pipeline.app` to `worker_app()`: the configured app from
`pipeline.celery_app` plus, once per process, the signal handlers (`signals`: dead-letter capture,
metrics and their endpoint, logs, Sentry, the delayed-job releaser), the admission check of cluster-wide
rate limits, the speed-only replacements of Celery's and kombu's internals (`pipeline.compat`: the task context's
custom headers, kombu's JSON decoding, how a solo worker starts a job), Flower's authentication (`flower_auth`),
the worker process class (`worker`), the delivery layer (`pipeline.delivery`: the job request class and the
delivery bootstep that owns the worker's leases, so a job whose lease was lost is not run here), the cancel
listener that drops or stops the cancelled jobs the worker holds (`cancels`), the watch that stops the jobs whose
lease cannot be renewed before it lapses (`lapses`), the stall
watchdog (`stall`), and task events that follow Flower's requests (`events`). Producers (CLI, API) never install
any of this.
"""

from __future__ import annotations

from celery import Celery

from pipeline.celery_app import get_app
from pipeline.compat import context, serialization
from pipeline.compat.strategy import STRATEGY
from pipeline.delivery.fencing import DeliveryStep
from pipeline.delivery.request import REQUEST_CLASS
from pipeline.flows import steps as flow_steps
from pipeline.runtime import events, flower_auth, signals
from pipeline.runtime.cancels import CancelStep
from pipeline.runtime.events import EventsLease
from pipeline.runtime.lapses import LapseStep
from pipeline.runtime.stall import StallWatchdog
from pipeline.runtime.worker import PromptShutdown, Worker
from pipeline.scheduling import ratelimit
from pipeline.task import ADMISSION, FLOW_STEPS, PipelineTask


def install() -> None:
    """Connect the worker's handlers and checks (idempotent)."""
    signals.install()
    flower_auth.install()
    events.install()
    context.install()
    serialization.install()
    if ratelimit.admit not in ADMISSION:
        ADMISSION.append(ratelimit.admit)
    if flow_steps.run not in FLOW_STEPS:
        FLOW_STEPS.append(flow_steps.run)


def uninstall() -> None:
    signals.uninstall()
    context.uninstall()
    serialization.uninstall()
    if ratelimit.admit in ADMISSION:
        ADMISSION.remove(ratelimit.admit)
    if flow_steps.run in FLOW_STEPS:
        FLOW_STEPS.remove(flow_steps.run)


def worker_app() -> Celery:
    """The app with the worker's runtime installed: what `celery -A pipeline` runs."""
    app = get_app()
    install()
    # `celery worker` instantiates `app.Worker`: ours shuts down at once when idle (`worker.Worker`).
    app.Worker = app.subclass_with_self(Worker)  # type: ignore[misc]  # a cached property, settable
    app.steps["worker"].add(PromptShutdown)
    # Leases on every delivery, renewed by a thread of this process; a job whose lease a peer took is
    # neither run nor acknowledged here (`pipeline.delivery`).
    PipelineTask.Request = REQUEST_CLASS
    app.Task.Request = REQUEST_CLASS
    # A solo worker starts a job with Celery's own calls in a row, not through the pool's layers
    # (`pipeline.compat.strategy`).
    PipelineTask.Strategy = STRATEGY
    app.Task.Strategy = STRATEGY
    app.steps["worker"].add(DeliveryStep)
    # Cancelled jobs this worker holds are dropped, the one it runs is stopped (`cancels`, `pipeline.control.cancel`).
    app.steps["worker"].add(CancelStep)
    # A job whose lease cannot be renewed (Redis unreachable) is stopped before the lease lapses (`lapses`).
    app.steps["worker"].add(LapseStep)
    # A heartbeat file the liveness probe reads: stale when the event loop stops, stalled when queued jobs
    # wait and this worker fetches none (`stall`, `pipeline worker-health`).
    app.steps["worker"].add(StallWatchdog)
    # Task events only while Flower (or `celery control enable_events`) keeps asking for them (`events`).
    app.steps["worker"].add(EventsLease)
    return app
