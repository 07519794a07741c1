"""Enqueue `pipeline.probe` jobs from a process of its own, against its own REDIS_URL.

    python -m tests.support.probes COUNT PAYLOAD_JSON [--queue QUEUE] [--wait]

Without `--queue` the typed producer `probe.enqueue` publishes (routed to the default queue); with it,
the same validated payload goes to QUEUE. `--wait` waits for every job to end (failed ones included).
Prints the task ids as a JSON list.
"""

from __future__ import annotations

import argparse
import json
import sys

from celery.result import AsyncResult

from pipeline.celery_app import get_app
from tasks.probe import probe


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="tests.support.probes")
    parser.add_argument("count", type=int)
    parser.add_argument("payload", type=json.loads)
    parser.add_argument("--queue")
    parser.add_argument("--wait", action="store_true")
    args = parser.parse_args(argv)
    if args.queue is None:
        ids = [probe.enqueue(args.payload) for _ in range(args.count)]
    else:
        body = probe.validate(args.payload).model_dump(mode="json")
        ids = [probe.task.apply_async((body,), queue=args.queue).id for _ in range(args.count)]
    if args.wait:
        for task_id in ids:
            AsyncResult(task_id, app=get_app()).get(timeout=30, propagate=False)
    print(json.dumps(ids))


if __name__ == "__main__":
    main(sys.argv[1:])
