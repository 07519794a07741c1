"""Celery's own publish on a Redis Cluster URL, run as a process of its own (its settings are the cluster's).

`python -m tests.support.cluster_producer send <queue> <key> <n> <sleep_s>` sends `n` `test.ledger` jobs with
`send_task` and prints their ids and when the first was sent (JSON); `... await <queue> <key> <n> <sleep_s>` the same
with `test.await` jobs (async: the asyncio pool's); `... get <queue> <key>` runs one with `delay()`
(its route: `queue`) and prints its `get()`; `... store <queue> <tag> <owner> <task id>` stores a SUCCESS as the
worker's result backend does for delivery `tag` of `queue` held by `owner`, and prints whether it was stored;
`... ping - <timeout>` broadcasts Celery's ping and prints the replies; `... loop <queue> -` runs
`tests.support.cluster_loop_probe` on `queue`."""

from __future__ import annotations

import json
import sys
import time

from pipeline.queues import keys
from tests.support.worker_app import app, ledger


def main(argv: list[str]) -> None:
    mode, queue, key = argv[:3]
    if mode == "send":
        n, sleep_s = int(argv[3]), float(argv[4])
        payload = {"key": key, "sleep_s": sleep_s, "sleep_once": argv[5:] == ["once"]}
        sent = time.time()
        ids = [str(app.send_task("test.ledger", args=[payload], queue=queue).id) for _ in range(n)]
        print(json.dumps({"ids": ids, "sent": sent}))
    elif mode == "await":
        n, job = int(argv[3]), {"key": key, "sleep_s": float(argv[4])}
        sent = time.time()
        ids = [str(app.send_task("test.await", args=[job], queue=queue).id) for _ in range(n)]
        print(json.dumps({"ids": ids, "sent": sent}))
    elif mode == "loop":  # the transport on kombu's hub (`tests.support.cluster_loop_probe`)
        from tests.support import cluster_loop_probe

        print(json.dumps(cluster_loop_probe.main(queue)))
    elif mode == "ping":  # Celery's control broadcast, its replies on a pidbox reply queue
        print(json.dumps(app.control.ping(timeout=float(key))))
    elif mode == "store":  # key: a delivery tag; then the owner storing, the task id
        owner, task_id = argv[3:5]
        name = app.backend.get_key_for_task(task_id)
        meta = json.dumps({"status": "SUCCESS", "result": None, "task_id": task_id})
        app.backend._store_once(name, meta, 0, key, owner, keys.lease(queue, True))
        print(json.dumps({"stored": bool(app.backend.client.exists(name))}))
    else:
        assert queue == ledger.queue, f"test.ledger is routed to {ledger.queue}"
        result = ledger.task.delay({"key": key})
        print(json.dumps({"id": result.id, "result": result.get(timeout=60)}))


if __name__ == "__main__":
    main(sys.argv[1:])
