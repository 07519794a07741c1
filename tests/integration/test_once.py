"""The once-guard's states against a real Redis: claim, take-over, commit, unknown outcome, release, done."""

from __future__ import annotations

import uuid

import pytest

from pipeline.errors import TransientError
from pipeline.once import LEASE_S, Once, OutcomeUnknown
from tests.support.procs import RedisServer

pytestmark = pytest.mark.integration


def guard(redis_server: RedisServer, key: str, task_id: str) -> Once:
    return Once(redis_server.client(), "test.once", key, task_id, ttl=600)


def test_done_result_is_returned_to_later_attempts(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    first = guard(redis_server, key, "t1")
    assert first.claim() is None
    first.committing()
    first.done({"message_id": "<m>"})
    assert guard(redis_server, key, "t1").claim() == {"message_id": "<m>"}
    assert guard(redis_server, key, "t2").claim() == {"message_id": "<m>"}
    assert redis_server.client().ttl(first.key) > LEASE_S


def test_claim_by_another_job_is_transient_and_same_job_takes_over(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    died = guard(redis_server, key, "t1")
    assert died.claim() is None
    assert 0 < redis_server.client().ttl(died.key) <= LEASE_S
    with pytest.raises(TransientError, match="being prepared"):
        guard(redis_server, key, "t2").claim()
    again = guard(redis_server, key, "t1")  # a later attempt of the job whose first attempt died before sending
    assert again.claim() is None
    with pytest.raises(TransientError, match="lost the claim"):
        died.committing()  # the dead attempt, were it still alive, can no longer send
    again.committing()


def test_attempt_that_died_while_sending_is_not_repeated(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    died = guard(redis_server, key, "t1")
    died.claim()
    died.committing()
    with pytest.raises(OutcomeUnknown, match=died.key):
        guard(redis_server, key, "t1").claim()


def test_release_lets_a_retry_claim(redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    failed = guard(redis_server, key, "t1")
    failed.claim()
    failed.committing()
    failed.release()  # the server refused the message: nothing was sent
    assert redis_server.client().get(failed.key) is None
    assert guard(redis_server, key, "t1").claim() is None
