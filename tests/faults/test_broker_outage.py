"""Redis stopped and restarted under a busy worker and the exporter: every process stays up, nothing is lost, nothing
runs twice; a consumer channel closed after its connection keeps its deliveries leased.

Each test runs its own redis-server (AOF on), stopped and started again on the same port by PID
(`tests.faults.redis_outage`), so the session's Redis and worker never see the outage. Outages last a few seconds
here; nothing in the code depends on their length. Beat through an outage: `tests/faults/test_beat_outage.py`.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.faults.redis_outage import alive, done, outage
from tests.support.procs import RedisServer, wait_for, waiting
from tests.support.scrape import scrape, try_scrape, value

pytestmark = pytest.mark.faults

#: Restarts, pool processes and the lease of the worker, in the test below.
RESTARTS = 3
CONCURRENCY = 4
LEASE_S = 10


def test_worker_survives_three_redis_restarts_under_load(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """A producer sends ledger jobs all along; the worker stays up and every job whose send returned runs once.

    The worker fetches with one Lua script that pops a message and records it as unacknowledged (and leased)
    together, so no restart can fall between the two; a job that completes while Redis is down keeps running,
    stores its result once Redis is back (`result_backend_always_retry`) and its acknowledgement is applied
    then, so it is never delivered again. The last count comes two leases after every job was acknowledged: a job
    whose lease lapsed or was given up has been swept and run again by then.
    """
    key = uuid.uuid4().hex
    env = {"REDIS_URL": own_redis.url, "TEST_LEDGER_URL": ledger_redis.url, "LEASE_SECONDS": str(LEASE_S)}
    worker = make_worker(f"restarts-{key[:6]}", env=env, concurrency=CONCURRENCY)
    worker_pid = worker.pid
    producer = Celery("outage-producer", broker=own_redis.url, set_as_current=False)
    producer.conf.update(task_serializer="json", broker_connection_retry_on_startup=True)
    sent: list[str] = []
    refused = 0
    stop = threading.Event()

    def produce() -> None:
        nonlocal refused
        while not stop.is_set():
            try:
                result = producer.send_task("test.ledger", args=[{"key": key, "sleep_s": 0.1}], queue="default")
            except Exception:  # noqa: BLE001  # the broker is down: this job was not acknowledged to us
                refused += 1
                time.sleep(0.1)
                continue
            sent.append(str(result.id))
            time.sleep(0.05)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        for restart in range(RESTARTS + 1):
            if restart:
                outage(own_redis, 3.0)
            target = len(done(ledger_redis, key)) + 20
            wait_for(lambda: len(done(ledger_redis, key)) >= target, 30, 0.1, what=f"jobs after {restart} restarts")  # noqa: B023
    finally:
        stop.set()
        thread.join(30)
        producer.close()
    broker = own_redis.client()

    def settled() -> bool:
        return (
            broker.llen("default") == 0 and broker.hlen("unacked") == 0 and not set(sent) - set(done(ledger_redis, key))
        )

    try:
        wait_for(settled, 60, 0.2, what="every acknowledged job to run")
    except TimeoutError:
        missing = set(sent) - set(done(ledger_redis, key))
        state = {"queued": waiting(broker, "default"), "unacked": broker.hgetall("unacked"), "missing": missing}
        raise AssertionError(f"not settled: {state}\n{worker.log()[-3000:]}") from None
    # Every lease that could still lapse has lapsed, and its job been swept and run again, before the last count.
    time.sleep(2 * LEASE_S)  # not a wait for an outcome: the time a re-run needs to show
    wait_for(settled, 60, 0.2, what="every job run again after a lapsed lease to be acknowledged")
    assert alive(worker.proc, worker_pid), f"worker exited:\n{worker.log()[-3000:]}"
    assert "Unrecoverable error" not in worker.log()
    runs = collections.Counter(done(ledger_redis, key))
    lost = set(sent) - set(runs)
    twice = {job: n for job, n in runs.items() if n > 1}
    print(f"sent {len(sent)}, refused {refused}, ran {len(runs)}, lost {len(lost)}, ran more than once {len(twice)}")
    assert not lost, f"{len(lost)} acknowledged jobs never ran"
    named = [line for line in worker.log().splitlines() if any(job in line for job in twice)]
    assert not twice, f"ran more than once: {twice}\n" + "\n".join(named)


def test_exporter_serves_through_an_outage_and_recovers(own_redis: RedisServer, work_dir: Path) -> None:
    from tests.support.procs import free_port

    port = free_port()
    argv = [str(Path(sys.executable).parent / "pipeline"), "exporter", "--port", str(port), "--address", "127.0.0.1"]
    with (work_dir / f"exporter-outage-{port}.log").open("wb") as log:
        proc = subprocess.Popen(argv, env={**os.environ, "REDIS_URL": own_redis.url}, stdout=log, stderr=log)
    try:
        pid = proc.pid
        up = wait_for(lambda: try_scrape(port), 20, 0.2, what="exporter /metrics")
        assert isinstance(up, dict)
        assert value(up, "pipeline_broker_up") == 1
        own_redis.stop()
        try:
            down = scrape(port)  # 200: scrape() raises on an HTTP error
            assert value(down, "pipeline_broker_up") == 0
            assert value(down, "pipeline_queue_depth") is None  # no stale figures while Redis is away
        finally:
            own_redis.start()
        wait_for(lambda: value(scrape(port), "pipeline_broker_up") == 1, 20, 0.2, what="pipeline_broker_up back to 1")
        assert alive(proc, pid)
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


@pytest.mark.parity
def test_a_channel_closed_after_its_connection_keeps_its_deliveries_leased(own_redis: RedisServer, leases: Any) -> None:
    """The crash a Redis restart under load caused: kombu closes the transport (`transport.client = None`)
    before a channel still holding delivered jobs, whose restore then read `client.hostname`. Now a channel
    closed by a lost connection restores nothing (its jobs go on running): its deliveries stay leased to
    this worker, renewed, and are acknowledged later."""
    from kombu import Connection, Exchange, Producer, Queue

    from pipeline.constants import LEASE_KEY
    from pipeline.delivery.transport import bound

    transport = bound(leases)
    name = f"outage-q-{uuid.uuid4().hex[:6]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    client = own_redis.client()
    with Connection(own_redis.url, transport=transport) as conn:
        channel = conn.channel()
        Producer(channel).publish({"n": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
        message = queue(channel).get(no_ack=False)
        assert message is not None
        assert client.hlen("unacked") == 1 and client.llen(name) == 0
        # What kombu's Connection.collect/_do_close_transport leave behind for a channel it did not close.
        channel.connection.client = None
        channel._disconnect_pools()
        channel.close()  # kombu 5.7 alone: AttributeError: 'NoneType' object has no attribute 'hostname'
    assert client.llen(name) == 0 and client.hlen("unacked") == 1
    assert client.hget(LEASE_KEY, message.delivery_tag).decode() == leases.owner()
    assert message.delivery_tag in leases.held()
    message.ack()  # on the closed channel: remembered, applied by the renewal
    leases.renew_once(client)
    assert client.hlen("unacked") == 0 and leases.pending_acks() == 0
