"""Starting a flow, and queueing the steps a finished node lets run: both are one `flow_advance.lua` call.

`start(flow, input)` validates the input as any payload is validated (`PayloadInvalid`, nothing written), builds the
first steps' jobs, and creates the flow with them in one script call; it returns the flow's id.

`advance(...)` is what a step's job calls when it succeeds (`pipeline.flows.steps`): it offers the script the jobs of
every step that runs after the node's step, and the script queues those whose last awaited step this was (exactly
once, however many workers finish at the same instant, and however often a redelivered job calls again).

A step's payload is built when it is queued, from the flow's input and the result that queued it: the mapping runs
in the process that finished the step before it (or in `start`). A join (a step after several steps, or after a
fan-out) cannot be built there: its message carries an empty payload, and its payload is built when it starts, from
the results stored in the flow (`pipeline.flows.steps`).

On a Redis Cluster a step's queue is in another slot than its flow: the one call is split into the flow's own call
and an idempotent enqueue per claimed step (`pipeline.flows.handoff`).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import redis
from pydantic import BaseModel, TypeAdapter, ValidationError

from pipeline.config import get_settings
from pipeline.constants import FLOW_IDEMPOTENCY_KEY, FLOWS_INDEX_KEY, JOB_RECORD_KEY, LEASE_KEY
from pipeline.errors import PayloadInvalid
from pipeline.flows import handoff, record
from pipeline.flows.definition import FLOWS, Flow, Step
from pipeline.flows.handoff import Queued
from pipeline.flows.record import Advanced, JobResult, Ref
from pipeline.producer import write
from pipeline.producer.client import producer_redis
from pipeline.queues import keys as layout
from pipeline.records import accepted_entry
from pipeline.task import validate_payload

#: The most jobs one fan-out step may have: they are queued by one script call (Redis runs nothing else meanwhile).
MAX_FAN_OUT = 10_000
#: What a join's message carries until it starts: its payload is built then (`pipeline.flows.steps`).
DEFERRED: dict[str, Any] = {}


class FlowNotFound(LookupError):
    """No flow with this name is declared, or no flow with this id is kept."""


class FlowEmpty(PayloadInvalid):
    """A fan-out step's mapping gave no payload: the flow cannot go on past it."""


def get_flow(name: str) -> Flow[Any]:
    try:
        return FLOWS[name]
    except KeyError:
        raise FlowNotFound(f"no flow named {name!r} (declared: {', '.join(sorted(FLOWS)) or 'none'})") from None


def _payloads(flow: Flow[Any], step: Step, given: list[Any]) -> list[tuple[Any, str]]:
    """`step`'s payloads from its mapping called with `given` (validated and size-checked): (JSON dict, JSON text)."""
    try:
        built = step.mapping(*given)
    except ValidationError as exc:  # the mapping built a payload its model refuses: the input led there
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        raise PayloadInvalid(f"flow {flow.name} step {step.name}", errors) from None
    items = built if step.each else [built]
    if step.each and not items:
        raise FlowEmpty(step.task.name, [{"loc": [flow.name, step.name], "msg": "the fan-out step has no items"}])
    if len(items) > MAX_FAN_OUT:
        message = f"the fan-out step has {len(items)} items; the limit is {MAX_FAN_OUT}"
        raise PayloadInvalid(step.task.name, [{"loc": [flow.name, step.name], "msg": message}])
    adapter = _list_adapter(step.task.payload_model)  # type: ignore[arg-type]  # a class is hashable; the stubs say Any
    jobs = write.validate_many(step.task.name, adapter, list(items))
    return write.dump_checked(step.task.name, adapter, jobs)


@functools.cache
def _list_adapter(model: type[BaseModel]) -> TypeAdapter[list[Any]]:
    """The validator of a list of `model` payloads, built once per model (building one costs far more than using it)."""
    return TypeAdapter(list[model])  # type: ignore[valid-type]  # a runtime model


def queued(
    flow: Flow[Any], flow_id: str, step: Step, given: list[Any] | None, now: float, ids: list[str] | None = None
) -> Queued:
    """The jobs of `step` (its payloads from `given`, the mapping's arguments; None for a join: built as it starts),
    new jobs, or with `ids` the jobs a claim named (`pipeline.flows.reconcile`)."""
    items = _payloads(flow, step, given) if given is not None else [(DEFERRED, json.dumps(DEFERRED))]
    refs = [Ref(flow.name, flow_id, step.name, i if step.each else None) for i in range(len(items))]
    typed = step.task

    def send(producer: Any, task_id: str, payload: dict[str, Any], headers: dict[str, Any], eta: Any) -> Any:
        return typed.task.apply_async((payload,), task_id=task_id, headers=headers, producer=producer)

    ids, outs = write.step_messages(typed.name, send, items, [r.header() for r in refs], now, ids)
    channel = next((c for out in outs for c, _ in out.publishes), "")
    return Queued(
        step,
        [r.node for r in refs],
        ids,
        [out.body for out in outs],
        outs[0].dest,
        accepted_entry(typed.name, queue=typed.queue)[0],
        channel,
        [body for out in outs for _, body in out.publishes],
    )


