"""The baseline: stock Celery with its default settings, given only the broker and result backend URLs.

Nothing of the pipeline is imported here (no settings, no signal handlers, no transport), and it runs in
processes of its own: `celery -A bench.stock_app worker ...` and `python -m bench.producer stock ...`.

`stock.webhook` is what a Celery user writes for webhooks (`bench.io_concurrency`, under `-P threads -c 50`): the
job's body signed as `webhooks.deliver` signs it, POSTed with one pooled `httpx.Client` shared by every thread of
the process (made on first use, as many connections kept alive as threads run), a non-2xx answer raised.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from typing import Any

import httpx
from celery import Celery

from bench import job

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("stock", broker=URL, backend=URL)
#: Connections the shared client keeps open: the thread pool's size in the benchmark (`-c 50`), with room.
HTTP_CONNECTIONS = 64

_http: dict[int, httpx.Client] = {}
_http_lock = threading.Lock()


@app.task(name="stock.noop")
def noop(payload: dict[str, Any]) -> None:
    job.record(payload["run"], payload.get("sent_at"))


def _http_client() -> httpx.Client:
    pid = os.getpid()
    with _http_lock:
        if pid not in _http:
            limits = httpx.Limits(max_connections=HTTP_CONNECTIONS, max_keepalive_connections=HTTP_CONNECTIONS)
            _http.clear()
            _http[pid] = httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits, trust_env=False)
        return _http[pid]


@app.task(name="stock.webhook")
def webhook(payload: dict[str, Any]) -> int:
    body = json.dumps({"event": payload["event"], "payload": payload["payload"]}, separators=(",", ":")).encode()
    stamp = int(time.time())
    secret = os.environ.get("BENCH_WEBHOOK_SECRET", "bench").encode()
    digest = hmac.new(secret, f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    headers = {
        "Content-Type": "application/json",
        "X-Pipeline-Signature": f"t={stamp},v1={digest}",
        "Idempotency-Key": webhook.request.id or "",
        "X-Pipeline-Event": payload["event"],
    }
    response = _http_client().post(payload["url"], content=body, headers=headers)
    response.raise_for_status()
    return response.status_code


@app.task(name="stock.add")
def add(x: int, y: int) -> int:
    """A Celery tutorial's task (`bench.celery_api`)."""
    return x + y
