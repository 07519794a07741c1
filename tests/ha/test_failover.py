"""The primary SIGKILLed under load, on a primary, a replica and three Sentinels (`tests.support.topology`).

A producer process enqueues ledger jobs at `RATE` per second with REDIS_WAIT_REPLICAS=1, a prefork worker consumes
them (its REDIS_URL lists the three Sentinels) and a beat fires a ledger entry every `EVERY` seconds. The jobs record
their runs in a ledger Redis that is not the broker. The primary is SIGKILLed in the middle of the load; once the
Sentinels have promoted the replica, the killed node comes back as a replica of the new primary (as its supervisor
would restart it), so writes that wait for one replica can succeed again. Then:

- lost = 0: every job whose enqueue returned ran (an enqueue that raised is not counted as acknowledged);
- jobs run twice are counted and stay within `TWICE_BOUND` (a job that finished and whose acknowledgement had not
  reached the replica when the primary died runs again: at most the jobs the worker settles in the replication
  lag, that is its pool (CONCURRENCY) plus its prefetch (PREFETCH per process) of deliveries in flight);
- worker and beat are alive and serving: jobs enqueued after the failover run, beat's entry goes on firing;
- beat fired no slot twice (two sends of its entry less than half an interval apart);
- the worker is still on the pipeline's transport after reconnecting: its log never says `Connected to sentinel://`
  (kombu's stock transport), and a job fetched after the failover holds a lease (`pipeline:lease`).

The figures are printed: `first_run_s` (SIGKILL to the first job run after it, on the new primary), `failover_s`
(SIGKILL to the first run of a job enqueued after it), jobs run twice, enqueues refused.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.constants import LEASE_KEY, UNACKED_KEY
from tests.support.beat import Beat
from tests.support.procs import ROOT, RedisServer, Worker, stop_process, wait_for
from tests.support.topology import Topology

RATE = 15.0
EVERY = 2.0
CONCURRENCY = 2
PREFETCH = 4
#: Jobs run twice per failover, at most: a worker's deliveries in flight (pool plus prefetch) whose acknowledgement
#: the primary took but had not passed on when it died.
TWICE_BOUND = CONCURRENCY + CONCURRENCY * PREFETCH
#: Every this-many jobs one takes `SLOW_S` seconds, so a job is running when the test looks at its lease.
SLOW_EVERY = 30
SLOW_S = 3.0


def produce(stop_file: str) -> None:
    """The producer process: enqueue ledger jobs at RATE/s until `stop_file` exists; one line per enqueue on stdout:
    `OK <key> <task id> <time>` or `ERR <key> <error> <time>`."""
    from tests.support.worker_app import LedgerJob, ledger

    n = 0
    start = time.monotonic()
    while not os.path.exists(stop_file):
        key = f"{'slow' if n % SLOW_EVERY == SLOW_EVERY - 1 else 'job'}-{n}"
        job = LedgerJob(key=key, sleep_s=SLOW_S if key.startswith("slow") else 0.0)
        try:
            task_id = ledger.enqueue(job)
        except Exception as exc:  # noqa: BLE001  # counted as not acknowledged
            print(f"ERR {key} {type(exc).__name__} {time.time()}", flush=True)
        else:
            print(f"OK {key} {task_id} {time.time()}", flush=True)
        n += 1
        time.sleep(max(0.0, start + n / RATE - time.monotonic()))


class Producer:
    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.stop_file = directory / "producer.stop"
        self.out = directory / "producer.out"
        code = f"from tests.ha.test_failover import produce; produce({str(self.stop_file)!r})"
        with self.out.open("wb") as out, (directory / "producer.err").open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def lines(self) -> list[list[str]]:
        return [line.split() for line in self.out.read_text().splitlines() if line.strip()]

    def acknowledged(self) -> dict[str, float]:
        """Key → time of every enqueue that returned."""
        return {parts[1]: float(parts[3]) for parts in self.lines() if parts[0] == "OK"}

    def refused(self) -> int:
        return sum(1 for parts in self.lines() if parts[0] == "ERR")

    def stop(self) -> None:
        self.stop_file.touch()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)


def runs(ledger: redis.Redis, keys: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Key → the completed runs the ledger holds (one per finished attempt, with its time from the attempt)."""
    pipe = ledger.pipeline(transaction=False)
    for key in keys:
        pipe.lrange(f"test:done:{key}", 0, -1)
        pipe.lrange(f"test:ledger:{key}", 0, -1)
    replies = pipe.execute()
    found: dict[str, list[dict[str, Any]]] = {}
    for i, key in enumerate(keys):
        done, attempts = replies[2 * i], replies[2 * i + 1]
        found[key] = [json.loads(a) for a in attempts][: len(done)] if done else []
    return found


