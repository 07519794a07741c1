"""The result backend: Celery's Redis backend, storing a job's state in one round trip instead of two.

Celery's key-value backends read the stored state before every write and skip the write when it is
SUCCESS (`celery/backends/base.py: BaseKeyValueStoreBackend._store_result`: a redelivered job must not
overwrite a result that is already final). On Redis that is a GET, then a MULTI with SETEX and PUBLISH:
two round trips in the process that runs the job, for every state it stores (FAILURE, RETRY, PROGRESS,
STARTED where tracked, SUCCESS). `_store_result` here does the same in one Lua call (`pipeline/lua/store.lua`):
read the stored state, leave a SUCCESS (or a REVOKED: a cancelled job stays cancelled) alone, else SETEX and
PUBLISH the new one. What is stored (the encoded meta, with `result_extended` fields), the key, its expiry and the
message published are Celery's own, so every reader (`AsyncResult`, `pipeline.status`, the job browser) is
unchanged. The meta is built and encoded as
Celery's `_get_result_meta` and `encode` do, without a settings search, a timezone round trip and kombu's
registry per state stored.

A worker whose event loop runs the job itself (a solo worker) can take a SUCCESS off the backend's hands: it sets
`carrier` on these backend classes (`pipeline.delivery.acks.enable_carried_results`; a test may set it on one
backend), and the same `store` function (`pipeline/lua/parts/results.lua`, included in the delivery layer's
scripts) then runs inside the script that acknowledges the job, so the result and the acknowledgement land together,
in one round trip and atomically.

A flow's step stores its SUCCESS with the call that records its node instead (`success_to_store`, then
`mark_stored`: the backend's own write of that SUCCESS is skipped), when the backend is on the broker's Redis.

Outside the Celery, kombu and redis-py versions this was verified on (`pipeline.compat.versions`), each backend
takes Celery's own `_store_result`, `_get_result_meta` and `encode` (decided once per backend), and no carrier
is asked.

Leases live on the broker's Redis. A backend on another database or server (RESULT_BACKEND_URL) reads the job's lease
there first and stores unfenced on its own Redis, and no carrier is asked (a carrier stores on the broker's Redis).
On the broker's Redis, `store.lua` is given the job's record (`pipeline:job:<id>`) to drop with a SUCCESS. On a Redis
Cluster the same store is fenced by the result's owner stamp instead (`pipeline.compat.clusterresults`).

Both classes also read a result's parents once more when `AsyncResult.get()` found the result final at once
(`pipeline.compat.resultwait`), as Celery up to 5.6 did.

`pipeline.celery_app` makes the app use these classes for `redis://`, `rediss://` and `sentinel://` URLs
(`Celery.loader.override_backends`, named by `pipeline.config.celery.BACKENDS`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

from celery import states
from celery.app import task as celery_task
from celery.backends.redis import RedisBackend as CeleryRedisBackend
from celery.backends.redis import SentinelBackend as CelerySentinelBackend
from celery.exceptions import BackendStoreError
from kombu import serialization
from kombu.exceptions import EncodeError
from kombu.utils import json as kombu_json
from kombu.utils.encoding import bytes_to_str, ensure_bytes

from pipeline import compat
from pipeline.broker import broker_redis
from pipeline.compat.resultwait import ParentsReadAfterWait
from pipeline.config import get_settings
from pipeline.constants import HEADER_LEASE_OWNER, HEADER_LEASE_QUEUE, LEASE_KEY
from pipeline.lua import script
from pipeline.queues import jobkeys, keys

log = logging.getLogger(__name__)

#: kombu's JSON encoder (`kombu.utils.json.dumps` builds one per call, with these same defaults).
_JSON = kombu_json.JSONEncoder()
#: The same, without the blanks after separators: what a stored state is written with (any JSON reader reads it).
_COMPACT_JSON = kombu_json.JSONEncoder(separators=(",", ":"))

#: A task class attribute: False when its SUCCESS is stored without what the job no longer needs once it succeeded
#: (`lean_success`). Celery's tasks keep every `result_extended` field (True when the attribute is absent); the
#: pipeline's typed tasks set it False (`pipeline.task.PipelineTask`).
KEEPS_ARGS = "result_keeps_args"

#: The request attribute saying the job's SUCCESS was stored with another write (`mark_stored`).
_STORED = "pipeline_result_stored"

#: A stored result as a carrier takes it: the task's key, the encoded meta, its expiry in seconds (0: none), and the
#: delivery tag of the job ('' when it was not a leased delivery: stored unfenced).
Stored = tuple[bytes, Any, int, str]


def lease_of(request: Any) -> tuple[str, str]:
    """(delivery tag, lease owner) of the job `request` stores a state for, from its delivery info and the header the
    worker's fetch set (`HEADER_LEASE_OWNER`); ('', '') when it was not a leased delivery (nothing to fence)."""
    info = getattr(request, "delivery_info", None)
    tag = info.get("delivery_tag") if isinstance(info, dict) else None
    if not tag:  # Celery rebuilds a task's delivery_info without the tag; kombu's message properties carry it
        properties = getattr(request, "properties", None)
        tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    owner = getattr(request, HEADER_LEASE_OWNER, None)
    if not tag or not owner:
        return "", ""
    return str(tag), str(owner)