def _call(
    client: redis.Redis,
    flow_id: str,
    head: list[Any],
    pairs: list[str],
    offers: list[Queued],
    holder: str | None = None,
    job: JobResult | None = None,
) -> Advanced:
    """One `flow_advance.lua` call; `holder`: creating, the Redis key of the start's idempotency key; `job`: the
    node's job's result, stored by the same call. On a Redis Cluster the hand-off is split (`pipeline.flows.handoff`)
    and the job's result is stored by the result backend on its own."""
    if layout.clustered():
        return handoff.advance(client, flow_id, head, pairs, offers)
    settings = get_settings()
    keys = [key for q in offers for key in q.redis_keys()] + ([holder] if holder else [])
    if job is not None:
        keys += [job.key, LEASE_KEY]
    args = [
        *head[:3],
        repr(time.time()),
        record.ttl(),
        JOB_RECORD_KEY.format(id=""),
        settings.recent_jobs_max,
        *head[3:],
        len(pairs) // 2,
        len(offers),
        settings.recent_jobs_max,
        settings.enqueue_idempotency_ttl if holder else "",
        *((job.meta, job.expires, job.tag, job.owner) if job is not None else ("", 0, "", "")),
        *pairs,
        *[a for q in offers for a in q.args()],
    ]
    return record.advance(client, flow_id, [FLOWS_INDEX_KEY, *keys], args)


def start(flow: Flow[Any] | str, input: BaseModel | Mapping[str, Any], *, idempotency_key: str | None = None) -> str:
    """Validate `input` as the flow's input model (`PayloadInvalid`: nothing is written), queue the flow's first steps
    and return the new flow's id (`FlowNotFound` for an undeclared name).

    With an `idempotency_key` that an earlier start of this flow claimed (within ENQUEUE_IDEMPOTENCY_TTL), nothing is
    written and that flow's id is returned; the claim is made by the same script call that creates the flow, so a
    start that stored nothing claims nothing."""
    definition = get_flow(flow) if isinstance(flow, str) else flow
    data = validate_payload(f"flow {definition.name}", definition.input_model, input)
    flow_id = str(uuid.uuid4())
    now = time.time()
    first = [s for s in definition.steps.values() if not s.after]
    offers = [queued(definition, flow_id, s, [data], now) for s in first]
    pairs = [name for s in definition.steps.values() for p in s.after for name in (s.name, p)]
    text = data.model_dump_json()
    head = ["", text, "", "", "", flow_id, definition.name, len(definition.steps)]
    holder = FLOW_IDEMPOTENCY_KEY.format(flow=definition.name, key=idempotency_key) if idempotency_key else None
    if layout.clustered():
        return handoff.start(producer_redis(), holder, head, pairs, offers, now)
    created = _call(producer_redis(), flow_id, head, pairs, offers, holder)
    return created.first or flow_id


def advance(
    flow: Flow[Any],
    ref: Ref,
    task_id: str,
    result: dict[str, Any],
    flow_input: str | None,
    job: JobResult | None = None,
) -> Advanced:
    """Record node `ref`'s `result` (its job `task_id` succeeded) and queue the steps its step lets run (see
    `flow_advance.lua`). `flow_input`: the flow's input (JSON), needed when a step after this one is built here.
    `job`: the job's SUCCESS for the result backend, stored by the (first) call that records the node.

    A fan-out item is recorded without offering the next steps' jobs (most items do not complete their step); the
    call that finds its step complete offers them in a second call. A job redelivered between the two calls finds its
    node recorded and makes both again: the next steps are queued once either way."""
    step = flow.steps[ref.step]
    client = producer_redis()
    head = _head(flow, ref, task_id, result)
    if ref.item is not None:
        first = _call(client, ref.id, head, [], [], job=job)
        return offer_next(flow, ref, task_id, result, flow_input, first)
    return _call(client, ref.id, head, [], _offers(flow, ref, step, result, flow_input), job=job)


def record_item(flow: Flow[Any], ref: Ref, task_id: str, result: dict[str, Any]) -> Advanced:
    """Record fan-out item `ref`'s `result`, offering no step (`advance`'s first call)."""
    return _call(producer_redis(), ref.id, _head(flow, ref, task_id, result), [], [])


def offer_next(
    flow: Flow[Any], ref: Ref, task_id: str, result: dict[str, Any], flow_input: str | None, first: Advanced
) -> Advanced:
    """After fan-out item `ref` was recorded (`first`: what that call answered): when its step is complete, the call
    that offers the jobs of the steps after it; what both calls answered together."""
    step = flow.steps[ref.step]
    if not (first.complete and first.state == "running" and step.children):
        return first
    offers = _offers(flow, ref, step, result, flow_input)
    then = _call(producer_redis(), ref.id, _head(flow, ref, task_id, result), [], offers)
    return Advanced(first.recorded, then.state, then.complete, then.queued, since=first.since, stored=first.stored)


def _head(flow: Flow[Any], ref: Ref, task_id: str, result: dict[str, Any]) -> list[Any]:
    """ARGV 1-3 and 8-12 of `flow_advance.lua` for node `ref`."""
    return [ref.node, json.dumps(result), task_id, ref.step, "1" if ref.item is not None else "", ref.id, flow.name, 0]


def _offers(flow: Flow[Any], ref: Ref, step: Step, result: dict[str, Any], flow_input: str | None) -> list[Queued]:
    """The jobs of each step after `step`: built here, or (a join) built when it starts."""
    now = time.time()
    offers = []
    for name in step.children:
        child = flow.steps[name]
        given = None
        if not flow.joins(child):
            if flow_input is None:
                raise RuntimeError(f"flow {flow.name}: step {name} is built here, from the flow's input")
            model = step.task.result_model.model_validate(result)
            given = [flow.input_model.model_validate_json(flow_input), model]
        offers.append(queued(flow, ref.id, child, given, now))
    return offers
