"""Writing jobs: record, recent-jobs index and message (queued or parked) in one MULTI per job or per chunk.

`enqueue_one` is `TypedTask.enqueue`'s publish: a job due now takes its message from the task's template
(`pipeline.producer.template`); a job with an ETA or an idempotency key is built by Celery itself and captured
(`pipeline.publish.capture`). Either way the job record (`pipeline.records`), its place in the recent-jobs
index, the message (LPUSH on its queue, or the parked entry of a job due later than DELAYED_RELEASE_AHEAD) and
the `task-sent` event, when the app sends one, go to Redis in one MULTI on the process's client
(`pipeline.producer.client`): one round trip, all or nothing. Celery's result backend is not asked to
subscribe to the job's result channel (stock Celery subscribes on every `apply_async`): results are read from
the stored result when someone asks (`TypedTask.result`, `AsyncResult.get`, `pipeline status`, the API).

`enqueue_many` validates a whole batch in one pydantic call and writes records and messages CHUNK jobs per
round trip.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from pydantic import BaseModel, TypeAdapter, ValidationError
from redis.client import Pipeline
from redis.exceptions import NoScriptError

from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import (
    DELAYED_DEST_KEY,
    DELAYED_KEY,
    DELAYED_MESSAGE_KEY,
    HEADER_PUBLISHED_AT,
    JOB_RECORD_KEY,
    RECENT_JOBS_KEY,
)
from pipeline.errors import PayloadInvalid
from pipeline.producer.client import producer_redis
from pipeline.producer.template import Job, ReprLimits, Template, args_repr, template_for, uuid4_strings
from pipeline.publish import capture
from pipeline.records import accepted_entry, remember_recent

#: Jobs per Redis round trip in `enqueue_many`.
CHUNK = 1000

#: Jobs due now, written atomically in one command: for each job its record (`pipeline.records`) and its
#: place in the recent-jobs index, then the index trimmed, the messages LPUSHed in order and their `task-sent`
#: events published. One reply to parse, where a MULTI of the same commands answers once per command.
#: KEYS: recent-jobs index, queue list. ARGV: record key prefix, record, ttl, now, index size, job count n,
#: event channel ('' for none), then n ids, n messages, and n events when there is a channel.
_QUEUE_JOBS = """
local prefix, record, ttl, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local keep, n, channel = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
for i = 8, 7 + n do
  redis.call('SET', prefix .. ARGV[i], record, 'EX', ttl)
  redis.call('ZADD', KEYS[1], now, ARGV[i])
end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -keep - 1)
for i = 8 + n, 7 + 2 * n do
  redis.call('LPUSH', KEYS[2], ARGV[i])
end
if channel ~= '' then
  for i = 8 + 2 * n, 7 + 3 * n do
    redis.call('PUBLISH', channel, ARGV[i])
  end
