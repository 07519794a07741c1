"""Each job kind end to end through the API: POST its example payload, follow it to success.

The body is the kind's first `examples` entry from its payload model (what the page and /docs offer),
with its recipient made unique, every http(s) URL in it pointed at a local HTTP sink, and the source
file the transcode example names created in MEDIA_ROOT. The session workers run the jobs and deliver
email to the session's SMTP server, so outcomes are checked at the receiving end.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.api import ApiServer, wait_state
from tests.support.inproc import InProcessWorker
from tests.support.media import make_clip
from tests.support.procs import Worker, free_port, wait_for
from tests.support.smtp import SmtpServer

pytestmark = pytest.mark.integration

#: kind → (task module, task name). The kind used in the URL is looked up from the task name.
KINDS = {
    "probe": ("pipeline.probe", "pipeline.probe"),
    "email": ("tasks.email", "email.send"),
    "pdf": ("tasks.pdf", "pdf.render"),
    "transcode": ("tasks.media", "media.transcode"),
    "webhook": ("tasks.webhooks", "webhooks.deliver"),
}
CLIP_S = 3.0


class HttpSink:
    """Records every request it receives; answers 200 with a small JSON body."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                sink.requests.append({"method": self.command, "path": self.path, "body": self.rfile.read(length)})
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _record  # http.server's naming

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def point_urls_at(value: Any, url: str) -> Any:
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return f"{url}/sink"
    if isinstance(value, dict):
        return {k: point_urls_at(v, url) for k, v in value.items()}
    if isinstance(value, list):
        return [point_urls_at(v, url) for v in value]
    return value


@pytest.fixture(scope="module")
def api(session_worker: InProcessWorker, transcode_worker: Worker, work_dir: Path) -> Iterator[ApiServer]:
    server = ApiServer("kinds", work_dir / "logs").start()
    yield server
    server.stop()


@pytest.fixture
def http_sink() -> Iterator[HttpSink]:
    sink = HttpSink()
    yield sink
    sink.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_kind_end_to_end(kind: str, api: ApiServer, smtp_server: SmtpServer, http_sink: HttpSink) -> None:
    from pipeline.task import load_task_modules

    task_name = KINDS[kind][1]
    typed = next(t for t in load_task_modules().values() if t.name == task_name)
    example = typed.payload_model.model_json_schema().get("examples", [None])[0]
    assert isinstance(example, dict), f"{task_name}: the payload model has no example for the page and /docs"
    payload = point_urls_at(example, http_sink.url)
    recipient = f"api-{uuid.uuid4().hex[:12]}@example.com"
    if task_name == "email.send":
        payload["to"] = [recipient]
    if task_name == "media.transcode":
        make_clip("sample.mp4", CLIP_S, "640x360")

    with api.client() as client:
        response = client.post(f"/jobs/{typed.kind}", json=payload)
        assert response.status_code == 202, response.text
        status = wait_state(client, response.json()["id"], {"succeeded", "dead_lettered", "failed"}, 180)

    assert status["state"] == "succeeded", status
    typed.result_model.model_validate(status["result"])
    if task_name == "email.send":
        wait_for(lambda: smtp_server.recorder.delivered_to(recipient), 10, what="the email at the SMTP server")
        (received,) = smtp_server.recorder.delivered_to(recipient)
        assert received.message["To"] == recipient
    if task_name == "pdf.render":
        assert status["result"]["pages"] >= 1
    if task_name == "media.transcode":
        assert abs(status["result"]["duration_s"] - CLIP_S) < 0.5
        assert status["result"]["height"] == 480
    if task_name == "webhooks.deliver":
        assert [r["path"] for r in http_sink.requests] == ["/sink"]
