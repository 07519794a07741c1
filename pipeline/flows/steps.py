"""Running a job that is a step of a flow (the worker's runtime installs `run` in `pipeline.task.FLOW_STEPS`).

A step is an ordinary typed job whose message carries HEADER_FLOW. Around its run:

1. `flow_begin.lua`: the flow's state, the node's result if it was recorded before, and what its payload is built
   from. A node already recorded (its job was redelivered after it finished, or replayed) is not run again: its
   recorded result is the job's result. A step of a cancelled flow is not run: it ends cancelled. The call is left
   out where it cannot find anything: a fan-out item or a last step, on its first delivery (`x-delivery-count` 1),
   first attempt and not a replay, has nothing recorded, and its flow's cancel cancels its job itself.
2. A join's payload is built from the flow's input and its parents' stored results (their order: item order for a
   fan-out); any other step's payload came in its message. Then the job runs as any other: admission, guards,
   retries with backoff, dead-lettering (its entry names the flow and the step, and the flow is failed there:
   `pipeline.dlq.capture`).
3. When it succeeds, `flow_advance.lua` records its result and queues the steps that waited on it last, before the
   job's message is acknowledged. The same call stores the job's own result (its SUCCESS, as the result backend
   would, fenced by the job's lease; the backend's own write of it is then skipped), when the backend hands it over
   (`success_to_store`: on the broker's Redis, verified versions, results not ignored): a step's job costs no
   round trip for its result. A job redelivered after this call finds its node recorded (1.) and changes nothing,
   so each step is queued once. A fan-out item run by a worker that carries its jobs' results and acknowledgements
   on its next fetch (solo, asyncio: `record.CARRIERS`) makes no call here: the fetch records its node with its
   result, and the item's job is acknowledged only after that answer came and, when the item completed its step,
   the steps after it were offered (`launch.offer_next`, on the worker's event loop).

The flow metrics (`pipeline.observability.flow_metrics`) are counted here: a job's first run as it starts, its
success when 3. recorded it (and the step's duration, the flow's success, when it was the last).

A Redis error in 1. or 3. is retried for up to ADVANCE_PATIENCE_S (each call is safe to repeat), then the job
retries as after a transient error. That includes kombu's `OperationalError`: the process's first call connects
through kombu (`producer_redis`), and 3. builds the next step's message template by one publish through Celery
(`pipeline.producer.template`), which kombu retries for about a second before it raises.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from kombu.exceptions import OperationalError
from pydantic import ValidationError

from pipeline.celery_app import get_app
from pipeline.constants import HEADER_DELIVERY_COUNT
from pipeline.errors import BrokerWriteRefused, JobCancelled, PayloadInvalid, PermanentError
from pipeline.flows import launch, record
from pipeline.flows.definition import FLOWS, Flow, Step
from pipeline.flows.record import Advanced, Begun, Carried, JobResult, Ref
from pipeline.observability import flow_metrics
from pipeline.producer.client import producer_redis
from pipeline.task import PipelineTask, request_header

log = logging.getLogger(__name__)

#: How long a step keeps trying to reach Redis for its flow calls before the job retries instead (seconds).
ADVANCE_PATIENCE_S = 30.0
_PAUSES_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
#: Redis unreachable: through redis-py, or through kombu (a connection, a publish).
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OperationalError)


def run(task: PipelineTask, header: Any, raw: Any, run_job: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """Run the step job `task` (see the module docstring); `run_job(payload)` runs it as a plain job."""
    ref = Ref.of(header)
    flow = FLOWS.get(ref.flow) if ref is not None else None
    if ref is None or flow is None or ref.step not in flow.steps or flow.steps[ref.step].task.name != task.name:
        raise PermanentError(f"{task.name}: the job names flow step {header!r}, which this worker does not declare")
    step = flow.steps[ref.step]
    task_id = str(task.request.id)
    joins = flow.joins(step)
    builds_next = any(not flow.joins(flow.steps[child]) for child in step.children)
    parents = step.after if joins else ()
    first_run = _first_run(task, header)
    if first_run:
        first_of_flow = ref.step == next(iter(flow.steps)) and not ref.item
        flow_metrics.step_started(ref.flow, ref.step, first_of_flow)
    if joins or builds_next or not first_run:
        try:
            began = _patiently(lambda: record.begin(producer_redis(), ref, task_id, joins or builds_next, parents))
        except (redis.RedisError, OperationalError) as exc:
            raise task.retry_transient(exc) from exc
    else:  # nothing to read, and nothing recorded yet: a cancelled flow's queued jobs are cancelled themselves
        began = Begun("running", None, None, {})
    if began.state is None:
        raise PermanentError(f"flow {ref.flow} {ref.id} is not kept any more (expired, or never started)")
    if began.result is not None:
        log.info("flow %s %s: %s had finished; its recorded result stands", ref.flow, ref.id, ref.node)
        result: dict[str, Any] = json.loads(began.result)
    elif began.state == "cancelled":
        get_app().backend.mark_as_revoked(task_id, "cancelled")
        raise JobCancelled(task_id)
    else:
        result = run_job(_join_payload(flow, step, began) if joins else raw)
    if ref.item is not None and _carried(task, flow, ref, result, began.input):
        return result
    job = _job_result(task, result)
    try:
        done = _patiently(lambda: launch.advance(flow, ref, task_id, result, began.input, job))
    except (redis.RedisError, OperationalError, BrokerWriteRefused) as exc:  # the next attempt records it, or finds it
        raise task.retry_transient(exc) from exc
    if job is not None and done.stored is not None:
        task.backend.mark_stored(task.request)  # type: ignore[attr-defined]  # it handed the result over: it has this
    _advanced(ref, done)
    return result


def _advanced(ref: Ref, done: Advanced) -> None:
    """Log and count what the node's record did."""
    if done.recorded:
        log.info("flow %s %s: %s succeeded (flow %s)%s", ref.flow, ref.id, ref.node, done.state, _queued(done.queued))
        took = time.time() - done.since if done.since is not None else None
        flow_metrics.step_succeeded(ref.flow, ref.step, took, done.finished)


