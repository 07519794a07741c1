"""The API keeps the contract docs/api.md states: a uvicorn subprocess over real HTTP and sockets.

The server has a Redis of its own that no worker consumes (accepted jobs stay queued) and a short
API_BODY_TIMEOUT, so a request that never finishes its body is answered within the test.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.api import ApiServer
from tests.support.procs import RedisServer

pytestmark = pytest.mark.integration
BODY_TIMEOUT_S = 1.0
WELCOME = {"name": "Ada", "product": "Pipeline", "action_url": "https://example.com/start"}


@pytest.fixture(scope="module")
def api(work_dir: Path) -> Iterator[ApiServer]:
    redis = RedisServer(work_dir / "contract-redis").start()
    env = {"REDIS_URL": redis.url, "API_BODY_TIMEOUT": str(BODY_TIMEOUT_S)}
    server = ApiServer("contract", work_dir / "logs", env).start()
    yield server
    server.stop()
    redis.stop()


def depth(client: httpx.Client, queue: str) -> int:
    return int(next(q["depth"] for q in client.get("/queues").json()["queues"] if q["name"] == queue))


def test_a_body_without_content_type_is_read_as_json(api: ApiServer) -> None:
    with api.client() as client:
        before = depth(client, "default")
        bare = client.post("/jobs/probe", content=b'{"message": "no content type"}')
        assert "content-type" not in bare.request.headers
        assert bare.status_code == 202, bare.text
        status = client.get(bare.json()["status_url"]).json()
        assert status["state"] == "queued"
        assert depth(client, "default") == before + 1

        invalid = client.post("/jobs/probe", content=b'{"message": 5}')
        assert invalid.status_code == 422
        assert invalid.json()["detail"][0]["loc"] == ["body", "message"]
        suffixed = client.post(
            "/jobs/probe", content=b'{"message": "x"}', headers={"Content-Type": "application/problem+json"}
        )
        assert suffixed.status_code == 202
        text = client.post("/jobs/probe", content=b'{"message": "x"}', headers={"Content-Type": "text/plain"})
        assert text.status_code == 415
        assert "application/json" in text.json()["detail"]
        assert depth(client, "default") == before + 2


@pytest.mark.parametrize(
    ("field", "value", "loc"),
    [
        ("subject", "Hello\u2028Bcc: victim@example.com", ["body", "subject"]),
        ("subject", "Hello\u2029there", ["body", "subject"]),
        ("subject", "Hello\x85there", ["body", "subject"]),
        ("subject", "Hello\x1bthere", ["body", "subject"]),
        ("to", ["Ada\u2028Bcc: victim@example.com <ada@example.com>"], ["body", "to", 0]),
        ("reply_to", "Help\u2029 <help@example.com>", ["body", "reply_to"]),
    ],
)
def test_header_fields_with_separators_or_controls_are_refused(
    api: ApiServer, field: str, value: object, loc: list[object]
) -> None:
    payload = {"to": ["ada@example.com"], "template_id": "welcome", "variables": WELCOME, field: value}
    with api.client() as client:
        before = depth(client, "email")
        response = client.post("/jobs/email", json=payload)
        assert response.status_code == 422, response.text
        (error,) = response.json()["detail"]
        assert error["loc"] == loc
        assert error["type"] == "header_text"
        assert "single line" in error["msg"]
        assert depth(client, "email") == before


@pytest.mark.parametrize("url", ["javascript:alert(1)", "data:text/html,x", "file:///etc/passwd", "https:/x"])
def test_link_variables_must_be_http_urls(api: ApiServer, url: str) -> None:
    payload = {"to": ["ada@example.com"], "template_id": "welcome", "variables": {**WELCOME, "action_url": url}}
    with api.client() as client:
        before = depth(client, "email")
        response = client.post("/jobs/email", json=payload)
        assert response.status_code == 422, response.text
        (error,) = response.json()["detail"]
        assert error["loc"] == ["body", "variables"]
        assert "'action_url'" in error["msg"]
        assert "http://" in error["msg"]
        assert depth(client, "email") == before

        good = client.post("/jobs/email", json={**payload, "variables": WELCOME})
        assert good.status_code == 202, good.text


@pytest.mark.parametrize("uri", ["file:///etc/passwd", "https://example.com/invoice.pdf", "s3://other/invoice.pdf"])
def test_attachments_must_be_objects_of_the_storage(api: ApiServer, uri: str) -> None:
    payload = {"to": ["ada@example.com"], "template_id": "welcome", "variables": WELCOME, "attachments": [{"uri": uri}]}
    with api.client() as client:
        before = depth(client, "email")
        response = client.post("/jobs/email", json=payload)
        assert response.status_code == 422, response.text
        (error,) = response.json()["detail"]
        assert error["loc"] == ["body", "attachments", 0, "uri"]
        assert "not an object of the pipeline's storage backend" in error["msg"]
        assert depth(client, "email") == before


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closes(api: ApiServer) -> None:
    request = (
        f"POST /jobs/probe HTTP/1.1\r\nHost: 127.0.0.1:{api.port}\r\nAuthorization: Bearer {api.token}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    ).encode() + b'{"message"'
    assert len(request.split(b"\r\n\r\n", 1)[1]) == 10
    # Without the deadline the server would wait for the other 90 bytes for ever: recv() would time out.
    with socket.create_connection(("127.0.0.1", api.port), timeout=BODY_TIMEOUT_S + 10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), received
    assert b"connection: close" in head.lower()
    assert b"did not arrive within 1 s" in body


def test_docs_load_swagger_ui_from_the_api_itself(api: ApiServer) -> None:
    page = httpx.get(f"{api.url}/docs")  # open, like /openapi.json
    assert page.status_code == 200
    html = page.text
    assets = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert assets, html
    assert "//" not in "".join(assets), assets  # no CDN: every asset is a path on this origin
    assert re.search(r"https?://", html) is None, html
    served = {url: httpx.get(f"{api.url}{url}") for url in assets}
    assert all(r.status_code == 200 for r in served.values()), {u: r.status_code for u, r in served.items()}
    (script,) = (u for u in assets if u.endswith(".js"))
    assert served[script].headers["content-type"].startswith("text/javascript")
    assert b"SwaggerUIBundle" in served[script].content
    (style,) = (u for u in assets if u.endswith(".css"))
    assert served[style].headers["content-type"].startswith("text/css")
    assert "url: '/openapi.json'" in html
    # Only the files the page loads are served, not the rest of Swagger UI's distribution.
    assert httpx.get(f"{api.url}/static/swagger-ui/index.html").status_code == 404
    assert httpx.get(f"{api.url}/static/app.js").status_code == 200  # the job page's assets are still there
