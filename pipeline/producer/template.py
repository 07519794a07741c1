"""Per-task message templates: kombu's envelope captured from one real Celery publish, refilled per job.

Celery builds a job's message in `amqp.as_task_v2` and kombu wraps it in its Redis envelope; for one task
sent from one process, only a handful of fields change from job to job: the task id (also `root_id` and
`correlation_id`), kombu's `delivery_tag`, the body (the payload), `argsrepr`, the `published_at` header,
`parent_id`/`root_id` inside a running task, and the thread's `reply_to`. A `Template` is the envelope Celery
produced for a sample job, serialised once and split around those fields; `message()` joins the parts with
the job's values, giving the bytes kombu would have written. When the app sends `task-sent` events
(`task_send_sent_event`), the event's envelope is templated the same way and published in the same round trip,
so Flower still sees the job as sent.

Jobs with an ETA, and any option a template does not cover, go through Celery itself
(`pipeline.publish.capture`).
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery.utils.saferepr import saferepr
from kombu import Producer

from pipeline.celery_app import get_app
from pipeline.constants import HEADER_FLOW, HEADER_GROUP, HEADER_IDEMPOTENCY_KEY, HEADER_PUBLISHED_AT, HEADER_RATE_KEY
from pipeline.publish import capture

#: A value no job has: the sample job's task id, payload and publish time are found by it.
_SAMPLE_ID = "00000000-0000-4000-8000-00000000feed"
_SAMPLE_PUBLISHED_AT = 0.5


def _marker(name: str) -> str:
    return f"@@pipeline-field:{name}@@"


class _Split:
    """JSON text with named fields cut out: `fill(values)` puts each field's JSON back in its place."""

    def __init__(self, document: Any, fields: tuple[str, ...]) -> None:
        text = json.dumps(document)
        self.parts: list[str] = []
        self.names: list[str] = []
        while True:
            at = {name: text.find(json.dumps(_marker(name))) for name in fields}
            found = [(pos, name) for name, pos in at.items() if pos >= 0]
            if not found:
                break
            pos, name = min(found)
            self.parts.append(text[:pos])
            self.names.append(name)
            text = text[pos + len(json.dumps(_marker(name))) :]
        self.parts.append(text)
        if sorted(self.names) != sorted(fields):
            raise RuntimeError(f"message template: expected each of {fields} once, found {self.names}")

    def fill(self, values: Mapping[str, str]) -> str:
        out = [self.parts[0]]
        for name, part in zip(self.names, self.parts[1:], strict=True):
            out.append(values[name])
            out.append(part)
        return "".join(out)


def _q(text: str) -> str:
    """JSON for a string known to need no escaping (ids, base64)."""
    return f'"{text}"'


@dataclass
class Job:
    """The per-job values of one message."""

    task_id: str
    #: The payload as JSON (`json.dumps` of the dumped model, as kombu's serializer writes it).
    payload_json: str
    argsrepr: str
    published_at: float
    root_id: str
    parent_id: str | None
    #: kombu's delivery tags of the message and of its `task-sent` event (random UUIDs).
    tag: str
    event_tag: str
    #: The `pipeline_idempotency_key` header (only in a keyed template's messages).
    idempotency_key: str | None = None
    #: The `pipeline_group` header (only in a grouped template's messages).
    group: str | None = None
    #: The `pipeline_flow` header (only in a flow step template's messages: `pipeline.flows`).
    flow: dict[str, Any] | None = None
    #: The `pipeline_rate_key` header (only in a rated template's messages: a task whose cluster limit has a key).
    rate: str | None = None


def _mark_optional(headers: dict[str, Any], header: str, name: str) -> bool:
    """Whether the sample carries the optional `header`; if it does, its value becomes the marker `name`."""
    if header not in headers:
        return False
    headers[header] = _marker(name)
    return True


