"""Celery's own publish on a Redis Cluster URL, run as a process of its own (its settings are the cluster's).

`python -m tests.support.cluster_producer send <queue> <key> <n> <sleep_s>` sends `n` `test.ledger` jobs with
`send_task` and prints their ids and when the first was sent (JSON); `... await <queue> <key> <n> <sleep_s>` the same
with `test.await` jobs (async: the asyncio pool's); `... get <queue> <key>` runs one with `delay()`
(its route: `queue`) and prints its `get()`; `... store <queue> <tag> <owner> <task id>` stores a SUCCESS as the
worker's result backend does for delivery `tag` of `queue` held by `owner`, and prints whether it was stored;
`... stamp <queue> <tag> <owner> <task id> <count>` writes the result's owner stamp as a worker's fetch does
(`pipeline.delivery.stamps`) and prints whether it was written; `... fail <queue> -` runs a `plain.add` whose result is
ignored, then one that raises, and prints their ids and the second's state; `... canvas <queue> -` runs a group and a
chord of `plain.add` (the chord's body `plain.total`) and prints their results; `... ping - <timeout>` broadcasts
Celery's ping and prints the replies.
`store` takes an optional state (SUCCESS by default) and prints the stored meta's result (the owner that stored it)
with whether this call stored it. `... loop <queue> -` runs `tests.support.cluster_loop_probe` on `queue`."""

from __future__ import annotations

import json
import sys
import time

from celery import chord, group

from pipeline.lua import script
from pipeline.queues import jobkeys, keys
from tests.support import plain_tasks
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
    elif mode == "store":  # key: a delivery tag; then the owner storing, the task id, the state
        owner, task_id, state = (*argv[3:5], argv[5] if len(argv) > 5 else "SUCCESS")
        name = app.backend.get_key_for_task(task_id)
        before = app.backend.client.get(name)
        meta = json.dumps({"status": state, "result": owner, "task_id": task_id}, separators=(",", ":"))
        app.backend._store_once(name, meta, 0, key, owner, keys.lease(queue, True))
        after = app.backend.client.get(name)
        print(
            json.dumps({"stored": after is not None and after != before, "by": after and json.loads(after)["result"]})
        )
    elif mode == "stamp":  # key: a delivery tag; then the owner, the task id, the delivery count
        owner, task_id, count = argv[3:6]
        stamp = jobkeys.stamp(jobkeys.result(task_id))
        done = script("stamp")(keys=[stamp], args=[key, owner, count, 3600], client=app.backend.client)
        print(json.dumps({"stamped": bool(done)}))
    elif mode == "fail":  # a job whose result is ignored, then one that fails (TypeError): its FAILURE stored
        ignored = plain_tasks.add.apply_async((1, 2), queue=queue, ignore_result=True)
        failing = plain_tasks.add.apply_async(("a", 1), queue=queue)
        failing.get(timeout=60, propagate=False)
        print(json.dumps({"id": failing.id, "state": failing.state, "ignored": ignored.id}))
    elif mode == "canvas":
        together = group(plain_tasks.add.s(n, n) for n in range(5)).apply_async(queue=queue)
        joined = chord(plain_tasks.add.s(n, 1) for n in range(4))(plain_tasks.total.s().set(queue=queue))
        print(json.dumps({"group": together.get(timeout=60), "chord": joined.get(timeout=60)}))
    else:
        assert queue == ledger.queue, f"test.ledger is routed to {ledger.queue}"
        result = ledger.task.delay({"key": key})
        print(json.dumps({"id": result.id, "result": result.get(timeout=60)}))


if __name__ == "__main__":
    main(sys.argv[1:])
