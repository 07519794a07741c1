"""The typed task contract: one validated payload in, one result model out, retries by policy.

A task module declares its work as a plain function and lets `typed_task` make the Celery task::

    @typed_task("email.send", payload=EmailJob, result=EmailResult, transient=(smtplib.SMTPServerDisconnected,))
    def send(job: EmailJob, ctx: JobContext) -> EmailResult: ...

    enqueue = send.enqueue        # typed producer: validates, then publishes

On the wire the task takes exactly one positional argument, the payload as a JSON object, and returns
the result model as a JSON object, so any Celery client can call it with
``send_task("email.send", args=[{...}])``. A payload that fails validation on the worker (a foreign
client's mistake) raises `PayloadInvalid`, a permanent error: no retry, straight to the dead-letter queue.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Generic, Protocol, TypeVar

from celery import Celery, Task, shared_task
from celery.exceptions import Retry
from celery.result import AsyncResult
from pydantic import BaseModel, TypeAdapter, ValidationError

from pipeline import publish
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import DELIVERY_HEADERS, HEADER_FLOW, HEADER_IDEMPOTENCY_KEY, HEADER_RATE_SLOT, TASK_MODULES
from pipeline.errors import JobCancelled, LeaseLost, PayloadInvalid, PermanentError
from pipeline.fairness import groups
from pipeline.fairness.rates import ClusterRate
from pipeline.pools import aio
from pipeline.producer import write
from pipeline.queues.priority import check as check_priority
from pipeline.retry import RetryPolicy

P = TypeVar("P", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)

#: A typed task's function: `fn(payload, ctx) -> result`, or `async def` (`pipeline.pools.aio` runs its coroutine).
JobFunction = Callable[[Any, "JobContext"], BaseModel | Awaitable[BaseModel]]

#: Every typed task of this process by kind; filled as task modules are imported (see `load_task_modules`).
REGISTRY: dict[str, TypedTask[Any, Any]] = {}
#: Checks a job passes before its function runs, each `check(task, job)`; one that defers the job raises
#: Celery's `Ignore`. The worker's runtime installs the cluster-wide rate limiter here
#: (`pipeline.scheduling.ratelimit.admit`); a producer process runs no task and needs none.
ADMISSION: list[Callable[[PipelineTask, Any], None]] = []


class Guard(Protocol):
    """Wraps each run of a task's function: `start(task)` before it, `stop()` after it, however it ended. One object
    per process (guards are installed where a job at a time runs: the solo pool): a method call per job."""

    def start(self, task: PipelineTask) -> None: ...

    def stop(self) -> None: ...


#: Runs a job that is a step of a flow (its message carries HEADER_FLOW): `step(task, header, payload, run)`, where
#: `run(payload)` runs the job as any other; the worker's runtime installs `pipeline.flows.steps.run` here.
FLOW_STEPS: list[Callable[[PipelineTask, Any, Any, Callable[[Any], dict[str, Any]]], dict[str, Any]]] = []

#: Guards around each run of a task's function, outermost first. The worker's runtime installs the solo pool's
#: time limits (`pipeline.runtime.timelimits`) and its heartbeat keep-alive (`pipeline.runtime.stall`) here.
GUARDS: list[Guard] = []


def request_header(request: Any, name: str) -> Any:
    """A custom message header of a task request (`HEADER_*` of `pipeline.constants`), or None.

    Celery makes each header of a message an attribute of the task's request, whatever path the message took (a
    first publish, Celery's own retry, a re-published signature): only those are read. `request.headers` is not: a
    message with a header named `headers` of its own (`send_task(..., headers={"headers": {...}})`) gets that dict
    there, so a producer could pass through it what only a worker's fetch sets (`DELIVERY_HEADERS`).
    """
    return getattr(request, name, None)


@dataclasses.dataclass(frozen=True)
class JobContext:
    """What a task's pure function may know about its run, without importing Celery."""

    task_id: str
    attempt: int
    idempotency_key: str
    report: Callable[[str, dict[str, Any]], None] = dataclasses.field(repr=False)

    def progress(self, percent: float, eta_s: float | None = None, **extra: Any) -> None:
        """Publish a PROGRESS state (percent 0-100, seconds left) that status pages and AsyncResult show."""
        meta = {"percent": round(max(0.0, min(100.0, percent)), 1), "eta_s": eta_s, **extra}
        self.report("PROGRESS", meta)


