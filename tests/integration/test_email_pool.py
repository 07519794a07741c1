"""email.send's pooled SMTP sessions, counted at a real SMTP server (aiosmtpd) of each test's own.

The task's coroutine (`tasks.email.deliver`, the whole send: once-guard in Redis, message, SMTP) runs here as a worker
runs it: one job after another on the thread's event loop, as in a solo worker, or many at once on one loop
(`asyncio.gather`), as on the asyncio pool.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from pipeline.broker import broker_redis
from pipeline.config import Settings, load_settings
from pipeline.once import ONCE_KEY
from pipeline.pools import aio
from pipeline.task import JobContext
from tasks import email, mailer
from tasks.email import EmailJob, EmailResult
from tests.support.procs import free_port, wait_for
from tests.support.smtp import SmtpServer

pytestmark = pytest.mark.integration
POOL_SIZE = 4
WELCOME = {"name": "Ada", "product": "Pipeline", "action_url": "https://example.com/start"}


@pytest.fixture
def server() -> Iterator[SmtpServer]:
    smtp = SmtpServer(free_port()).start()
    yield smtp
    aio.resolve(aio.close_loop_resources())  # the sessions this thread's loop opened: QUIT
    smtp.stop()


@pytest.fixture
def settings(server: SmtpServer, monkeypatch: pytest.MonkeyPatch) -> Settings:
    settings = load_settings(
        smtp_host="127.0.0.1", smtp_port=server.port, smtp_security="none", smtp_pool_size=POOL_SIZE
    )
    monkeypatch.setattr(email, "get_settings", lambda: settings)
    return settings


def address(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}@example.com"


def send_all(addresses: list[str]) -> list[EmailResult]:
    """Every send at once on this thread's event loop, as the asyncio pool runs jobs in flight."""

    async def together() -> list[EmailResult]:
        return list(await asyncio.gather(*(email.deliver(*job(to)) for to in addresses)))

    return aio.resolve(together())  # type: ignore[no-any-return]  # resolve returns what the coroutine does


def job(to: str) -> tuple[EmailJob, JobContext]:
    task_id = str(uuid.uuid4())
    ctx = JobContext(task_id=task_id, attempt=1, idempotency_key=task_id, report=lambda state, meta: None)
    return EmailJob(to=[to], template_id="welcome", variables=WELCOME), ctx


def delivered_once(server: SmtpServer, addresses: list[str]) -> bool:
    return all(len(server.recorder.delivered_to(to)) == 1 for to in addresses)


@pytest.mark.usefixtures("settings")
def test_jobs_one_after_another_reuse_one_session(server: SmtpServer) -> None:
    addresses = [address("sequential") for _ in range(20)]
    for to in addresses:
        result: EmailResult = aio.resolve(email.deliver(*job(to)))
        assert result.recipients == [to]
    assert server.recorder.connections == 1
    assert server.recorder.rsets == len(addresses) - 1  # RSET between messages
    assert delivered_once(server, addresses)


@pytest.mark.usefixtures("settings")
def test_jobs_in_flight_share_at_most_smtp_pool_size_sessions(server: SmtpServer) -> None:
    server.recorder.data_delay = 0.05  # each DATA takes a while: the sends overlap
    addresses = [address("concurrent") for _ in range(10 * POOL_SIZE)]
    results = send_all(addresses)
    assert [r.recipients for r in results] == [[to] for to in addresses]
    assert server.recorder.open_max == POOL_SIZE  # the bound held, and was reached
    assert server.recorder.connections == POOL_SIZE  # each session carried ten messages
    assert delivered_once(server, addresses)

    aio.resolve(aio.close_loop_resources())  # what the worker does when it stops
    assert server.recorder.quits == POOL_SIZE
    wait_for(lambda: not server.recorder.open_now, 10, 0.01, what="the sessions to close")


@pytest.mark.usefixtures("settings")
def test_sessions_the_server_dropped_while_idle_are_reopened_and_each_job_sends_once(server: SmtpServer) -> None:
    before = [address("before") for _ in range(2 * POOL_SIZE)]
    server.recorder.data_delay = 0.02
    send_all(before)
    assert server.recorder.connections == POOL_SIZE
    server.drop_connections()  # its idle timeout: every pooled session is gone, the client not told yet
    wait_for(lambda: not server.recorder.open_now, 10, 0.01, what="the server to hang up")

    after = [address("after") for _ in range(2 * POOL_SIZE)]
    results = send_all(after)
    assert [r.recipients for r in results] == [[to] for to in after]
    assert server.recorder.connections == 2 * POOL_SIZE  # each dropped session reopened once
    assert delivered_once(server, before + after)
    assert all(server.recorder.attempts[to] == 1 for to in before + after)  # no DATA twice

    one_more = address("sequential")
    server.drop_connections()
    wait_for(lambda: not server.recorder.open_now, 10, 0.01, what="the server to hang up")
    assert aio.resolve(email.deliver(*job(one_more))).recipients == [one_more]
    assert server.recorder.attempts[one_more] == 1


@pytest.mark.usefixtures("settings")
def test_a_connection_lost_during_data_is_not_retried_by_the_mailer(server: SmtpServer) -> None:
    """From DATA on, the outcome is the job's (docs/tasks.md, "No double send"): the mailer never sends again on its
    own."""
    aio.resolve(email.deliver(*job(address("warm-up"))))  # a pooled session, reused below
    to, (payload, ctx) = address("hangup"), job("x@example.com")
    payload = payload.model_copy(update={"to": [to]})
    with pytest.raises(mailer.SmtpTransient, match="SMTP connection failed"):
        aio.resolve(email.deliver(payload, ctx))
    assert server.recorder.attempts[to] == 1
    with broker_redis() as client:  # the send guard was released, as for any NotDelivered: the job's retry sends
        assert not client.exists(ONCE_KEY.format(task="email.send", key=ctx.idempotency_key))
