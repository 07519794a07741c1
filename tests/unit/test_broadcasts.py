"""`pipeline.delivery.broadcasts` on envelopes it must not act on: expired, unreadable, not JSON, not a terminate
(what kombu publishes is compared with upstream in tests/faults/test_delivery_parity.py)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from pipeline.delivery import broadcasts


def envelope(call: dict[str, Any], *, expires: float | None = None, content_type: str = "application/json") -> bytes:
    body = base64.b64encode(json.dumps(call).encode()).decode()
    return json.dumps(
        {
            "body": body,
            "content-type": content_type,
            "content-encoding": "utf-8",
            "headers": {"clock": 1, "expires": expires},
            "properties": {"body_encoding": "base64"},
        }
    ).encode()


REVOKE = {"method": "revoke", "arguments": {"task_id": "a", "terminate": True}, "destination": None}


def test_a_revoke_with_terminate_names_its_ids() -> None:
    assert broadcasts.terminated_ids(envelope(REVOKE), "w@h") == ["a"]
    assert broadcasts.terminated_ids(envelope(REVOKE, expires=time.time() + 60), "w@h") == ["a"]


def test_an_expired_or_unreadable_broadcast_names_none() -> None:
    assert broadcasts.terminated_ids(envelope(REVOKE, expires=time.time() - 1), "w@h") == []
    assert broadcasts.terminated_ids(envelope(REVOKE, content_type="application/x-python-serialize"), "w@h") == []
    assert broadcasts.terminated_ids(b"not json", "w@h") == []
    assert broadcasts.terminated_ids(b'{"body": "!!", "properties": {"body_encoding": "base64"}}', "w@h") == []
    assert (
        broadcasts.terminated_ids(envelope({"method": "revoke", "arguments": {"task_id": 7, "terminate": 1}}), "w@h")
        == []
    )


def test_the_topic_follows_kombus_fanout_prefix() -> None:
    assert broadcasts.topic(2, "celery.pidbox", {}) == "/2.celery.pidbox"
    assert broadcasts.topic(2, "celery.pidbox", {"fanout_prefix": "x:"}) == "x:celery.pidbox"
    assert broadcasts.topic(2, "celery.pidbox", {"fanout_prefix": False}) == "celery.pidbox"