def _ignored(task: Any, request: Any) -> bool:
    """Whether Celery stores no result for `request`'s job (the request's `ignore_result`, else the task's)."""
    actual = getattr(celery_task, "get_actual_ignore_result", None)  # Celery 5.5+: celery.app.task's own rule
    return bool(actual(task, request) if actual is not None else task.ignore_result)


class OneTripStore:
    """`_store_result` in one Lua call (mixed into Celery's Redis backends), and Celery's result meta built
    without a settings search and a timezone round trip per state stored."""

    #: Whether this backend runs the replacements (verified versions), read once per backend.
    _verified: bool | None = None
    #: Whether `encode` may skip kombu's registry: JSON, uncompressed, kombu's own encoder (read once per backend).
    _plain_json: bool | None = None
    #: `result_extended`, read once per backend (Celery searches the settings for it on every store).
    _extended: bool | None = None
    #: Called with a SUCCESS about to be stored; True when it took the write over (it stores the result with the
    #: job's acknowledgement). Set by a solo worker's delivery layer, as a static hook; None elsewhere.
    carrier: Callable[[Stored, Any], bool] | None = None

    def _fast(self: Any) -> bool:
        if self._verified is None:
            self._verified = compat.enabled(__name__)
        return bool(self._verified)

    def _store_result(
        self: Any, task_id: str, result: Any, state: str, traceback: Any = None, request: Any = None, **kwargs: Any
    ) -> Any:
        if not self._fast():
            return super()._store_result(task_id, result, state, traceback, request, **kwargs)  # type: ignore[misc]  # the Celery backend it is mixed into
        if state == states.SUCCESS and getattr(request, _STORED, False):
            return result
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        value = self._encode_stored(meta, state, request, task_id)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)  # type: ignore[call-arg]  # celery-types lags: Celery passes both
        expires = self.failure_expires if state == states.FAILURE else self.expires
        key = self.get_key_for_task(task_id)
        tag, owner = lease_of(request)
        carrier = self.carrier if _on_broker() else None  # it stores on the broker's Redis
        if state == states.SUCCESS and carrier is not None and carrier((key, value, int(expires or 0), tag), request):
            return result
        self.ensure(self._store_once, (key, value, int(expires or 0), tag, owner, _lease_key(request)))
        return result

    def success_to_store(self: Any, task: Any, result: Any) -> tuple[str, str, int, str, str] | None:
        """The SUCCESS of `task`'s current job as `_store_result` would store it, for a script that stores it with
        writes of its own (fenced the same way): (the task's key, the encoded meta, its expiry in seconds (0: none),
        the delivery tag and lease owner, both '' when not leased). None when it is stored its own way: unverified
        versions, a result store on another Redis than the broker's, results ignored, a value too large."""
        request = task.request
        if not self._fast() or not _on_broker() or _ignored(task, request):
            return None
        task_id = str(request.id)
        meta = self._get_result_meta(result=result, state=states.SUCCESS, traceback=None, request=request)
        value = self._encode_stored(meta, states.SUCCESS, request, task_id)
        if not isinstance(value, str) or len(value) > self._MAX_STR_VALUE_SIZE:
            return None
        tag, owner = lease_of(request)
        return bytes_to_str(self.get_key_for_task(task_id)), value, int(self.expires or 0), tag, owner

    @staticmethod
    def mark_stored(request: Any) -> None:
        """The SUCCESS `success_to_store` gave for `request`'s job was stored (or fenced): the backend's own write of
        it is skipped."""
        setattr(request, _STORED, True)

    def _encode_stored(self: Any, meta: dict[str, Any], state: str, request: Any, task_id: str) -> Any:
        """The text a state is stored as: Celery's meta with its `task_id` last (`store`, in
        `pipeline/lua/parts/results.lua`, reads it there), compact, and a typed task's SUCCESS lean
        (`lean_success`). Outside the plain JSON path, Celery's own `encode` of the whole meta."""
        if not self._plain_json_path():
            meta["task_id"] = bytes_to_str(task_id)
            return self.encode(meta)
        if state == states.SUCCESS and not self._keeps_args(request):
            lean_success(meta, request)
        meta["task_id"] = bytes_to_str(task_id)
        try:
            return _COMPACT_JSON.encode(meta)
        except Exception as exc:  # kombu's registry wraps any encoder error the same way
            raise EncodeError(exc) from exc

    def _keeps_args(self: Any, request: Any) -> bool:
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        return bool(getattr(task, KEEPS_ARGS, True))

    def _plain_json_path(self: Any) -> bool:
        """Whether `encode` may skip kombu's registry: kombu's JSON, uncompressed, verified versions (decided once)."""
        if self._plain_json is None:
            registered = cast(Any, serialization).registry._encoders.get("json")  # kombu's own; untyped
            self._plain_json = (
                self._fast()
                and self.serializer == "json"
                and not self.compression
                and registered is not None
                and registered[2] is kombu_json.dumps
            )
        return bool(self._plain_json)

    def encode(self: Any, data: Any) -> Any:
        """Celery's `Backend.encode`: the same text, without kombu's registry lookup, its error-wrapping context
        manager and a new encoder per call, when the result serializer is kombu's JSON, uncompressed (and the
        versions are verified)."""
        if not self._plain_json_path():
            return super().encode(data)  # type: ignore[misc]  # the Celery backend it is mixed into
        try:
            return _JSON.encode(data)
        except Exception as exc:  # kombu's registry wraps any encoder error the same way
            raise EncodeError(exc) from exc

    def _get_result_meta(
        self: Any,
        result: Any,
        state: str,
        traceback: Any,
        request: Any,
        format_date: bool = True,
        encode: bool = False,
    ) -> dict[str, Any]:
        """What `celery.backends.base.Backend._get_result_meta` (5.7) returns, field for field (tested against it):
        `date_done` is the app's now (`datetime.now(app.timezone)`, the instant `Celery.now()` gives through
        two conversions), `result_extended` is read once."""
        if not self._fast():
            return super()._get_result_meta(result, state, traceback, request, format_date, encode)  # type: ignore[misc, no-any-return]  # the Celery backend it is mixed into
        if self._extended is None:
            self._extended = bool(self.app.conf.find_value_for_key("extended", "result"))
        date_done: Any = None
        if state in self.READY_STATES:
            date_done = datetime.now(self.app.timezone)
            if format_date:
                date_done = date_done.isoformat()
        meta: dict[str, Any] = {
            "status": state,
            "result": result,
            "traceback": traceback,
            "children": self.current_task_children(request),
            "date_done": date_done,
        }
        if request and getattr(request, "group", None):
            meta["group_id"] = request.group
        if request and getattr(request, "parent_id", None):
            meta["parent_id"] = request.parent_id
        if self._extended and request:
            info = getattr(request, "delivery_info", None)
            extended = {
                "name": getattr(request, "task", None),
                "args": getattr(request, "args", None),
                "kwargs": getattr(request, "kwargs", None),
                "worker": getattr(request, "hostname", None),
                "retries": getattr(request, "retries", None),
                "queue": info.get("routing_key") if info else None,
            }
            if getattr(request, "stamps", None):
                extended["stamped_headers"] = request.stamped_headers
                extended.update({k: v for k, v in request.stamps.items() if k in (request.stamped_headers or ())})
            if encode:  # args and kwargs encoded before saving, as Celery does
                for name in ("args", "kwargs"):
                    extended[name] = ensure_bytes(self.encode(extended[name]))
            meta.update(extended)
        return meta

    def _store_once(
        self: Any, key: bytes, value: Any, expires: int, tag: str = "", owner: str = "", lease: str = LEASE_KEY
    ) -> None:
        """`store.lua`: fenced by the job's lease (a worker that lost it stores nothing) and, with
        REDIS_WAIT_REPLICAS, followed by WAIT on the same connection. Leases live on the broker's Redis: a result
        backend elsewhere (another database or server) stores only once the lease was found held there (`_held`)."""
        if tag and not _on_broker():
            if not _held(tag, owner, lease):
                _fenced(key, tag)
                return
            tag = owner = ""  # checked on the broker: the backend's Redis has no leases to check
        args = [value, expires, tag, owner]
        record = jobkeys.record_of_result(bytes_to_str(key), False) if _on_broker() else None
        names: list[bytes | str] = [key, LEASE_KEY, *([record] if record else [])]
        wanted = get_settings().redis_wait_replicas
        if wanted <= 0:
            stored = script("store")(keys=names, args=args, client=self.client)
        else:
            pipe = self.client.pipeline(transaction=False)
            script("store")(keys=names, args=args, client=pipe)
            pipe.execute_command("WAIT", wanted, get_settings().redis_wait_timeout_ms)
            stored, reached = pipe.execute()
            _short_of_replicas(key, int(reached))
        if stored == -1:
            _fenced(key, tag)


