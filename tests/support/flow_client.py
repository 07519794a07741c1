"""Flows started, read and advanced on a Redis of a test's own, from a process of their own.

The test process's settings and Celery app are the session Redis's (cached at first use), so a fault test whose
workers run on its own redis-server (`own_redis`) drives its flows through this process, started with that
Redis's URL::

    with FlowClient(own_redis.url) as flows:
        flow_id = flows.start("test_fan", {"key": key, "n": 50})
        status = flows.status(flow_id)          # `pipeline.control.flows.FlowStatus` as JSON

Commands go as JSON lines on the process's stdin, one JSON line answers each on its stdout
(`python -m tests.support.flow_client`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from types import TracebackType
from typing import Any

from tests.support.procs import ROOT, ask


class FlowClient:
    """The client side: one process per client, stopped by PID on `close`."""

    def __init__(self, redis_url: str) -> None:
        env = {**os.environ, "REDIS_URL": redis_url}
        argv = [sys.executable, "-m", "tests.support.flow_client"]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, op: str, **args: Any) -> Any:
        reply = ask(self.proc, op, args)
        if reply is None:
            raise RuntimeError(f"the flow client exited ({self.proc.wait(5)}) on {op}")
        if "error" in reply:
            raise RuntimeError(f"flow client {op}: {reply['error']}")
        return reply["ok"]

    def start(self, flow: str, input: dict[str, Any]) -> str:
        return str(self.call("start", flow=flow, input=input))

    def status(self, flow_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self.call("status", id=flow_id)
        return out

    def race(self, flow_id: str, copies: int, threads: int) -> list[dict[str, Any]]:
        """Every item of a `test_fan` flow's `split` step advanced `copies` times, from `threads` threads released
        at once (`advance_race`); each call's reply."""
        out: list[dict[str, Any]] = self.call("race", id=flow_id, copies=copies, threads=threads)
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> FlowClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def advance_race(flow_id: str, copies: int, threads: int) -> list[dict[str, Any]]:
    """Call `launch.advance` for every item of flow `flow_id`'s `split` step (a `test_fan` flow), each `copies`
    times, the calls shuffled over `threads` threads that all start together: parents finishing at the same instant,
    and redelivered parents finishing again."""
    from pipeline.flows import launch, record
    from pipeline.producer.client import producer_redis
    from tests.support.flow_tasks import fan
    from tests.support.worker_app import RunResult

    tasks = {record.text(k): record.text(v) for k, v in producer_redis().hgetall(record.key(flow_id, ":tasks")).items()}
    n = int(producer_redis().hget(record.key(flow_id), "n:split") or 0)
    calls = [i for i in range(n) for _ in range(copies)]
    random.shuffle(calls)
    barrier = threading.Barrier(threads)
    replies: list[dict[str, Any]] = []
    lock = threading.Lock()

    def work(share: list[int]) -> None:
        producer_redis().ping()  # each thread's connection open before the barrier
        barrier.wait()
        for i in share:
            ref = record.Ref("test_fan", flow_id, "split", i)
            result = RunResult(key=f"race-{i}", node="race", pid=os.getpid()).model_dump(mode="json")
            done = launch.advance(fan, ref, tasks[ref.node], result, None)
            with lock:
                replies.append(
                    {"node": ref.node, "recorded": done.recorded, "state": done.state, "queued": done.queued}
                )

    pool = [threading.Thread(target=work, args=(calls[t::threads],)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return replies


def serve() -> None:
    """Answer commands from stdin until it closes."""
    import tasks.flows  # noqa: F401  # declares the shipped flows (invoice, media)
    import tests.support.worker_app  # noqa: F401  # the test flows and their tasks
    from pipeline.control.flows import flow_status
    from pipeline.flows import start

    for line in sys.stdin:
        command = json.loads(line)
        try:
            op = command["op"]
            if op == "start":
                reply: Any = start(command["flow"], command["input"])
            elif op == "status":
                reply = flow_status(command["id"]).model_dump(mode="json")
            elif op == "race":
                reply = advance_race(command["id"], command["copies"], command["threads"])
            else:
                raise ValueError(f"unknown op {op!r}")
            out = {"ok": reply}
        except Exception as exc:  # noqa: BLE001  # told to the test, which fails with it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    serve()
