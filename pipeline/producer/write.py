"""Writing jobs: record, recent-jobs index and message (queued or parked) in one round trip per job or chunk.

`enqueue_one` is `TypedTask.enqueue`'s publish. A job due now takes its message from the task's template
(`pipeline.producer.template`) and is stored by one script call (`pipeline.producer.script`): its record
(`pipeline.records`), its place in the recent-jobs index, the message and the `task-sent` event when the app
sends one, and the claim of its idempotency key if it has one — all or nothing, one round trip. A job with an
ETA is built by Celery itself and captured (`pipeline.publish.capture`), then written with its record in one
MULTI, queued or parked (a key is claimed first, one more round trip). Celery's result backend is not asked to
subscribe to the job's result channel (stock Celery subscribes on every `apply_async`): results are read from
the store when someone asks (`TypedTask.result`, `AsyncResult.get`, `pipeline status`, the API).

`enqueue_many` validates a whole batch in one pydantic call and stores records and messages CHUNK jobs per
script call.

Durability (REDIS_WAIT_REPLICAS=N >= 1): a script call carries WAIT in its round trip
(`pipeline.producer.script`); a MULTI cannot, so a job built by Celery is confirmed by one more round trip after
it (`pipeline.broker.confirm_replicated`), outside the claim of its idempotency key: a job not confirmed keeps its
claim, and a retry with the key answers with its id once it is replicated, never with a second job. A batch of
more than CHUNK jobs is confirmed chunk by chunk: `NotReplicated` or `BrokerFull` on a later chunk leaves the
earlier chunks stored (a batch has no idempotency key). With N = 0 nothing is added.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from pipeline.broker import confirm_replicated, full, memory_refusals, oom_cause
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import (
    HEADER_GROUP,
    HEADER_IDEMPOTENCY_KEY,
    HEADER_PUBLISHED_AT,
    HEADER_RATE_KEY,
)
from pipeline.errors import PayloadInvalid
from pipeline.producer import idempotency
from pipeline.producer.client import producer_redis
from pipeline.producer.hooks import publish_hooked
from pipeline.producer.script import store_jobs
from pipeline.producer.template import Job, Template, args_repr, template_for, uuid4_strings
from pipeline.publish import announce, capture, capture_many, park
from pipeline.queues import jobkeys, keys, wake
from pipeline.records import accepted_entry, remember_recent

#: Jobs per Redis round trip in `enqueue_many`.
CHUNK = 1000

#: `send(producer, task_id, payload, headers, eta)`: the task's `apply_async` on `producer`.
Send = Callable[[Any, str, dict[str, Any], dict[str, Any], datetime | None], Any]


@dataclass(frozen=True)
class Outgoing:
    """What one job writes besides its record: a list key and kombu's envelope, and PUBLISHes (events)."""

    dest: str
    body: str
    publishes: tuple[tuple[str, str], ...]


def _parent() -> tuple[str | None, str | None]:
    """(parent_id, root_id) Celery gives a job sent from inside a running task, else (None, None)."""
    parent = get_app().current_worker_task
    if parent is None:
        return None, None
    return parent.request.id, parent.request.root_id or parent.request.id


def _templated(
    template: Template,
    items: list[tuple[Any, str]],
    published_at: float,
    key: str | None = None,
    group: str | None = None,
    flows: list[dict[str, Any]] | None = None,
    rates: list[str | None] | None = None,
    ids: list[str] | None = None,
) -> tuple[list[str], list[Outgoing]]:
    """New task ids (or `ids`), and the messages (and `task-sent` events) of jobs with these (payload, JSON text)
    items (with `flows`, each item's flow step header; with `rates`, each item's rate key header)."""
    parent_id, root_id = _parent()
    app: Any = get_app()  # celery-types lacks `clock`
    reply_to = app.thread_oid
    uuids = uuid4_strings(3 * len(items))  # per job: task id, message tag, event tag (one urandom call)
    if ids is None:
        ids = uuids[::3]
    elif len(ids) != len(items):
        raise ValueError(f"{len(ids)} ids for {len(items)} jobs")
    outs = []
    for n, (payload, text) in enumerate(items):
        task_id = ids[n]
        argsrepr = args_repr(payload, template.repr_limits)
        job = Job(
            task_id, text, argsrepr, published_at, root_id or task_id, parent_id, uuids[3 * n + 1], uuids[3 * n + 2]
        )
        job.idempotency_key = key
        job.group = group
        job.flow = flows[n] if flows is not None else None
        job.rate = rates[n] if rates is not None else None
        event = template.sent_event(job, app.clock.forward(), time.time())
        outs.append(Outgoing(template.dest, template.message(job, reply_to), (event,) if event is not None else ()))
    return ids, outs