def settled(ledger: redis.Redis, keys: list[str], quiet_s: float = 5.0, timeout: float = 40.0) -> dict[str, Any]:
    """The runs of `keys` once every one has run, or once no further one finished for `quiet_s` seconds."""
    deadline = time.monotonic() + timeout
    last, quiet_since = -1, time.monotonic()
    while True:
        done = runs(ledger, keys)
        finished = sum(1 for r in done.values() if r)
        if finished == len(keys) or time.monotonic() > deadline or time.monotonic() - quiet_since > quiet_s:
            return done
        if finished != last:
            last, quiet_since = finished, time.monotonic()
        time.sleep(0.5)


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    topo = Topology(tmp_path / "topology").start()
    yield topo
    topo.stop()


@pytest.fixture
def ledger_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "ledger").start()
    yield server
    server.stop()


_SENT = re.compile(r"^\[?(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+)")


def beat_sends(beat: Beat, entry: str) -> list[float]:
    """The times beat sent `entry`, from its log lines."""
    from datetime import datetime

    times = []
    for line in beat.log().splitlines():
        if f"Sending due task {entry} " not in line:
            continue
        if line.startswith("{"):
            record = json.loads(line)
            stamp = record.get("timestamp") or record.get("time") or record.get("asctime")
        else:
            match = _SENT.match(line)
            stamp = match.group(1) if match else None
        assert stamp, f"no time in beat's log line: {line}"
        times.append(datetime.fromisoformat(str(stamp).replace(",", ".")).timestamp())
    return times


def lease_of_running(primary: redis.Redis, ledger: redis.Redis, keys: list[str]) -> tuple[str, bytes | None] | None:
    """For a job among `keys` that started and has not finished: (its task id, its lease owner on `primary`)."""
    for key in keys:
        attempts = ledger.lrange(f"test:ledger:{key}", 0, -1)
        if not attempts or ledger.llen(f"test:done:{key}"):
            continue
        task_id = json.loads(attempts[-1])["task_id"]
        for tag, raw in primary.hgetall(UNACKED_KEY).items():
            message = json.loads(raw)[0]
            if message.get("headers", {}).get("id") == task_id:
                return task_id, primary.hget(LEASE_KEY, tag)
    return None


@pytest.fixture
def stops() -> Iterator[list[Callable[[], None]]]:
    """What the test started, stopped by PID when it ends, whatever step failed (last first)."""
    started: list[Callable[[], None]] = []
    yield started
    for stop in reversed(started):
        stop()


