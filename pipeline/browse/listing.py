"""Reading the job browser's pages from Redis (see `pipeline.browse`): counts, then one page of one source."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, NamedTuple

import redis

from pipeline import cluster
from pipeline.broker import broker_redis, queue_keys, waiting_levels
from pipeline.browse.model import (
    MAX_LIMIT,
    BrowseState,
    JobPage,
    JobRow,
    cursor_after,
    cursor_offset,
    decode_cursor,
    encode_cursor,
)
from pipeline.celery_app import get_app
from pipeline.constants import HEADER_PUBLISHED_AT
from pipeline.dlq import admin as dlq_admin
from pipeline.fairness import groups
from pipeline.queues import jobkeys
from pipeline.queues import keys as layout
from pipeline.queues import state as queue_state
from pipeline.queues.routed import job_queues, known_queue

#: Celery's result-backend entries start with the state (`_get_result_meta` puts it first).
_STATUS = re.compile(rb'"status":\s*"([A-Z_]+)"')
_HEAD_BYTES = 80
_SCAN_CHUNK = 500


#: Celery state of a recent job → the browser's state (others are counted where the job waits or runs).
_RECENT = {
    "RETRY": BrowseState.RETRYING,
    "SUCCESS": BrowseState.SUCCEEDED,
    "FAILURE": BrowseState.FAILED,
    "REVOKED": BrowseState.CANCELLED,
    "REJECTED": BrowseState.FAILED,
}


def _iso(epoch: Any) -> str | None:
    return datetime.fromtimestamp(float(epoch), UTC).isoformat() if isinstance(epoch, int | float) else None


def _envelope(raw: bytes | str | None) -> dict[str, Any]:
    """A kombu envelope (the body is left encoded: it is never read); {} when it is not one."""
    try:
        envelope = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return envelope if isinstance(envelope, dict) else {}


def _message_row(envelope: dict[str, Any], queue: str, state: BrowseState, fallback_id: str = "?") -> JobRow:
    headers = envelope.get("headers")
    headers = headers if isinstance(headers, dict) else {}
    properties = envelope.get("properties")
    priority = properties.get("priority") if isinstance(properties, dict) else None
    retries = headers.get("retries")
    return JobRow(
        id=str(headers.get("id") or fallback_id),
        task=headers.get("task"),
        queue=queue,
        state=state,
        attempts=retries if isinstance(retries, int) else None,
        priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else None,
        enqueued_at=_iso(headers.get(HEADER_PUBLISHED_AT)),
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _recent(client: redis.Redis, queues: Iterable[str]) -> dict[str, list[tuple[str, float, BrowseState]]]:
    """Per queue: (id, accepted at, state) of its recent jobs in a recent state, newest first."""
    queues = list(queues)
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.zrevrange(layout.recent(queue), 0, -1, withscores=True)
    indexes: list[list[tuple[Any, Any]]] = pipe.execute()
    backend: Any = get_app().backend
    pipe = backend.client.pipeline(transaction=False)  # RESULT_BACKEND_URL may name another Redis than the broker
    indexes = [[(_text(member), float(score)) for member, score in entries] for entries in indexes]
    ids = [member for entries in indexes for member, _ in entries]
    for task_id in ids:
        pipe.getrange(backend.get_key_for_task(task_id), 0, _HEAD_BYTES)
    heads = pipe.execute() if ids else []
    found = {}
    for task_id, head in zip(ids, heads, strict=True):
        match = _STATUS.search(head or b"")
        if match and match.group(1).decode() in _RECENT:
            found[task_id] = _RECENT[match.group(1).decode()]
    failed = [task_id for task_id, state in found.items() if state is BrowseState.FAILED]
    for task_id, entry in zip(failed, client.hmget(layout.dlq_index()[1], failed) if failed else [], strict=True):
        if entry is not None:
            del found[task_id]  # listed under dead_lettered
    return {
        queue: [(member, score, found[member]) for member, score in entries if member in found]
        for queue, entries in zip(queues, indexes, strict=True)
    }


class _Snapshot(NamedTuple):
    table: dict[str, dict[BrowseState, int]]
    #: Queue → priority level → waiting jobs.
    levels: dict[str, dict[str, int]]
    recent: dict[str, list[tuple[str, float, BrowseState]]]
    dead: list[dlq_admin.DeadLetter]


def _snapshot(client: redis.Redis) -> _Snapshot:
    """Jobs per queue the app routes to (`job_queues`) and state (a dead letter counts under its original queue),
    and what they came from."""
    queues = job_queues(get_app())
    table = {queue: dict.fromkeys(BrowseState, 0) for queue in queues}
    levels = {
        queue: {str(step): n for step, n in by_step.items()}
        for queue, by_step in waiting_levels(client, queues).items()
    }
    for queue in queues:
        table[queue][BrowseState.WAITING] = sum(levels[queue].values())
    for queue in queue_state.parked_queues(client, queues):
        if queue in table:
            table[queue][BrowseState.SCHEDULED] += 1
    for queue, _ in queue_state.delivered(client, queues):
        if queue in table:
            table[queue][BrowseState.RUNNING] += 1
    recent = _recent(client, queues)
    for queue, jobs in recent.items():
        for _, _, state in jobs:
            table[queue][state] += 1
    dead = sorted(dlq_admin.list_entries(), key=lambda e: (e.failed_at.timestamp(), e.id), reverse=True)
    for entry in dead:
        if entry.queue in table:
            table[entry.queue][BrowseState.DEAD_LETTERED] += 1
    return _Snapshot(table, levels, recent, dead)


def _waiting(client: redis.Redis, queue: str, position: Any, limit: int) -> tuple[list[JobRow], str | None]:
    offset = cursor_offset(position or 0)
    keys = [k for level in queue_keys(queue) for k in (level, *groups.job_lists(client, level))]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
    lengths = pipe.execute()
    rows: list[JobRow] = []
    skip = offset
    for key, length in zip(keys, lengths, strict=True):
        if skip >= length:
            skip -= length
            continue
        need = limit - len(rows)
        rows += [
            _message_row(_envelope(raw), queue, BrowseState.WAITING)
            for raw in client.lrange(key, skip, skip + need - 1)
        ]
        skip = 0
        if len(rows) >= limit:
            break
    end = offset + len(rows)
    return rows, encode_cursor(queue, BrowseState.WAITING, end) if end < sum(lengths) and rows else None


def _running(client: redis.Redis, queue: str, position: Any, limit: int) -> tuple[list[JobRow], str | None]:
    offset = cursor_offset(position or 0)
    rows = [_message_row(message, queue, BrowseState.RUNNING) for _, message in queue_state.delivered(client, [queue])]
    rows.sort(key=lambda r: (r.enqueued_at or "", r.id))
    for row in rows:  # the attempt under way counts, as in `job_status`
        row.attempts = (row.attempts or 0) + 1
    page = rows[offset : offset + limit]
    return page, encode_cursor(queue, BrowseState.RUNNING, offset + limit) if offset + limit < len(rows) else None


def _scheduled(client: redis.Redis, queue: str, position: Any, limit: int) -> tuple[list[JobRow], str | None]:
    after = cursor_after(position)
    index, message_hash, dest_hash = layout.delayed(queue)
    start = 0
    chosen: list[tuple[str, float]] = []
    more = False
    low: float | str = after[0] if after else "-inf"
    while len(chosen) <= limit:
        batch: list[Any] = client.zrangebyscore(index, low, "+inf", start=start, num=_SCAN_CHUNK, withscores=True)
        if not batch:
            break
        start += len(batch)
        members = [(_text(m), float(score)) for m, score in batch]
        members = [(m, s) for m, s in members if after is None or (s, m) > after]
        dests = client.hmget(dest_hash, [m for m, _ in members]) if members else []
        for (member, score), dest in zip(members, dests, strict=True):
            if dest is not None and layout.queue_of(_text(dest)) == queue:
                chosen.append((member, score))
        if len(batch) < _SCAN_CHUNK:
            break
    if len(chosen) > limit:
        chosen, more = chosen[:limit], True
    messages = client.hmget(message_hash, [m for m, _ in chosen]) if chosen else []
    rows = []
    for (member, score), raw in zip(chosen, messages, strict=True):
        row = _message_row(_envelope(raw), queue, BrowseState.SCHEDULED, member)
        row.due_at = _iso(score)
        rows.append(row)
    last = chosen[-1] if chosen else None
    return rows, encode_cursor(queue, BrowseState.SCHEDULED, [last[1], last[0]]) if more and last else None


def _recent_rows(
    client: redis.Redis, recent: _Snapshot, queue: str, state: BrowseState, position: Any, limit: int
) -> tuple[list[JobRow], str | None]:
    after = cursor_after(position)
    jobs = [(task_id, score) for task_id, score, s in recent.recent[queue] if s is state]
    if after is not None:
        jobs = [(task_id, score) for task_id, score in jobs if (score, task_id) < after]
    page, more = jobs[:limit], len(jobs) > limit
    backend: Any = get_app().backend
    metas = backend.mget([backend.get_key_for_task(task_id) for task_id, _ in page]) if page else []
    records = cluster.get_many(client, [jobkeys.record(task_id) for task_id, _ in page])
    rows = []
    for (task_id, score), raw_meta, raw_record in zip(page, metas, records, strict=True):
        meta, record = _json(raw_meta), _json(raw_record)
        result = meta.get("result")
        rows.append(
            JobRow(
                id=task_id,
                task=meta.get("name") or record.get("task"),
                queue=queue,
                state=state,
                attempts=int(meta.get("retries") or 0) + 1,
                enqueued_at=record.get("accepted_at") or _iso(score),
                finished_at=meta.get("date_done"),
                exception=result.get("exc_type")
                if isinstance(result, dict) and state is not BrowseState.SUCCEEDED
                else None,
            )
        )
    last = page[-1] if page else None
    return rows, encode_cursor(queue, state, [last[1], last[0]]) if more and last else None


def _json(raw: bytes | str | None) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _dead_lettered(
    client: redis.Redis, snapshot: _Snapshot, queue: str, position: Any, limit: int
) -> tuple[list[JobRow], str | None]:
    after = cursor_after(position)
    entries = [e for e in snapshot.dead if e.queue == queue]
    if after is not None:
        entries = [e for e in entries if (e.failed_at.timestamp(), e.id) < after]
    page, more = entries[:limit], len(entries) > limit
    records = cluster.get_many(client, [jobkeys.record(e.task_id or "-") for e in page])
    rows = [
        JobRow(
            id=e.task_id or e.id,
            task=e.task_name,
            queue=queue,
            state=BrowseState.DEAD_LETTERED,
            attempts=e.attempts,
            enqueued_at=_json(record).get("accepted_at"),
            finished_at=e.failed_at.isoformat(),
            exception=e.exception_type,
            dlq_id=e.id,
        )
        for e, record in zip(page, records, strict=True)
    ]
    last = page[-1] if page else None
    position = [last.failed_at.timestamp(), last.id] if last else None
    return rows, encode_cursor(queue, BrowseState.DEAD_LETTERED, position) if more else None


def browse(queue: str, state: BrowseState, cursor: str | None = None, limit: int = 50) -> JobPage:
    """One page of `queue`'s jobs in `state`, with the counts of every queue and state."""
    known_queue(get_app(), queue)
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}")
    position = decode_cursor(cursor, queue, state)
    with broker_redis() as client:
        snapshot = _snapshot(client)
        if state is BrowseState.DEAD_LETTERED:
            rows, next_cursor = _dead_lettered(client, snapshot, queue, position, limit)
        elif state is BrowseState.WAITING:
            rows, next_cursor = _waiting(client, queue, position, limit)
        elif state is BrowseState.RUNNING:
            rows, next_cursor = _running(client, queue, position, limit)
        elif state is BrowseState.SCHEDULED:
            rows, next_cursor = _scheduled(client, queue, position, limit)
        else:
            rows, next_cursor = _recent_rows(client, snapshot, queue, state, position, limit)
    table = snapshot.table
    return JobPage(
        queue=queue,
        state=state,
        total=table[queue][state],
        jobs=rows,
        next_cursor=next_cursor,
        counts=table,
        waiting_levels=snapshot.levels,
    )
