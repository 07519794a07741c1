"""A steady stream of `test.ledger` jobs from the pipeline's producer onto one queue of a Redis Cluster, run as a
process of its own: what the cluster fault tests send while a master fails or a slot moves.

`python -m tests.support.cluster_stream <queue> <key> <sleep_s>` enqueues one job after another (`enqueue` with an
idempotency key per job) until `test:stop:<key>` is set in the ledger (`TEST_LEDGER_URL`). A job whose enqueue
raised is enqueued again with the same idempotency key until it is acknowledged (the producer's contract: a retry
with the key never makes a second job). Each acknowledged id is pushed on `test:acked:<key>:<queue>` of the ledger, each
error's type on `test:errors:<key>`; the last line printed is `{"acked": n, "errors": m}`.

The process's REDIS_URL names the cluster; REDIS_WAIT_REPLICAS=1 makes an acknowledgement mean "on a replica".
"""

from __future__ import annotations

import json
import sys
import time

from tests.support.ledger_tasks import ledger_client
from tests.support.worker_app import app, ledger

#: How long one job may keep failing before the stream gives up on it (seconds).
RETRY_FOR_S = 60.0
#: The pause between two jobs of the stream (seconds): a steady load the workers keep up with.
PACE_S = 0.05


def _route(queue: str) -> None:
    """Send `test.ledger` to `queue` (before the app's router is first built)."""
    app.conf.task_routes = {"test.ledger": {"queue": queue}, **dict(app.conf.task_routes or {})}


def _enqueue_until_acknowledged(payload: dict[str, object], key: str, errors_key: str) -> str:
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            return ledger.enqueue(payload, idempotency_key=key)
        except Exception as exc:  # every refusal is retried with the same key, and counted
            ledger_client().rpush(errors_key, f"{type(exc).__name__}: {exc}"[:300])
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main(queue: str, key: str, sleep_s: float) -> None:
    _route(queue)
    assert ledger.queue == queue, ledger.queue
    records = ledger_client()
    acked, errors = f"test:acked:{key}:{queue}", f"test:errors:{key}"
    n = 0
    while not records.exists(f"test:stop:{key}"):
        task_id = _enqueue_until_acknowledged({"key": key, "sleep_s": sleep_s}, f"{key}-{queue}-{n}", errors)
        records.rpush(acked, task_id)
        n += 1
        time.sleep(PACE_S)
    print(json.dumps({"acked": n, "errors": records.llen(errors)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