def _template(
    name: str,
    send: Send,
    keyed: bool = False,
    grouped: bool = False,
    priority: int | None = None,
    flowed: bool = False,
    rated: bool = False,
) -> Template:
    """The task's template at `priority` (`template_for`: its list key is the priority level's, as kombu chose it).
    Building it publishes through Celery once, which declares the queue (a write): at maxmemory that is refused,
    and the producer gets `BrokerFull`, not kombu's connection error."""
    try:
        return template_for(
            name,
            lambda p, i, d, h: send(p, i, d, h, None),
            keyed=keyed,
            grouped=grouped,
            priority=priority,
            flowed=flowed,
            rated=rated,
        )
    except Exception as exc:
        refusal = oom_cause(exc)
        if refusal is None:
            raise
        raise full(refusal) from exc


def _store(
    name: str,
    queue: str,
    ids: list[str],
    outs: list[Outgoing],
    now: float,
    claim: Any = None,
    group: str | None = None,
) -> str | None:
    """Store jobs due now in one script call (see `pipeline.producer.script.store_jobs`)."""
    record, ttl = accepted_entry(name, queue=queue)
    channels = {channel for out in outs for channel, _ in out.publishes}
    if len(channels) > 1 or len({out.dest for out in outs}) != 1:
        raise RuntimeError(f"{name}: a batch's jobs must share one queue and one event channel")
    return store_jobs(
        producer_redis(),
        queue=queue,
        dest=outs[0].dest,
        record=record,
        record_ttl=ttl,
        now=now,
        ids=ids,
        messages=[out.body for out in outs],
        channel=channels.pop() if channels else "",
        events=[body for out in outs for _, body in out.publishes],
        claim=claim,
        group=group,
    )


def enqueue_one(
    name: str,
    queue: str,
    send: Send,
    payload: dict[str, Any],
    text: str,
    *,
    due: float | None = None,
    idempotency_key: str | None = None,
    priority: int | None = None,
    group: str | None = None,
    rate: str | None = None,
) -> str:
    """Publish one job of task `name` (its payload, and `text` its JSON) through `send` (which gives it its
    `priority`, None: the default one); return its id, or with an `idempotency_key` already claimed (within
    ENQUEUE_IDEMPOTENCY_TTL) the id of the job that claimed it. `rate`: its cluster limit's key (the rate key header).

    Raises `NotReplicated` (fewer than REDIS_WAIT_REPLICAS replicas confirmed the job in time) or `BrokerFull`
    (Redis at maxmemory: nothing stored)."""
    now = time.time()
    if (due is None or due <= now) and not publish_hooked():
        template = _template(
            name, send, keyed=bool(idempotency_key), grouped=bool(group), priority=priority, rated=rate is not None
        )
        (task_id,), (out,) = _templated(
            template, [(payload, text)], now, idempotency_key or None, group or None, rates=[rate]
        )
        claim = None
        if idempotency_key:
            claim = (idempotency.redis_key(name, idempotency_key, queue), get_settings().enqueue_idempotency_ttl)
        return _store(name, queue, [task_id], [out], now, claim, group or None) or task_id
    with memory_refusals(), idempotency.claim(name, idempotency_key, queue) as claimed:
        if claimed.existing_id is None:
            _write_captured(name, queue, send, claimed.task_id, payload, idempotency_key, due, now, group, rate)
    confirm_replicated(producer_redis(), queue)  # outside the claim: a job not confirmed keeps its key
    return claimed.existing_id or claimed.task_id


def _write_captured(
    name: str,
    queue: str,
    send: Send,
    task_id: str,
    payload: Any,
    key: str | None,
    due: float | None,
    now: float,
    group: str | None = None,
    rate: str | None = None,
) -> None:
    """A job built by Celery (one with an ETA, or any while a publish hook watches: `pipeline.producer.hooks`),
    written with its record in one MULTI; parked if due later than DELAYED_RELEASE_AHEAD, else queued (a job
    due soon is held by a worker until due). A grouped one goes on the queue's list with its group header: the
    worker's fetch moves it to its group (`pipeline/lua/fetch.lua`)."""
    headers: dict[str, Any] = {HEADER_PUBLISHED_AT: now}
    if key:
        headers[HEADER_IDEMPOTENCY_KEY] = key
    if group:
        headers[HEADER_GROUP] = group
    if rate is not None:
        headers[HEADER_RATE_KEY] = rate
    eta = datetime.fromtimestamp(due, UTC) if due is not None and due > now else None
    message = capture(lambda producer: send(producer, task_id, payload, headers, eta))
    record, ttl = accepted_entry(name, eta, queue)
    client = producer_redis()
    pipe = client.pipeline(transaction=True)
    if keys.clustered():  # the record is a key of its own slot: written first, the queue's keys in one MULTI after
        client.set(jobkeys.record(task_id), record, ex=ttl)
    else:
        pipe.set(jobkeys.record(task_id), record, ex=ttl)
    remember_recent(pipe, queue, [task_id], now)
    if due is not None and due - now > get_settings().release_ahead:
        park(pipe, task_id, message, due)
    else:
        pipe.lpush(message.dest, message.body)
        wake.mark(pipe, message.dest)  # an idle worker of the queue wakes at once
        if not keys.clustered():
            for _, (channel, event) in message.extra:
                pipe.publish(channel, event)
    pipe.execute()
    announce(client, message)