class Template:
    """Messages of one task from this process (see the module docstring)."""

    def __init__(self, dest: str, envelope: dict[str, Any], event: tuple[str, dict[str, Any]] | None) -> None:
        self.dest = dest
        self.repr_limits = ReprLimits.of_app()
        body = base64.b64decode(envelope["body"]).decode()
        head = '[[{"sample": true}]'
        if not body.startswith(head):
            raise RuntimeError(f"message template: unexpected body {body[:200]!r}")
        self.body_tail = body[len(head) :]  # ", {}, {embed}]"
        headers, properties = envelope["headers"], envelope["properties"]
        # Built inside a running job (a flow's next step), the sample names that job as its parent and root.
        if headers["id"] != _SAMPLE_ID or "root_id" not in headers or "parent_id" not in headers:
            raise RuntimeError("message template: the sample job's ids are not where Celery puts them")
        envelope["body"] = _marker("body")
        headers.update(
            id=_marker("id"),
            root_id=_marker("root_id"),
            parent_id=_marker("parent_id"),
            argsrepr=_marker("argsrepr"),
        )
        headers[HEADER_PUBLISHED_AT] = _marker("published_at")
        # Whether messages carry each optional header (templates with and without one differ).
        #: An idempotency key header.
        self.keyed = _mark_optional(headers, HEADER_IDEMPOTENCY_KEY, "idem")
        #: A group header.
        self.grouped = _mark_optional(headers, HEADER_GROUP, "group")
        #: A flow step header.
        self.flowed = _mark_optional(headers, HEADER_FLOW, "flow")
        #: A rate key header.
        self.rated = _mark_optional(headers, HEADER_RATE_KEY, "rate")
        properties.update(
            correlation_id=_marker("id2"),
            reply_to=_marker("reply_to"),
            delivery_tag=_marker("tag"),
        )
        fields: tuple[str, ...] = (
            "body",
            "id",
            "root_id",
            "parent_id",
            "argsrepr",
            "published_at",
            "id2",
            "reply_to",
            "tag",
        )
        fields += ("idem",) if self.keyed else ()
        fields += ("group",) if self.grouped else ()
        fields += ("flow",) if self.flowed else ()
        fields += ("rate",) if self.rated else ()
        self.envelope = _Split(envelope, fields)
        self.event: tuple[str, _Split, _Split] | None = None
        if event is not None:
            channel, event_envelope = event
            event_body = json.loads(base64.b64decode(event_envelope["body"]))
            event_body.update(
                uuid=_marker("id"),
                root_id=_marker("root_id"),
                parent_id=_marker("parent_id"),
                args=_marker("argsrepr"),
                clock=_marker("clock"),
                timestamp=_marker("timestamp"),
            )
            event_envelope["body"] = _marker("body")
            event_envelope["properties"]["delivery_tag"] = _marker("tag")
            body_fields = ("id", "root_id", "parent_id", "argsrepr", "clock", "timestamp")
            self.event = (channel, _Split(event_body, body_fields), _Split(event_envelope, ("body", "tag")))

    def message(self, job: Job, reply_to: str) -> str:
        """kombu's Redis envelope of `job`, as kombu would LPUSH it."""
        body = f"[[{job.payload_json}]{self.body_tail}"
        idem = json.dumps(job.idempotency_key)
        return self.envelope.fill(
            {
                "idem": idem,
                "group": json.dumps(job.group),
                "flow": json.dumps(job.flow),
                "rate": json.dumps(job.rate),
                "body": _q(base64.b64encode(body.encode()).decode()),
                "id": _q(job.task_id),
                "root_id": json.dumps(job.root_id),  # a parent's ids come from its message: escaped
                "parent_id": json.dumps(job.parent_id),
                "argsrepr": json.dumps(job.argsrepr),
                "published_at": repr(job.published_at),
                "id2": _q(job.task_id),
                "reply_to": json.dumps(reply_to),
                "tag": _q(job.tag),
            }
        )

    def sent_event(self, job: Job, clock: int, timestamp: float) -> tuple[str, str] | None:
        """The `task-sent` event's channel and envelope for `job` (None when the app sends no such events)."""
        if self.event is None:
            return None
        channel, body, envelope = self.event
        event_body = body.fill(
            {
                "id": _q(job.task_id),
                "root_id": json.dumps(job.root_id),  # a parent's ids come from its message: escaped
                "parent_id": json.dumps(job.parent_id),
                "argsrepr": json.dumps(job.argsrepr),
                "clock": str(clock),
                "timestamp": repr(timestamp),
            }
        )
        body_b64 = _q(base64.b64encode(event_body.encode()).decode())
        return channel, envelope.fill({"body": body_b64, "tag": _q(job.event_tag)})


