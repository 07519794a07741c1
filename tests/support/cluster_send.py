"""Celery's publish on a Redis Cluster from a process of its own (`tests.support.cluster_producer`), called from a
test: the process's last line of output, as JSON."""

from __future__ import annotations

import json
from typing import Any

from tests.support.procs import run_python


def produce(env: dict[str, str], *argv: str) -> Any:
    """Run `python -m tests.support.cluster_producer <argv>` with `env`; what it printed last."""
    done = run_python(env, "-m", "tests.support.cluster_producer", *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def send(env: dict[str, str], queue: str, key: str, n: int, sleep_s: float, once: bool = False) -> dict[str, Any]:
    """`n` `test.ledger` jobs sent with Celery's `send_task` on the cluster: their ids, and when the first was sent.
    `once`: each sleeps on its first delivery only."""
    return dict(produce(env, "send", queue, key, str(n), str(sleep_s), *(["once"] if once else [])))