def step_messages(
    name: str,
    send: Send,
    items: list[tuple[Any, str]],
    flows: list[dict[str, Any]],
    now: float,
    ids: list[str] | None = None,
) -> tuple[list[str], list[Outgoing]]:
    """New task ids (or `ids`, one per item) and the messages of jobs of task `name` that are steps of a flow
    (`pipeline.flows`): each item (payload, its JSON text) with its flow step header. Nothing is stored: the flow's
    script queues them when the steps they wait on are done (`pipeline/lua/flow_advance.lua`), or on a cluster the
    flow's hand-off does (`pipeline.flows.handoff`)."""
    return _templated(_template(name, send, flowed=True), items, now, flows=flows, ids=ids)


def validate_many(name: str, adapter: TypeAdapter[list[Any]], payloads: list[Any]) -> list[BaseModel]:
    """All `payloads` as models, in one pydantic call; `PayloadInvalid` with each error's `loc` starting with
    the bad item's index (nothing is published)."""
    not_objects = [
        {"loc": [i], "msg": f"payload must be a JSON object, got {type(p).__name__}", "type": "model_type"}
        for i, p in enumerate(payloads)
        if not isinstance(p, BaseModel | Mapping)
    ]
    if not_objects:
        raise PayloadInvalid(name, not_objects)
    try:
        jobs: list[BaseModel] = adapter.validate_python(payloads)
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        raise PayloadInvalid(name, errors) from None
    return jobs


def dump_checked(name: str, adapter: TypeAdapter[list[Any]], jobs: list[BaseModel]) -> list[tuple[Any, str]]:
    """Each job's JSON-mode dict and its JSON text, size-checked against MAX_PAYLOAD_BYTES."""
    limit = get_settings().max_payload_bytes
    dumped = adapter.dump_python(jobs, mode="json")
    texts = [json.dumps(d) for d in dumped]
    too_big = [
        {"loc": [i], "msg": f"payload is {len(t)} bytes; the limit is {limit}", "type": "too_large"}
        for i, t in enumerate(texts)
        if len(t) > limit
    ]
    if too_big:
        raise PayloadInvalid(name, too_big)
    return list(zip(dumped, texts, strict=True))


def enqueue_many(
    name: str,
    queue: str,
    send: Send,
    adapter: TypeAdapter[list[Any]],
    payloads: Iterable[Any],
    chunk: int = CHUNK,
    priority: int | None = None,
    group: str | None = None,
    rate_key: Callable[[Any], str | None] | None = None,
) -> list[str]:
    """Validate every payload (one call), then store records and messages `chunk` jobs per round trip; return
    the task ids in order (`send` gives each its `priority`, as in `enqueue_one`). One bad payload: `PayloadInvalid`
    naming its index, nothing published. `rate_key(job)`: each job's cluster limit key (the rate key header)."""
    jobs = validate_many(name, adapter, list(payloads))
    rates = None if rate_key is None else [rate_key(job) for job in jobs]
    items = dump_checked(name, adapter, jobs)
    template = _template(name, send, grouped=bool(group), priority=priority, rated=rates is not None)
    hooked = publish_hooked()
    ids: list[str] = []
    for start in range(0, len(items), chunk):
        part = items[start : start + chunk]
        now = time.time()
        part_rates = None if rates is None else rates[start : start + chunk]
        if hooked:
            chunk_ids = uuid4_strings(len(part))
            outs = _built_by_celery(send, chunk_ids, [payload for payload, _ in part], now, group, part_rates)
        else:
            chunk_ids, outs = _templated(template, part, now, group=group or None, rates=part_rates)
        _store(name, queue, chunk_ids, outs, now, group=group or None)
        ids.extend(chunk_ids)
    return ids


def _built_by_celery(
    send: Send,
    ids: list[str],
    payloads: list[Any],
    now: float,
    group: str | None = None,
    rates: list[str | None] | None = None,
) -> list[Outgoing]:
    """The jobs' messages as Celery builds them (its publish hooks run), captured, not sent."""
    headers: dict[str, Any] = {HEADER_PUBLISHED_AT: now}
    if group:
        headers[HEADER_GROUP] = group

    def sender(task_id: str, payload: Any, rate: str | None) -> Callable[[Any], Any]:
        own = headers if rate is None else {**headers, HEADER_RATE_KEY: rate}
        return lambda producer: send(producer, task_id, payload, own, None)

    each_rate = rates if rates is not None else [None] * len(ids)
    messages = capture_many(sender(i, d, r) for i, d, r in zip(ids, payloads, each_rate, strict=True))
    return [Outgoing(m.dest, m.body, tuple((str(a[0]), str(a[1])) for _, a in m.extra)) for m in messages]