class PipelineTask(Task):  # type: ignore[type-arg]  # the wire signature is (dict) -> dict; typing lives in TypedTask
    """Base class of every pipeline task: carries the retry policy `typed_task` gave it."""

    policy: RetryPolicy = RetryPolicy()
    #: `typed_task`'s changes to the default policy; applied when the task binds to an app (settings are
    #: read then, when a process starts, never when a task module is imported).
    policy_overrides: Mapping[str, Any] = {}
    #: A limit shared by every worker (`typed_task(cluster_rate=...)`), or None.
    cluster_limit: ClusterRate | None = None

    #: Celery options `on_bound` takes from the policy: those `typed_task` was not given explicitly.
    policy_fills: tuple[str, ...] = ()
    is_async: bool = False  #: `async def`: the asyncio pool awaits it on its event loop among the other jobs
    result_keeps_args: bool = False  #: a SUCCESS is stored without the payload (`compat.results.lean_success`)

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        cls.policy = dataclasses.replace(get_settings().retry_policy(), **cls.policy_overrides)
        # Celery's own retries (a killed pool child: task_retry_on_worker_lost) follow the same policy.
        values = {"max_retries": cls.policy.max_retries, "default_retry_delay": cls.policy.base_delay}
        for attr in cls.policy_fills:
            setattr(cls, attr, values[attr])

    def signature_from_request(self, request: Any = None, *args: Any, **options: Any) -> Any:
        """Celery's (what `retry` and a deferred job publish), without the headers a worker's fetch set on the
        delivery it came from (`DELIVERY_HEADERS`): carried over, a worker that took the new message unleased would
        store its result under the old delivery's lease owner, and be fenced."""
        signature = super().signature_from_request(request, *args, **options)
        headers = signature.options.get("headers")
        if isinstance(headers, dict):
            signature.options["headers"] = {k: v for k, v in headers.items() if k not in DELIVERY_HEADERS}
        return signature

    def job_context(self) -> JobContext:
        request = self.request
        key = request_header(request, HEADER_IDEMPOTENCY_KEY) or request.id
        task_id = str(request.id)
        return JobContext(
            task_id=task_id,
            attempt=int(request.retries or 0) + 1,
            idempotency_key=str(key),
            # By id: an async job's coroutine reports from the event loop, outside the job's request context.
            report=lambda state, meta: self.update_state(task_id=task_id, state=state, meta=meta),
        )

    def run_typed(
        self, fn: JobFunction, model: type[BaseModel], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        if len(args) != 1 or kwargs:
            raise PayloadInvalid(self.name, [{"loc": (), "msg": "takes exactly one positional argument: the payload"}])
        raw = args[0]
        step = request_header(self.request, HEADER_FLOW)
        if step is not None and FLOW_STEPS:
            return FLOW_STEPS[0](self, step, raw, lambda payload: self._run_job(fn, model, payload))
        return self._run_job(fn, model, raw)

    def _run_job(self, fn: JobFunction, model: type[BaseModel], raw: Any) -> dict[str, Any]:
        job = validate_payload(self.name, model, raw)
        try:
            for admit in ADMISSION:
                admit(self, job)  # raises Ignore after deferring the job, TransientError when it cannot tell
            return self._guarded(fn, job, 0)
        except (PermanentError, JobCancelled, LeaseLost):  # never retried, whatever the task declares transient
            raise
        except Exception as exc:
            if not self.policy.is_transient(exc):
                raise
            raise self.retry_transient(exc) from exc

    def _guarded(self, fn: JobFunction, job: Any, index: int) -> dict[str, Any]:
        """`fn(job, ctx)` as JSON, inside GUARDS[index:], nested: each stops even when an inner one raised. The guards
        watch the one job of the main thread: an async job of the asyncio pool, interleaved with others, has none."""
        if index == len(GUARDS) or aio.in_job():
            result: BaseModel = aio.resolve(fn(job, self.job_context()))  # an `async def` task's coroutine, awaited
            return result.model_dump(mode="json")
        guard = GUARDS[index]
        guard.start(self)
        try:
            return self._guarded(fn, job, index + 1)
        finally:
            guard.stop()

    def retry_transient(self, exc: Exception) -> BaseException:
        """Schedule the next attempt after `exc` (policy backoff, or longer if the error asks); return Retry."""
        retries = int(self.request.retries or 0)
        countdown = max(self.policy.delay(retries), getattr(exc, "retry_after", None) or 0.0)
        # A retry asks the rate limiter again: drop the slot a deferred job carried.
        headers = {k: v for k, v in (self.request.headers or {}).items() if k != HEADER_RATE_SLOT}
        if countdown <= get_settings().worker_hold_limit or retries >= self.policy.max_retries:
            # Celery's own retry: a worker holds it (under its lease) until it is due.
            # Past max_retries it re-raises `exc`: the job fails with its real error and is dead-lettered.
            return self.retry(exc=exc, countdown=countdown, max_retries=self.policy.max_retries, headers=headers)
        # Longer than a worker may hold a message: the next attempt is parked until it is due.
        again = self.signature_from_request(retries=retries + 1, headers=headers)
        due = time.time() + countdown
        publish.schedule(lambda producer, eta: again.apply_async(producer=producer, eta=eta), str(self.request.id), due)
        return Retry(exc=exc, when=datetime.fromtimestamp(due, UTC))


def validate_payload(name: str, model: type[P], raw: Any) -> P:
    """`raw` as `model`, or `PayloadInvalid` listing every field error."""
    if isinstance(raw, model):
        return raw
    if not isinstance(raw, Mapping):
        raise PayloadInvalid(name, [{"loc": (), "msg": f"payload must be a JSON object, got {type(raw).__name__}"}])
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        raise PayloadInvalid(name, errors) from None


class TypedTask(Generic[P, R]):
    """A registered Celery task with its models: `enqueue()` for producers, `.task` for Celery itself."""

    def __init__(self, name: str, payload: type[P], result: type[R], kind: str, public: bool = True) -> None:
        self.name = name
        self.payload_model = payload
        self.result_model = result
        #: The short name the CLI and the API use (`email`, `pdf`, ...).
        self.kind = kind
        #: False for the pipeline's own housekeeping: the API and the page do not offer it.
        self.public = public
        self._list_adapter: TypeAdapter[list[Any]] | None = None
        self._queue: tuple[Celery, str] | None = None
        REGISTRY[kind] = self

    @property
    def task(self) -> PipelineTask:
        """The Celery task, registered on the process's app (built on first use)."""
        task = get_app().tasks[self.name]
        if not isinstance(task, PipelineTask):
            raise TypeError(f"{self.name} is registered by something other than typed_task")
        return task

    @property
    def limit(self) -> ClusterRate | None:
        """The task's cluster-wide limit: a keyed one gives each message its rate key (`HEADER_RATE_KEY`)."""
        return self.task.cluster_limit

    @property
    def queue(self) -> str:
        """The queue Celery's router sends this task's jobs to: the task's own `queue` option, else the routes."""
        app = get_app()
        if self._queue is None or self._queue[0] is not app:
            own = getattr(self.task, "queue", None)  # set only when the task declares one
            self._queue = (app, str(app.amqp.router.route({"queue": own} if own else {}, self.name)["queue"].name))
        return self._queue[1]

    def validate(self, payload: P | Mapping[str, Any]) -> P:
        """`payload` as the task's model; `PayloadInvalid` if it does not match or is over MAX_PAYLOAD_BYTES."""
        return self._checked(payload)[0]

    def _checked(self, payload: P | Mapping[str, Any]) -> tuple[P, dict[str, Any], str]:
        """The validated job, its JSON-mode dict and its JSON text (what the message carries)."""
        job = validate_payload(self.name, self.payload_model, payload)
        data = job.model_dump(mode="json")
        text = json.dumps(data)
        limit = get_settings().max_payload_bytes
        if len(text) > limit:
            raise PayloadInvalid(self.name, [{"loc": (), "msg": f"payload is {len(text)} bytes; the limit is {limit}"}])
        return job, data, text

    def _send(
        self,
        producer: Any,
        task_id: str,
        payload: dict[str, Any],
        headers: dict[str, Any],
        eta: datetime | None,
        priority: int | None = None,
    ) -> Any:
        """Celery's own publish of one job (captured by `pipeline.producer`, never sent from here)."""
        options: dict[str, Any] = {k: v for k, v in (("eta", eta), ("priority", priority)) if v is not None}
        options.update(publish.declare_option())
        return self.task.apply_async((payload,), task_id=task_id, headers=headers, producer=producer, **options)

    def _sender(self, priority: int | None) -> write.Send:
        """`_send` at `priority` (checked first: `PriorityInvalid`); None: Celery's task_default_priority."""
        return self._send if priority is None else functools.partial(self._send, priority=check_priority(priority))

    def enqueue(
        self,
        payload: P | Mapping[str, Any],
        *,
        countdown: float | None = None,
        eta: datetime | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
        group: str | None = None,
    ) -> str:
        """Validate `payload` and publish it at `priority` (0 most urgent .. 9; None: TASK_DEFAULT_PRIORITY;
        `pipeline.queues.priority`); return the task id.

        Nothing reaches the broker if validation fails (`PayloadInvalid`, `PriorityInvalid`). The job's record and its
        message are written in one Redis round trip (`pipeline.producer`). With an `idempotency_key`, a second enqueue
        with the same key (within ENQUEUE_IDEMPOTENCY_TTL) returns the first job's id. A `countdown` or `eta` further
        ahead than DELAYED_RELEASE_AHEAD parks the job in Redis until it is due (`pipeline.publish`), so no worker
        holds a long delay in memory. With a `group` (a tenant), the job takes its turn among its group's peers on its
        queue and level, and GROUP_CONCURRENCY caps how many of the group run at once (`pipeline.fairness.groups`).
        """
        send = self._sender(priority)
        job, data, text = self._checked(payload)
        grouped = groups.checked(self.name, group)
        due = publish.due_time(countdown, eta)
        return write.enqueue_one(
            self.name,
            self.queue,
            send,
            data,
            text,
            due=due,
            idempotency_key=idempotency_key,
            priority=priority,
            group=grouped,
            rate=None if self.limit is None else self.limit.suffix(job),
        )

    def enqueue_many(
        self, payloads: Iterable[P | Mapping[str, Any]], *, priority: int | None = None, group: str | None = None
    ) -> list[str]:
        """Validate every payload, then publish one job each, all at `priority` and in `group` (as `enqueue`);
        return their task ids in order.

        One pydantic call validates the batch: an invalid item raises `PayloadInvalid` (its errors' `loc` start with
        the item's index), nothing published. Records and messages go `write.CHUNK` jobs per Redis round trip.
        """
        if self._list_adapter is None:
            self._list_adapter = TypeAdapter(list[self.payload_model])  # type: ignore[name-defined]  # a runtime model
        send = self._sender(priority)
        grouped = groups.checked(self.name, group)
        keyed = self.limit.suffix if self.limit is not None and self.limit.key is not None else None
        return write.enqueue_many(
            self.name, self.queue, send, self._list_adapter, payloads, priority=priority, group=grouped, rate_key=keyed
        )

    def result(self, task_id: str, timeout: float | None = None) -> R:
        """Wait for the job and return its typed result (raises the job's error if it failed)."""
        raw: Any = AsyncResult(task_id, app=get_app()).get(timeout=timeout, propagate=True)
        return self.result_model.model_validate(raw)


def load_task_modules() -> dict[str, TypedTask[Any, Any]]:
    """Import every task module the worker runs, so producers (CLI, API) see the same tasks."""
    for module in TASK_MODULES:
        importlib.import_module(module)
    return REGISTRY


def typed_task(
    name: str,
    *,
    payload: type[P],
    result: type[R],
    kind: str | None = None,
    public: bool = True,
    transient: tuple[type[BaseException], ...] = (),
    max_attempts: int | None = None,
    cluster_rate: str | Callable[[], str] | None = None,
    cluster_burst: int = 1,
    rate_key: Callable[[P], str] | None = None,
    **options: Any,
) -> Callable[[Callable[[P, JobContext], R | Awaitable[R]]], TypedTask[P, R]]:
    """Register `fn(payload, ctx) -> result` as the Celery task `name` (see the module docstring).

    `kind` is the short name for the CLI and API (default: the part of `name` before the dot); `public=False`
    keeps a housekeeping task out of the HTTP API and the page;
    `transient` adds exceptions that retry besides `TransientError`; `max_attempts` overrides the
    default policy; `cluster_rate` ("20/s"), `cluster_burst` and `rate_key(job)` declare a limit shared
    by every worker (`pipeline.scheduling.ratelimit`); other `options` go to Celery (`soft_time_limit`,
    `time_limit`, `rate_limit` — per worker, overridable by TASK_RATE_LIMITS —, ...).
    """
    overrides: dict[str, Any] = {"transient": transient}
    if max_attempts is not None:
        overrides["max_attempts"] = max_attempts
    limit = ClusterRate(cluster_rate, cluster_burst, rate_key) if cluster_rate else None

    def decorate(fn: Callable[[P, JobContext], R | Awaitable[R]]) -> TypedTask[P, R]:
        def run(self: PipelineTask, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return self.run_typed(fn, payload, args, kwargs)

        run.__doc__ = fn.__doc__
        # Registered on every app when it is finalized (Celery's shared tasks): nothing is built here.
        fills = tuple(attr for attr in ("max_retries", "default_retry_delay") if attr not in options)
        register: Any = shared_task(
            name=name,
            bind=True,
            base=PipelineTask,
            policy_overrides=overrides,
            policy_fills=fills,
            cluster_limit=limit,
            is_async=inspect.iscoroutinefunction(fn),
            **options,
        )
        register(run)
        return TypedTask(name, payload, result, kind or name.split(".")[0], public)

    return decorate
