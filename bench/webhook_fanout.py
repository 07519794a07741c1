"""Enqueue rate of 10,000 webhook deliveries: `webhooks.enqueue_many` (batched) vs one `enqueue()` each.

Runs against its own throwaway redis-server on a free port (never a configured Redis: nothing here may
reach a worker that would really deliver). No worker runs; the queue is measured, then discarded.

    python -m bench.webhook_fanout [N]        (or `python -m bench webhook_fanout`)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

from pipeline.cli.redis_bin import redis_binary


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_redis(port: int, directory: str) -> subprocess.Popen[bytes]:
    argv = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", directory]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def _measure(n: int) -> tuple[float, float]:
    from tasks import webhooks

    jobs = [
        {"url": f"https://hooks.example.com/r/{i}", "event": "record.synced", "payload": {"id": i}} for i in range(n)
    ]
    webhooks.enqueue_many(jobs[:10])  # warm up: connection pool, queue declaration
    webhooks.enqueue(jobs[0])

    start = time.perf_counter()
    ids = webhooks.enqueue_many(jobs)
    batched = time.perf_counter() - start
    assert len(ids) == n

    start = time.perf_counter()
    for job in jobs:
        webhooks.enqueue(job)
    single = time.perf_counter() - start
    return batched, single


def main(n: int = 10_000) -> int:
    """Print both enqueue rates. Under `python -m bench` the harness's throwaway Redis is already configured
    (and `pipeline` imported); run alone, this starts its own so it never touches a configured Redis."""
    if "pipeline" in sys.modules:
        batched, single = _measure(n)
    else:
        port = _free_port()
        with tempfile.TemporaryDirectory(prefix="bench-fanout-") as directory:
            redis_proc = _start_redis(port, directory)
            try:
                os.environ.update(REDIS_URL=f"redis://127.0.0.1:{port}/0", ENV_FILE="", SECRETS_DIR="/nonexistent")
                batched, single = _measure(n)
            finally:
                redis_proc.terminate()
                redis_proc.wait(10)
    print(f"webhook fan-out, {n} deliveries:")
    print(f"  enqueue_many (batched)   {n / batched:10.0f} jobs/s  ({batched:.2f} s)")
    print(f"  enqueue() one by one     {n / single:10.0f} jobs/s  ({single:.2f} s)")
    print(f"  speed-up                 {single / batched:10.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]) if sys.argv[1:] else 10_000))