def _plain(value: Any, limit: int) -> bool:
    """True when Celery's `saferepr` of `value` is its `repr`: containers nest at most `limit` levels (itself
    included) and every string is printable without a quote or backslash (`saferepr` writes strings as
    `'text'` with only `'` escaped, where `repr` escapes more and may switch quotes)."""
    kind = type(value)
    if kind is str:
        return value.isprintable() and "'" not in value and "\\" not in value
    if kind is dict:
        return limit > 0 and all(_plain(k, 0) and _plain(v, limit - 1) for k, v in value.items())
    if kind is list or kind is tuple:
        return limit > 0 and all(_plain(v, limit - 1) for v in value)
    return kind is int or kind is float or kind is bool or value is None


@dataclass(frozen=True)
class ReprLimits:
    """Celery's limits for `argsrepr`: `app.amqp.argsrepr_maxsize` and `task_repr_maxlevels`."""

    maxsize: int
    levels: int

    @classmethod
    def of_app(cls) -> ReprLimits:
        app = get_app()
        return cls(int(app.amqp.argsrepr_maxsize), int(app.conf.task_repr_maxlevels))


def args_repr(payload: Any, limits: ReprLimits) -> str:
    """Celery's `argsrepr` of a job whose only argument is `payload` (a JSON-mode dict).

    Celery writes `saferepr(args, maxsize, maxlevels)`: for a payload short, shallow and plain enough that
    nothing is cut or quoted differently, that is `repr`, ~10 times cheaper; otherwise Celery's own function
    is called.
    """
    args = (payload,)
    text = repr(args)
    if len(text) < limits.maxsize and _plain(args, limits.levels):
        return text
    return str(saferepr(args, limits.maxsize, maxlevels=limits.levels))


def uuid4_strings(count: int) -> list[str]:
    """`count` random (version 4) UUIDs as Celery and kombu write them, from one `os.urandom` call."""
    raw = bytearray(os.urandom(16 * count))
    out = []
    for i in range(0, 16 * count, 16):
        raw[i + 6] = (raw[i + 6] & 0x0F) | 0x40
        raw[i + 8] = (raw[i + 8] & 0x3F) | 0x80
        h = raw[i : i + 16].hex()
        out.append(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return out


_lock = threading.Lock()
#: (process id, task name, keyed, grouped, priority, flowed) → template; a forked child builds its own (`origin` names
#: the process).
_templates: dict[tuple[int, str, bool, bool, int | None, bool, bool], Template] = {}


def template_for(
    name: str,
    send: Callable[[Producer, str, dict[str, Any], dict[str, Any]], Any],
    keyed: bool = False,
    grouped: bool = False,
    priority: int | None = None,
    flowed: bool = False,
    rated: bool = False,
) -> Template:
    """The template of task `name` (`keyed`: for jobs with an idempotency key; `grouped`: with a group header;
    `flowed`: with a flow step header; `rated`: with a rate key header;
    `priority`: the one `send` gives its jobs, None for the default: the message's priority and its list key differ
    by priority), built on first use from `send(producer, task_id, payload, headers)`: one publish of a sample job
    through Celery, captured (`pipeline.publish.capture`), never sent."""
    key = (os.getpid(), name, keyed, grouped, priority, flowed, rated)
    found = _templates.get(key)
    if found is not None:
        return found
    with _lock:
        if key not in _templates:
            headers: dict[str, Any] = {HEADER_PUBLISHED_AT: _SAMPLE_PUBLISHED_AT}
            if keyed:
                headers[HEADER_IDEMPOTENCY_KEY] = "sample-key"
            if grouped:
                headers[HEADER_GROUP] = "sample-group"
            if flowed:
                headers[HEADER_FLOW] = {"flow": "sample"}
            if rated:
                headers[HEADER_RATE_KEY] = "sample-rate-key"
            captured = capture(lambda producer: send(producer, _SAMPLE_ID, {"sample": True}, headers))
            event = None
            if captured.extra:
                (_, (channel, raw)), *rest = captured.extra
                if rest:
                    raise RuntimeError(f"message template: more than one extra publish for {name}")
                event = (str(channel), json.loads(raw))
            _templates[key] = Template(captured.dest, json.loads(captured.body), event)
        return _templates[key]
