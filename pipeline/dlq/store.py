"""The dead-letter queue in Redis: kombu's list `dead_letter` and an index beside it, changed together.

The list stays what kombu and other Celery tooling read: kombu envelopes, newest at the left. Beside it
two hashes make an entry O(1) to find:

On a Redis Cluster the hashes carry the list's hash tag (``pipeline:{dead_letter}:dlq:index``, ``...:tasks``:
`pipeline.queues.keys.dlq_index`), so each MULTI touches one slot.

* ``pipeline:dlq:index`` — entry id → the exact list element (the envelope, and what LREM needs);
* ``pipeline:dlq:tasks`` — original task id → entry id (of the task's newest entry).

Every write changes the list and both hashes in one MULTI (under WATCH where it first reads what it
removes): a publish (LPUSH, retention trim, HSET), a replay or delete (LREM, HDEL), a purge. A lookup
is one transaction of HGETs plus LLEN and HLEN (and one more HGET by task id), never a read of the list.

Every list element has exactly one field in the index (an element that is not an envelope of ours under
``~<sha1 of it>``), so LLEN equals HLEN. A lookup checks that in the same round trip; when it does not
hold (entries written before the index existed, or the list changed by other tooling such as
``celery purge``) the index is rebuilt from one scan of the list and the lookup is answered from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
from redis.client import Pipeline
from redis.exceptions import WatchError

from pipeline.broker import broker_redis, decode_message
from pipeline.constants import DEAD_LETTER_QUEUE
from pipeline.queues import keys

T = TypeVar("T")
Raw = bytes | str


def _index() -> str:
    """The hash entry id -> element (`pipeline:{dead_letter}:dlq:index` on a cluster: the list's slot)."""
    return keys.dlq_index()[0]


def _tasks() -> str:
    """The hash task id -> entry id (in the list's slot on a cluster)."""
    return keys.dlq_index()[1]


def _lrange(pipe: redis.Redis | Pipeline, start: int, end: int) -> list[bytes]:
    return [r if isinstance(r, bytes) else str(r).encode() for r in pipe.lrange(DEAD_LETTER_QUEUE, start, end)]


def _lrem(pipe: Pipeline, raw: Raw) -> None:
    pipe.lrem(DEAD_LETTER_QUEUE, 1, cast(str, raw))  # redis-py sends bytes as they are; its stubs say str


def element_ids(raw: Raw) -> tuple[str, str | None]:
    """(index field, original task id) of one list element."""
    try:
        body = decode_message(raw)["body"]
    except (ValueError, TypeError, AttributeError, KeyError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("id"), str):
        task_id = body.get("task_id")
        return body["id"], task_id if isinstance(task_id, str) else None
    data = raw if isinstance(raw, bytes) else raw.encode()
    return "~" + hashlib.sha1(data, usedforsecurity=False).hexdigest(), None


def _atomic(client: redis.Redis, watches: Sequence[str], build: Callable[[Pipeline], T]) -> tuple[T, list[Any]]:
    """Run `build` (reads, then `pipe.multi()` and writes) under WATCH until no watched key changed meanwhile."""
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(*watches)  # type: ignore[no-untyped-call]
                value = build(pipe)
                return value, pipe.execute()
            except WatchError:
                continue


def _unindex(pipe: Pipeline, gone: Sequence[tuple[str, str | None]], pointers: Sequence[Any]) -> None:
    """Queue HDELs for removed elements; a task pointer only while it still names the removed entry."""
    if gone:
        pipe.hdel(_index(), *[field for field, _ in gone])
    stale = [task for (field, task), now in zip(gone, pointers, strict=True) if task and _text(now) == field]
    if stale:
        pipe.hdel(_tasks(), *stale)


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _pointers(pipe: Pipeline, gone: Sequence[tuple[str, str | None]]) -> list[Any]:
    tasks = [task or "" for _, task in gone]
    return list(pipe.hmget(_tasks(), tasks)) if any(tasks) else [None] * len(gone)


def push(raw: str, entry_id: str, task_id: str | None, keep: int) -> None:
    """LPUSH one envelope, index it, and trim the list to its newest `keep` elements, in one transaction."""

    def write(pipe: Pipeline) -> None:
        beyond = [element_ids(r) for r in _lrange(pipe, keep - 1, -1)]  # past `keep` after the push
        pointers = _pointers(pipe, beyond)
        pipe.multi()
        pipe.lpush(DEAD_LETTER_QUEUE, raw)
        pipe.ltrim(DEAD_LETTER_QUEUE, 0, keep - 1)
        _unindex(pipe, beyond, pointers)  # before the new fields: the new entry may share a trimmed one's task
        pipe.hset(_index(), entry_id, raw)
        if task_id:
            pipe.hset(_tasks(), task_id, entry_id)

    with broker_redis() as client:
        _atomic(client, (DEAD_LETTER_QUEUE, _tasks()), write)


def lookup(ident: str) -> bytes | None:
    """The list element of the entry with this entry id or original task id, or None. O(1)."""
    with broker_redis() as client:
        for attempt in range(2):
            pipe = client.pipeline(transaction=True)
            pipe.hget(_index(), ident)
            pipe.hget(_tasks(), ident)
            pipe.llen(DEAD_LETTER_QUEUE)
            pipe.hlen(_index())
            raw, entry_id, length, indexed = pipe.execute()
            if length != indexed and attempt == 0:
                reindex(client)
                continue
            if raw is None and entry_id is not None:
                raw = client.hget(_index(), entry_id)
            return raw if isinstance(raw, bytes) or raw is None else str(raw).encode()
    return None


def lookup_tasks(task_ids: Sequence[str]) -> dict[str, bytes]:
    """The list element of the newest entry of each of these original task ids that has one, in two round trips
    (the index checked as `lookup` checks it)."""
    ids = list(task_ids)
    if not ids:
        return {}
    with broker_redis() as client:
        for attempt in range(2):
            pipe = client.pipeline(transaction=True)
            pipe.hmget(_tasks(), ids)
            pipe.llen(DEAD_LETTER_QUEUE)
            pipe.hlen(_index())
            entry_ids, length, indexed = pipe.execute()
            if length != indexed and attempt == 0:
                reindex(client)
                continue
            found = {task_id: str(_text(e)) for task_id, e in zip(ids, entry_ids, strict=True) if e is not None}
            raws = client.hmget(_index(), list(found.values())) if found else []
            return {
                task_id: raw if isinstance(raw, bytes) else str(raw).encode()
                for task_id, raw in zip(found, raws, strict=True)
                if raw is not None
            }
    return {}


def reindex(client: redis.Redis) -> int:
    """Rebuild both hashes from one scan of the list; return how many elements it holds."""

    def rebuild(pipe: Pipeline) -> int:
        raws = _lrange(pipe, 0, -1)
        fields: dict[str, bytes] = {}
        tasks: dict[str, str] = {}
        for raw in raws:  # newest first: a task's newest entry keeps the task pointer
            field, task_id = element_ids(raw)
            if field in fields:  # the same envelope twice: the older copy is indexed as a foreign element
                field, task_id = "~" + hashlib.sha1(raw, usedforsecurity=False).hexdigest(), None
            fields[field] = raw
            if task_id:
                tasks.setdefault(task_id, field)
        pipe.multi()
        pipe.delete(_index(), _tasks())
        if fields:
            pipe.hset(_index(), items=[x for pair in fields.items() for x in pair])
        if tasks:
            pipe.hset(_tasks(), items=[x for pair in tasks.items() for x in pair])
        return len(raws)

    return _atomic(client, (DEAD_LETTER_QUEUE,), rebuild)[0]


def remove_one(client: redis.Redis, raw: Raw) -> bool:
    """Remove one element from the list and the index; False if it was no longer in the list."""
    gone = [element_ids(raw)]

    def write(pipe: Pipeline) -> None:
        pointers = _pointers(pipe, gone)
        pipe.multi()
        _lrem(pipe, raw)
        _unindex(pipe, gone, pointers)

    return bool(_atomic(client, (_tasks(),), write)[1][0])


def elements(client: redis.Redis) -> list[bytes]:
    """Every list element, newest first (a scan: for listing and filtered purges only)."""
    return _lrange(client, 0, -1)


def remove_where(drop: Callable[[int, bytes], bool]) -> int:
    """Remove the elements `drop(position, element)` selects (newest is position 0); return how many.

    One transaction over a snapshot of the list; when the selected elements are its oldest (retention
    by age or count, a purge of everything) one LTRIM removes them, else one LREM each.
    """

    def write(pipe: Pipeline) -> int:
        raws = _lrange(pipe, 0, -1)
        chosen = [drop(position, raw) for position, raw in enumerate(raws)]
        doomed = [raw for raw, out in zip(raws, chosen, strict=True) if out]
        if not doomed:
            return 0
        gone = [element_ids(raw) for raw in doomed]
        pointers = _pointers(pipe, gone)
        kept = chosen.index(True) if all(chosen[chosen.index(True) :]) else None
        pipe.multi()
        if kept == 0:
            pipe.delete(DEAD_LETTER_QUEUE)
        elif kept is not None:
            pipe.ltrim(DEAD_LETTER_QUEUE, 0, kept - 1)
        else:
            for raw in doomed:
                _lrem(pipe, raw)
        _unindex(pipe, gone, pointers)
        return len(doomed)

    with broker_redis() as client:
        return _atomic(client, (DEAD_LETTER_QUEUE, _tasks()), write)[0]
