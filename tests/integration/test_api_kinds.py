"""Each product job kind end to end through the API: POST its example payload, follow it to success.

The body is the kind's first `examples` entry from its payload model (what the page and /docs offer),
with every http(s) URL in it pointed at a local HTTP sink. A dedicated worker is started with SMTP set
to a local aiosmtpd sink, so email and webhook jobs deliver for real and are checked at the receiving
end. A kind whose task module is not in this checkout yet is skipped (never any other reason).
"""

from __future__ import annotations

import importlib.util
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.api import ApiServer, wait_state
from tests.support.procs import Worker, free_port, wait_for

pytestmark = pytest.mark.integration

#: kind → (task module, task name). The kind used in the URL is looked up from the task name.
PRODUCT_KINDS = {
    "probe": ("pipeline.probe", "pipeline.probe"),  # always present: keeps this harness itself tested
    "email": ("tasks.email", "email.send"),
    "pdf": ("tasks.pdf", "pdf.render"),
    "transcode": ("tasks.media", "media.transcode"),
    "webhook": ("tasks.webhooks", "webhooks.deliver"),
}


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


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


def make_sample_clip(seconds: float = 3.0) -> Path:
    """MEDIA_ROOT/sample.mp4, the source the transcode example names (the API and workers share DATA_DIR)."""
    from pipeline.config import get_settings

    path = get_settings().media_path / "sample.mp4"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        subprocess.run(
            ["ffmpeg", "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
             "-f", "lavfi", "-i", f"testsrc=size=640x360:rate=25:duration={seconds}",
             "-f", "lavfi", "-i", f"sine=frequency=440:sample_rate=48000:duration={seconds}",
             "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", str(path)],
            check=True,
        )  # fmt: skip
    return path


def point_urls_at(value: Any, url: str) -> Any:
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return f"{url}/sink"
    if isinstance(value, dict):
        return {k: point_urls_at(v, url) for k, v in value.items()}
    if isinstance(value, list):
        return [point_urls_at(v, url) for v in value]
    return value


@pytest.fixture
def peers() -> Iterator[dict[str, Any]]:
    from aiosmtpd.controller import Controller
    from aiosmtpd.handlers import Message

    received: list[Any] = []

    class Collect(Message):  # type: ignore[misc]  # aiosmtpd ships no type information
        def handle_message(self, message: Any) -> None:
            received.append(message)

    smtp = Controller(Collect(), hostname="127.0.0.1", port=free_port())
    smtp.start()
    http = HttpSink()
    yield {"smtp_port": smtp.port, "mail": received, "http": http}
    smtp.stop()
    http.close()


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(k, marks=pytest.mark.skipif(not module_exists(m), reason=f"{m} is not in this checkout yet"))
        for k, (m, _) in sorted(PRODUCT_KINDS.items())
    ],
)
def test_kind_end_to_end(
    kind: str, peers: dict[str, Any], make_worker: Callable[..., Worker], work_dir: Path, clean_dlq: None
) -> None:
    _, task_name = PRODUCT_KINDS[kind]
    from pipeline.task import load_task_modules

    typed = next(t for t in load_task_modules().values() if t.name == task_name)
    example = typed.payload_model.model_json_schema().get("examples", [None])[0]
    assert isinstance(example, dict), f"{task_name}: the payload model has no example for the page and /docs"
    payload = point_urls_at(example, peers["http"].url)
    if task_name == "media.transcode":
        make_sample_clip()

    env = {"SMTP_HOST": "127.0.0.1", "SMTP_PORT": str(peers["smtp_port"]), "SMTP_SECURITY": "none"}
    make_worker(f"kind-{kind}", env=env, concurrency=1)
    api = ApiServer(f"kind-{kind}", work_dir / "logs", env).start()
    try:
        with api.client() as client:
            response = client.post(f"/jobs/{typed.kind}", json=payload)
            assert response.status_code == 202, response.text
            status = wait_state(client, response.json()["id"], {"succeeded", "dead_lettered", "failed"}, 180)
    finally:
        api.stop()
    assert status["state"] == "succeeded", status
    typed.result_model.model_validate(status["result"])
    if task_name == "email.send":
        wait_for(lambda: peers["mail"], 10, what="the email at the SMTP sink")
        assert {a.strip() for a in peers["mail"][0]["To"].split(",")} == set(payload["to"])
    if task_name == "pdf.render":
        assert status["result"]["pages"] >= 1
    if task_name == "media.transcode":
        assert abs(status["result"]["duration_s"] - 3.0) < 0.5
        assert status["result"]["height"] == 480
    if task_name == "webhooks.deliver":
        assert [r["path"] for r in peers["http"].requests] == ["/sink"]