def lean_success(meta: dict[str, Any], request: Any) -> None:
    """A succeeded job's meta without what no reader needs once it succeeded: the job's arguments (`args`, `kwargs`:
    its payload, which the pipeline keeps out of logs, events' readers and the job browser; a failed job's stay, and
    its dead-letter entry has them), an empty `traceback` and `children`. Its ETA, which the accepted-job record held
    (a stored SUCCESS drops that record: `pipeline/lua/parts/results.lua`), is kept when it had one."""
    for name in ("args", "kwargs"):
        meta.pop(name, None)
    if meta.get("traceback") is None:
        meta.pop("traceback", None)
    if not meta.get("children"):
        meta.pop("children", None)
    eta = getattr(request, "eta", None)
    if eta:
        meta["eta"] = eta if isinstance(eta, str) else eta.isoformat()


def _on_broker() -> bool:
    """Whether the result backend is the broker's Redis (same URL): where the leases are."""
    settings = get_settings()
    return settings.result_url == settings.broker_url


def _held(tag: str, owner: str, lease: str = LEASE_KEY) -> bool:
    """Whether `owner` holds delivery `tag`'s lease, read on the broker's Redis (in hash `lease`). Checked before the
    store, not with it (two servers): a lease lost between the two lets one state through, never over a SUCCESS
    (`store.lua`)."""
    with broker_redis() as client:  # the app's broker pool: TLS and Sentinel as Celery's own; a cluster's client
        return bytes_to_str(client.hget(lease, tag) or b"") == owner


