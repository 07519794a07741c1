"""Celery's revoke broadcast, read as kombu's Redis transport publishes it, beside the worker's own control consumer.

`app.control.revoke(id, terminate=True)`, `celery control terminate <signal> <id>` and Flower's terminate button
broadcast one control message on Celery's mailbox exchange (`celery.pidbox`, a fanout exchange). kombu's Redis
transport PUBLISHes a fanout message on the topic `<keyprefix_fanout><exchange>` (`Channel._get_publish_topic`: a
broadcast has no routing key), `keyprefix_fanout` being `/<db>.` (the broker's database number) unless the transport
option `fanout_prefix` names another prefix (a string) or none (False). The payload is kombu's envelope (JSON: the
body, base64 under `properties.body_encoding`, with its content type and the `expires` header of
`kombu.pidbox.Mailbox._publish`); the body is Celery's control call, `{"method", "arguments", "destination",
"pattern", "matcher"}`, dispatched to a node as `kombu.pidbox.Node.handle_message` does.

The worker's control consumer runs on its main thread, which a job holds in a solo worker (and a plain job of the
asyncio pool): a revoke sent meanwhile would be read after the job ended. `pipeline.runtime.cancels` hears the
topic on its own thread and stops the job as a cancel does; Celery's own handler still runs once the thread is free
(it finds the job finished, REVOKED, and replies).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from typing import Any

from kombu.matcher import match

#: Celery's control commands that revoke with `terminate` (`celery/worker/control.py`: `revoke`, `terminate`).
TERMINATING = frozenset({"revoke", "terminate"})


def topic(db: int, exchange: str, transport_options: Mapping[str, Any]) -> str:
    """The PUB/SUB channel kombu's Redis transport publishes a broadcast of `exchange` on, for database `db`."""
    prefix = transport_options.get("fanout_prefix", True)
    keyprefix = prefix if isinstance(prefix, str) else "/{db}." if prefix else ""
    return keyprefix.format(db=db) + exchange


def _body(envelope: Mapping[str, Any]) -> Any:
    raw: Any = envelope.get("body")
    if (envelope.get("properties") or {}).get("body_encoding") == "base64":
        raw = base64.b64decode(raw)
    if envelope.get("content-type") != "application/json":
        return None  # the worker accepts JSON only (`accept_content`)
    return json.loads(raw)


def _for(node: str, call: Mapping[str, Any]) -> bool:
    destination = call.get("destination")
    if destination:
        return node in destination
    pattern, matcher = call.get("pattern"), call.get("matcher")
    return bool(match(node, pattern, matcher)) if pattern and matcher else True  # type: ignore[arg-type]  # kombu's stub says bytes; Node.handle_message passes its str hostname


def terminated_ids(data: bytes | str, node: str) -> list[str]:
    """The task ids a broadcast `data` revokes with `terminate` on node `node` (e.g. `celery@host`); [] for any
    other broadcast, one for another node, one expired, or one that cannot be read."""
    try:
        envelope = json.loads(data)
        expires = (envelope.get("headers") or {}).get("expires")
        if expires and time.time() > float(expires):
            return []
        call = _body(envelope)
        if not isinstance(call, dict) or call.get("method") not in TERMINATING or not _for(node, call):
            return []
        arguments = call.get("arguments") or {}
        if call["method"] == "revoke" and not arguments.get("terminate"):
            return []
        ids = arguments.get("task_id")
    except (ValueError, TypeError, AttributeError):  # not a control message this reads: Celery's consumer has it
        return []
    ids = [ids] if isinstance(ids, str) else ids
    return [str(i) for i in ids] if isinstance(ids, list) else []