end
return n
"""
_QUEUE_JOBS_SHA = hashlib.sha1(_QUEUE_JOBS.encode()).hexdigest()  # noqa: S324  # Redis names scripts by SHA-1


def _queue_jobs(client: redis.Redis, name: str, queue: str, ids: list[str], outs: list[Outgoing], now: float) -> None:
    """Write the records, index entries, messages and events of jobs due now, in one round trip."""
    record, ttl = accepted_entry(name)
    channels = {channel for out in outs for channel, _ in out.publishes}
    if len(channels) > 1 or len({out.dest for out in outs}) != 1:
        raise RuntimeError(f"{name}: a batch's jobs must share one queue and one event channel")
    channel = channels.pop() if channels else ""
    events = [body for out in outs for _, body in out.publishes]
    keys = (RECENT_JOBS_KEY.format(queue=queue), outs[0].dest)
    head = (JOB_RECORD_KEY.format(id=""), record, ttl, repr(now), get_settings().recent_jobs_max, len(ids), channel)
    args: tuple[str | int, ...] = (*keys, *head, *ids, *[out.body for out in outs], *events)
    try:
        client.evalsha(_QUEUE_JOBS_SHA, 2, *args)
    except NoScriptError:
        client.eval(_QUEUE_JOBS, 2, *args)


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


def _templated(template: Template, ids: list[str], items: list[tuple[Any, str]], published_at: float) -> list[Outgoing]:
    """Messages (and `task-sent` events) of jobs `ids` with these (payload, JSON text) items."""
    parent_id, root_id = _parent()
    limits = ReprLimits.of_app()
    app: Any = get_app()  # celery-types lacks `clock`
    reply_to = app.thread_oid
    tags = uuid4_strings(2 * len(ids))
    outs = []
    for n, (task_id, (payload, text)) in enumerate(zip(ids, items, strict=True)):
        job = Job(
            task_id,
            text,
            args_repr(payload, limits),
            published_at,
            root_id or task_id,
            parent_id,
            *tags[2 * n : 2 * n + 2],
        )
        event = template.sent_event(job, app.clock.forward(), time.time())
        outs.append(Outgoing(template.dest, template.message(job, reply_to), (event,) if event is not None else ()))
    return outs


def _captured(send: Send, task_id: str, payload: Any, headers: dict[str, Any], eta: datetime | None) -> Outgoing:
    message = capture(lambda producer: send(producer, task_id, payload, headers, eta))
    return Outgoing(message.dest, message.body, tuple((str(a[0]), str(a[1])) for _, a in message.extra))


def enqueue_one(
    name: str,
    queue: str,
    send: Send,
    task_id: str,
    payload: dict[str, Any],
    text: str,
    headers: dict[str, Any],
    due: float | None,
) -> bool:
    """Write job `task_id` of task `name` (payload `text` is its JSON) in one round trip; True when parked."""
    now = time.time()
    eta = datetime.fromtimestamp(due, UTC) if due is not None and due > now else None
    if eta is None and set(headers) == {HEADER_PUBLISHED_AT}:
        template = template_for(name, lambda p, i, d, h: send(p, i, d, h, None))
        (out,) = _templated(template, [task_id], [(payload, text)], float(headers[HEADER_PUBLISHED_AT]))
    else:
        out = _captured(send, task_id, payload, headers, eta)
    park_at = due if due is not None and due - now > get_settings().release_ahead else None
    if park_at is None and not out.publishes[1:]:
        _queue_jobs(producer_redis(), name, queue, [task_id], [out], now)
        return False
    record, ttl = accepted_entry(name, eta)
    pipe = producer_redis().pipeline(transaction=True)
    pipe.set(JOB_RECORD_KEY.format(id=task_id), record, ex=ttl)
    remember_recent(pipe, queue, [task_id], now)
    if park_at is not None:
        pipe.hset(DELAYED_MESSAGE_KEY, task_id, out.body)
        pipe.hset(DELAYED_DEST_KEY, task_id, out.dest)
        pipe.zadd(DELAYED_KEY, {task_id: park_at})
    else:
        pipe.lpush(out.dest, out.body)
    _publish(pipe, out.publishes)
    pipe.execute()
    return park_at is not None


def _publish(pipe: Pipeline, publishes: Iterable[tuple[str, str]]) -> None:
    for channel, body in publishes:
        pipe.publish(channel, body)


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
    name: str, queue: str, send: Send, adapter: TypeAdapter[list[Any]], payloads: Iterable[Any], chunk: int = CHUNK
) -> list[str]:
    """Validate every payload (one call), then write records and messages `chunk` jobs per round trip; return
    the task ids in order. One bad payload: `PayloadInvalid` naming its index, nothing published."""
    items = dump_checked(name, adapter, validate_many(name, adapter, list(payloads)))
    template = template_for(name, lambda p, i, d, h: send(p, i, d, h, None))
    client = producer_redis()
    ids: list[str] = []
    for start in range(0, len(items), chunk):
        part = items[start : start + chunk]
        now = time.time()
        chunk_ids = uuid4_strings(len(part))
        outs = _templated(template, chunk_ids, part, now)
        _queue_jobs(client, name, queue, chunk_ids, outs, now)
        ids.extend(chunk_ids)
    return ids