def _lease_key(request: Any) -> str:
    """The hash holding the lease of the job `request` stores a state for: `pipeline:lease`, or on a Redis Cluster
    its queue's (`pipeline:{<q>}:lease`), named by the header the worker's fetch set (`HEADER_LEASE_QUEUE`)."""
    queue = getattr(request, HEADER_LEASE_QUEUE, None)
    return keys.lease(str(queue), True) if queue else LEASE_KEY


def _short_of_replicas(key: bytes, reached: int) -> None:
    """A WARNING when a result's WAIT reached fewer replicas than REDIS_WAIT_REPLICAS."""
    wanted = get_settings().redis_wait_replicas
    if reached < wanted:
        log.warning(
            "result of %s reached %d of %d Redis replica(s) (REDIS_WAIT_REPLICAS): a failover could lose it",
            bytes_to_str(key),
            reached,
            wanted,
        )


def _fenced(key: bytes, tag: str) -> None:
    log.warning(
        "result of %s not stored: this worker lost the job's lease (%s) to another worker (fenced)",
        bytes_to_str(key),
        tag,
    )


class RedisBackend(OneTripStore, ParentsReadAfterWait, CeleryRedisBackend):
    """Celery's `redis://` and `rediss://` backend with the one-trip store, reading a result's parents after a wait
    that ran none (`pipeline.compat.resultwait`)."""


class SentinelBackend(OneTripStore, ParentsReadAfterWait, CelerySentinelBackend):
    """Celery's `sentinel://` backend with the one-trip store, reading a result's parents as `RedisBackend` does."""