def test_a_primary_killed_under_load_loses_no_acknowledged_job(
    topology: Topology, ledger_redis: RedisServer, tmp_path: Path, stops: list[Callable[[], None]]
) -> None:
    run = uuid.uuid4().hex[:6]
    entry = f"ha-beat-{run}"
    env = {
        **topology.beat_env(entry, f"beat-{run}", EVERY, wait_timeout_ms=1000),
        "LEASE_SECONDS": "5",
        "TEST_LEDGER_URL": ledger_redis.url,
        "WORKER_PREFETCH_MULTIPLIER": str(PREFETCH),
        "DELAYED_POLL_INTERVAL": "60",
    }
    logs = tmp_path / "logs"
    ledger = ledger_redis.client()
    worker = Worker(f"ha-{run}", logs, env, concurrency=CONCURRENCY)
    stops.append(worker.stop)
    worker.start()
    beat = Beat(run, logs, env)
    stops.append(beat.stop)
    beat.start()
    producer = Producer(tmp_path, env)
    stops.append(producer.stop)
    try:
        wait_for(lambda: len(producer.acknowledged()) >= 4 * RATE, 30, 0.2, what="four seconds of enqueues")
        wait_for(lambda: ledger.llen(f"test:done:beat-{run}") >= 2, 20, 0.2, what="two beat slots run")

        old, killed = topology.kill_primary()
        killed_wall = time.time()
        new = topology.wait_promoted(old)
        promoted_s = time.monotonic() - killed
        topology.restart_as_replica(old, new)
        resynced_s = time.monotonic() - killed

        # Load goes on; a job enqueued after the failover is fetched on the pipeline's transport (it holds a lease).
        def after_kill() -> list[str]:
            return [k for k, t in producer.acknowledged().items() if t > killed_wall]

        wait_for(lambda: any(k.startswith("slow") for k in after_kill()), 30, 0.2, what="a slow job after the kill")
        leased = wait_for(
            lambda: lease_of_running(new.client(), ledger, [k for k in after_kill() if k.startswith("slow")]),
            20,
            0.1,
            what="a slow job enqueued after the failover to be running",
        )
        wait_for(lambda: len(after_kill()) >= 6 * RATE, 30, 0.2, what="six seconds of enqueues after the failover")
    finally:
        producer.stop()

    acked = producer.acknowledged()
    keys = sorted(acked)
    done = settled(ledger, keys)
    lost = [k for k, r in done.items() if not r]
    twice = {k: len(r) for k, r in done.items() if len(r) > 1}
    first_after = min(r[0]["t"] for k, r in done.items() if acked[k] > killed_wall)
    first_run = min(run["t"] for r in done.values() for run in r if run["t"] > killed_wall)

    # Beat goes on after the failover and fired no slot twice.
    wait_for(lambda: any(t > killed_wall + promoted_s for t in beat_sends(beat, entry)), 20, 0.2, what="beat after")
    sends = beat_sends(beat, entry)
    gaps = [b - a for a, b in itertools.pairwise(sends)]

    figures = {
        "first_run_s": round(first_run - killed_wall, 2),
        "failover_s": round(first_after - killed_wall, 2),
        "promoted_s": round(promoted_s, 2),
        "resynced_s": round(resynced_s, 2),
        "acknowledged": len(acked),
        "refused": producer.refused(),
        "lost": len(lost),
        "run_twice": len(twice),
        "beat_sends": len(sends),
        "beat_min_gap_s": round(min(gaps), 2),
    }
    print("FAILOVER", json.dumps(figures))
    log = worker.log()
    assert not lost, f"acknowledged and never run: {lost[:10]} ({figures})"
    assert len(twice) <= TWICE_BOUND, f"run twice: {twice} ({figures})"
    assert worker.proc is not None and worker.proc.poll() is None, "the worker died"
    assert beat.proc is not None and beat.proc.poll() is None, "beat died"
    assert "Connected to sentinel://" not in log, "the worker reconnected on kombu's stock transport"
    assert log.count("Connected to pipeline.delivery.transport:SentinelTransport_") >= 2, "no reconnection seen"
    task_id, owner = leased  # type: ignore[misc]
    assert owner is not None, f"job {task_id}, fetched after the failover, holds no lease"
    assert owner.decode().split(":")[1] == str(worker.pid), f"job {task_id} leased by {owner!r}"
    assert min(gaps) > EVERY / 2, f"beat fired a slot twice: gaps {gaps}"
