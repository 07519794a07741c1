"""Priorities: the list a job of each priority waits in is kombu's, an urgent job overtakes a backlog on a real
worker, a bad priority is refused at enqueue, and `pipeline queues` shows the waiting jobs per level."""

from __future__ import annotations

import json
import uuid

import pytest
from kombu import Connection

from pipeline.broker import queue_keys, queue_stats
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.errors import PriorityInvalid
from pipeline.producer import template
from pipeline.queues import priority
from tests.support.cli import run_cli
from tests.support.inproc import InProcessWorker
from tests.support.procs import RedisServer, wait_for
from tests.support.worker_app import ledger, ledger_client

pytestmark = pytest.mark.integration


def test_each_priority_waits_in_the_list_kombu_uses(redis_server: RedisServer) -> None:
    """Our mapping (`pipeline.queues.priority`) and the list our producer writes (the template's, which `enqueue.lua`
    pushes to) are kombu's own `_q_for_pri`, read from kombu at test time; the message carries the priority, and a
    job sent without one carries TASK_DEFAULT_PRIORITY."""
    with Connection(redis_server.url) as connection:
        channel = connection.default_channel
        assert priority.level_key("q", 3) == channel._q_for_pri("q", 3)
        for p in range(priority.MIN_PRIORITY, priority.MAX_PRIORITY + 1):
            assert priority.priority_key("email", p) == channel._q_for_pri("email", p), p
        assert queue_keys("email") == [channel._q_for_pri("email", step) for step in channel.priority_steps]

        default = get_settings().task_default_priority
        assert priority.level(default) > 0  # below the top: an urgent job overtakes a default one
        for p in (None, *range(10)):
            tpl = template.template_for(
                ledger.name, lambda prod, i, d, h, p=p: ledger._sender(p)(prod, i, d, h, None), priority=p
            )
            sent = default if p is None else p
            assert tpl.dest == channel._q_for_pri(ledger.queue, sent), p
            envelope = json.loads(tpl.message(template.Job("i", "{}", "", 1.0, "i", None, "t", "e"), "r"))
            assert envelope["properties"]["priority"] == sent

        # A foreign client's `send_task` with our app's routes: no priority → the default; its own wins.
        app = get_app()
        assert app.amqp.router.route({}, "email.send")["priority"] == default
        assert app.amqp.router.route({"priority": 0}, "email.send")["priority"] == 0
        assert app.amqp.router.route({}, "anything.else")["priority"] == default


def test_an_urgent_job_starts_before_a_backlog_drains(session_worker: InProcessWorker) -> None:
    """A backlog of default-priority jobs, then a priority-0 job through `enqueue` and one through a foreign
    client's `send_task(priority=0)`: the real worker runs both while most of the backlog still waits."""
    key = f"prio-{uuid.uuid4().hex[:8]}"
    backlog = ledger.enqueue_many([{"key": key}] * 100)
    urgent = ledger.enqueue({"key": key}, priority=0)
    foreign = get_app().send_task("test.ledger", args=[{"key": key}], priority=0).id
    done = f"test:done:{key}"
    client = ledger_client()
    wait_for(lambda: client.llen(done) >= 102, 60, 0.05, what="the backlog and the urgent jobs to finish")
    order = [i.decode() for i in client.lrange(done, 0, -1)]
    assert sorted(order) == sorted([*backlog, urgent, foreign])  # every job ran once
    for job in (urgent, foreign):
        assert order.index(job) < 30, f"{job} ran at position {order.index(job)} of {len(order)}"
    client.delete(done, f"test:ledger:{key}")


def test_a_bad_priority_is_refused_before_anything_is_sent(spare_queue: str) -> None:
    for bad in (10, -1, 1.5, "0", True):
        with pytest.raises(PriorityInvalid, match="priority"):
            ledger.enqueue({"key": "never"}, priority=bad)  # type: ignore[arg-type]
        with pytest.raises(PriorityInvalid, match="priority"):
            ledger.enqueue_many([{"key": "never"}], priority=bad)  # type: ignore[arg-type]

    refused = run_cli("enqueue", "test-ledger", '{"key": "never"}', "--priority", "10", "--json")
    assert refused.returncode == 2
    assert "from 0 (most urgent) to 9" in json.loads(refused.stdout)["error"]
    assert run_cli("enqueue", "test-ledger", '{"key": "never"}', "--priority", "high").returncode == 2
    many = run_cli("enqueue-many", "test-ledger", '[{"key": "never"}]', "--priority", "-1")
    assert many.returncode == 2 and "priority" in many.stderr


def test_queues_show_the_waiting_jobs_per_level(redis_server: RedisServer, spare_queue: str) -> None:
    client = redis_server.client()
    for p, n in ((0, 1), (4, 2), (9, 3)):
        client.lpush(priority.priority_key(spare_queue, p), *[b"{}"] * n)
    (stats,) = queue_stats((spare_queue,))
    assert stats.levels == {0: 1, 3: 2, 6: 0, 9: 3} and stats.depth == 6

    shown = run_cli("queues", "--json")
    assert shown.returncode == 0
    for queue in json.loads(shown.stdout)["queues"]:
        assert list(queue["levels"]) == ["0", "3", "6", "9"]
        assert sum(queue["levels"].values()) == queue["depth"]
    text = run_cli("queues").stdout
    assert text.splitlines()[0].split()[:6] == ["QUEUE", "DEPTH", "P0", "P3", "P6", "P9"]
