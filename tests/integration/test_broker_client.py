"""`pipeline.broker.broker_redis`: every caller reads the replies to its own commands."""

from __future__ import annotations

import uuid

import pytest

from pipeline.broker import broker_redis
from pipeline.celery_app import get_app
from tests.support.procs import RedisServer

pytestmark = pytest.mark.integration


def test_replies_stay_in_step_after_a_control_command_consumed_on_a_pooled_connection(
    redis_server: RedisServer,
) -> None:
    """A control command waiting for replies consumes on a pooled connection (kombu registers its channel for
    BRPOP and leaves one outstanding). The next user of that connection must not read that BRPOP's reply as
    its own, nor any later caller the reply before theirs."""
    get_app().control.ping(timeout=0.3)
    prefix = uuid.uuid4().hex
    for i in range(20):
        with broker_redis() as client:
            client.set(f"{prefix}:{i}", f"value-{i}")
            assert client.get(f"{prefix}:{i}") == f"value-{i}".encode()
            assert client.incr(f"{prefix}:n") == i + 1
