"""The result backend builds the same meta as Celery's own `_get_result_meta`, field for field."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.backends.redis import RedisBackend as CeleryRedisBackend
from celery.result import AsyncResult

from pipeline.config.results import RedisBackend


def _backend(extended: bool, timezone: str) -> RedisBackend:
    app = Celery("meta", set_as_current=False)
    app.conf.update(result_extended=extended, timezone=timezone, enable_utc=True)
    return RedisBackend(app=app, url="redis://127.0.0.1:1/0")  # never connects: only the meta is built


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
