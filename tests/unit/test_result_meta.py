"""The result backend (`pipeline.compat.results`) builds the same meta as Celery's own `_get_result_meta`, field for
field, and encodes it as Celery's `encode` does: each expected value is Celery's own method's, called here on the same
backend."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.backends.redis import RedisBackend as CeleryRedisBackend
from celery.result import AsyncResult
from kombu.exceptions import EncodeError

from pipeline.compat.results import RedisBackend

pytestmark = pytest.mark.parity


def _backend(extended: bool, timezone: str) -> RedisBackend:
    app = Celery("meta", set_as_current=False)
    app.conf.update(result_extended=extended, timezone=timezone, enable_utc=True)
    backend = RedisBackend(app=app, url="redis://127.0.0.1:1/0")  # never connects: only the meta is built
    backend._verified = True  # the replacements run whatever the installed versions (the parity tier's point)
    return backend


def _request(app: Celery, stamped: bool) -> Context:
    fields: dict[str, Any] = {
        "id": "job-1",
        "task": "email.send",
        "args": [{"to": "a@example.com"}],
        "kwargs": {},
        "hostname": "io1@host",
        "retries": 2,
        "group": "group-1",
        "parent_id": "parent-1",
        "delivery_info": {"routing_key": "email", "exchange": ""},
        "children": [AsyncResult("child-1", app=app)],
    }
    if stamped:
        fields.update(stamps={"trace": "t-1", "other": "x"}, stamped_headers=["trace"])
    return Context(fields)


def _without_date(meta: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    rest = dict(meta)
    return rest, rest.pop("date_done")


@pytest.mark.parametrize("extended", [True, False])
@pytest.mark.parametrize("timezone", ["UTC", "Europe/Paris"])
@pytest.mark.parametrize("state", ["SUCCESS", "FAILURE", "STARTED", "PROGRESS"])
@pytest.mark.parametrize("stamped", [True, False])
@pytest.mark.parametrize("encode", [True, False])
def test_the_meta_is_celerys(extended: bool, timezone: str, state: str, stamped: bool, encode: bool) -> None:
    backend = _backend(extended, timezone)
    request = _request(backend.app, stamped)
    args = ({"ok": True}, state, None, request)
    ours, our_date = _without_date(backend._get_result_meta(*args, encode=encode))
    celerys, celery_date = _without_date(CeleryRedisBackend._get_result_meta(backend, *args, encode=encode))
    assert ours == celerys
    assert ("stamped_headers" in ours) == (extended and stamped)
    if celery_date is None:
        assert our_date is None
        return
    ours_at, celery_at = datetime.fromisoformat(our_date), datetime.fromisoformat(celery_date)
    assert ours_at.utcoffset() == celery_at.utcoffset()
    assert abs((ours_at - celery_at).total_seconds()) < 5


def test_an_unformatted_date_is_the_apps_aware_now() -> None:
    backend = _backend(True, "UTC")
    meta = backend._get_result_meta({"ok": True}, "SUCCESS", None, None, format_date=False)
    assert isinstance(meta["date_done"], datetime) and meta["date_done"].utcoffset() is not None
    assert meta["children"] is None and "group_id" not in meta


_VALUES: list[Any] = [
    {"status": "SUCCESS", "result": {"ok": True, "n": 3, "text": "é ✓ \n"}, "traceback": None, "children": []},
    {"status": "FAILURE", "result": {"exc_type": "ValueError", "exc_message": ["bad"]}, "date_done": "2026-12-02"},
    {"when": datetime(2026, 12, 2, 8, 0, tzinfo=UTC), "id": uuid.UUID(int=7), "raw": b"raw", "n": Decimal("1.5")},
    ["a", 1, 2.5, None, True, {"nested": [1, {"deep": "x"}]}],
    "plain text",
]


@pytest.mark.parametrize("value", _VALUES)
def test_a_result_is_encoded_as_celery_encodes_it(value: Any) -> None:
    backend = _backend(extended=False, timezone="UTC")
    ours = backend.encode(value)
    assert backend._plain_json  # the short path ran
    assert ours == CeleryRedisBackend.encode(backend, value)
    assert type(ours) is type(CeleryRedisBackend.encode(backend, value))


def test_what_json_cannot_encode_fails_as_in_celery() -> None:
    backend = _backend(extended=False, timezone="UTC")
    with pytest.raises(EncodeError) as celerys:
        CeleryRedisBackend.encode(backend, {"x": object()})
    with pytest.raises(EncodeError) as ours:
        backend.encode({"x": object()})
    assert str(ours.value) == str(celerys.value)


def test_another_serializer_or_compression_takes_celerys_path() -> None:
    backend = _backend(extended=False, timezone="UTC")
    backend.compression = "zlib"
    value = {"ok": True}
    assert backend.encode(value) == CeleryRedisBackend.encode(backend, value)
    assert backend._plain_json is False
