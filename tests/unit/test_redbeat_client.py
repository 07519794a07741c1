"""`pipeline.compat.redbeat.install_client` (beat's cluster client) against redbeat's own `get_redis`: the client it
installs is the one `get_redis` returns, wrapped in `RetryingConnection` exactly when redbeat wraps a client it makes
itself (its `retry_period` option), with the same retries."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery
from redbeat.schedulers import RetryingConnection, get_redis

from pipeline.compat.redbeat import install_client


def _app(options: dict[str, Any]) -> Celery:
    app = Celery("redbeat-client", set_as_current=False)
    app.conf.update(redbeat_redis_url="redis://127.0.0.1:1/0", redbeat_redis_options=options)
    return app


@pytest.mark.parity
@pytest.mark.parametrize("options", [{"retry_period": 3, "socket_timeout": 1.0}, {"socket_timeout": 1.0}])
def test_get_redis_returns_the_installed_client_wrapped_as_its_own(options: dict[str, Any]) -> None:
    theirs = get_redis(_app(options))  # what redbeat makes (no connection is opened)
    app = _app(options)
    client = redis.Redis(host="127.0.0.1", port=1, decode_responses=True)
    install_client(app, client)
    ours = get_redis(app)

    assert type(ours) is type(theirs)
    if isinstance(theirs, RetryingConnection):
        assert ours.wrapped_connection is client
        assert ours.retry_kwargs.keys() == theirs.retry_kwargs.keys()
        assert ours.retry_kwargs["stop"].max_delay == theirs.retry_kwargs["stop"].max_delay == options["retry_period"]
    else:
        assert ours is client
    assert get_redis(app) is ours, "redbeat keeps the installed client"