def _carried(task: PipelineTask, flow: Flow[Any], ref: Ref, result: dict[str, Any], flow_input: str | None) -> bool:
    """Hand fan-out item `ref`'s node to the call that acknowledges its job (see 3.), when the worker carries nodes
    (a solo worker's delivery layer: `record.CARRIERS`) and the job is acknowledged after it ran."""
    if not record.CARRIERS or not task.acks_late:
        return False
    task_id = str(task.request.id)

    def answered(first: Advanced) -> None:
        _advanced(ref, _patiently(lambda: launch.offer_next(flow, ref, task_id, result, flow_input, first)))

    def record_now() -> Advanced:  # waits for Redis as the advance above does: the item is not run again for it
        done: Advanced = _patiently(lambda: launch.record_item(flow, ref, task_id, result))
        return done

    node = Carried(ref.id, ref.node, ref.step, json.dumps(result), task_id, time.time(), answered, record_now)
    return record.CARRIERS[0](node, task.request)


def _job_result(task: PipelineTask, result: dict[str, Any]) -> JobResult | None:
    """The job's SUCCESS for the advance to store, when its result backend hands it over (see 3.)."""
    prepare = getattr(task.backend, "success_to_store", None)
    given = prepare(task, result) if prepare is not None else None
    return JobResult(*given) if given is not None else None


def _queued(steps: list[str]) -> str:
    return f"; queued {', '.join(steps)}" if steps else ""


def _first_run(task: PipelineTask, header: dict[str, Any]) -> bool:
    """The job's first delivery and attempt, not a replay: its node cannot have been recorded before."""
    count = request_header(task.request, HEADER_DELIVERY_COUNT)
    return count == 1 and not task.request.retries and not header.get("replayed")


def _join_payload(flow: Flow[Any], step: Step, began: Begun) -> Any:
    """A join's payload: its mapping called with the flow's input and its parents' stored results."""
    try:
        given: list[Any] = [flow.input_model.model_validate_json(began.input or "")]
        for name in step.after:
            model = flow.steps[name].task.result_model
            stored = began.parents.get(name)
            values = stored if isinstance(stored, list) else [stored]
            if not values or any(v is None for v in values):
                raise PermanentError(f"flow {flow.name}: step {step.name} starts before {name} recorded its result")
            parsed = [model.model_validate_json(v) for v in values if v is not None]
            given.append(parsed if flow.steps[name].each else parsed[0])
        return step.mapping(*given)
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        raise PayloadInvalid(f"flow {flow.name} step {step.name}", errors) from None


def _patiently(call: Callable[[], Any]) -> Any:
    """`call()`, repeated while Redis is unreachable (`_UNREACHABLE`) for up to ADVANCE_PATIENCE_S (it is
    idempotent)."""
    deadline = time.monotonic() + ADVANCE_PATIENCE_S
    attempt = 0
    while True:
        try:
            return call()
        except _UNREACHABLE:
            if time.monotonic() >= deadline:
                raise
            time.sleep(_PAUSES_S[min(attempt, len(_PAUSES_S) - 1)])
            attempt += 1
