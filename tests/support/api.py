"""The producer API as a real server for tests: `uvicorn pipeline.api:app` on a free port, stopped by PID.

Also a tiny server-sent-events reader over httpx, so tests follow `/jobs/{id}/events` like a browser.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import ROOT, free_port, stop_process, wait_for

TERMINAL = {"succeeded", "dead_lettered", "failed", "cancelled", "unknown"}
#: The API with the test tasks and flows declared too (`tests.support.api_app`).
TEST_APP = "tests.support.api_app:app"


class ApiServer:
    """uvicorn serving `pipeline.api:app` (or `app`) with its own API_TOKEN (and any other settings in `env`)."""

    def __init__(
        self,
        name: str,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        token: str | None = None,
        app: str = "pipeline.api:app",
    ) -> None:
        self.name = name
        self.app = app
        self.port = free_port()
        self.token = token or "test-token-" + secrets.token_hex(12)
        self.log_path = log_dir / f"api-{name}.log"
        self.env = {**os.environ, "API_TOKEN": self.token, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> ApiServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "uvicorn",
            self.app,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--timeout-graceful-shutdown",
            "3",
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"api {self.name} exited at start:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            return False

        wait_for(up, timeout, 0.1, what=f"api {self.name} on port {self.port}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, token: str | None = "") -> httpx.Client:
        """A client with the server's token (or `token`; None sends no Authorization header)."""
        headers = {} if token is None else {"Authorization": f"Bearer {token or self.token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.proc = None


def sse_events(client: httpx.Client, path: str, timeout: float = 60) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) pairs from a server-sent-events response, until the server closes it."""
    deadline = time.monotonic() + timeout
    with client.stream("GET", path, timeout=httpx.Timeout(timeout, read=timeout)) as response:
        response.raise_for_status()
        event, data = "message", []
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: stream still open after {timeout}s")
            if line == "":
                if data:
                    yield event, json.loads("\n".join(data))
                event, data = "message", []
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())


def wait_state(client: httpx.Client, job_id: str, states: set[str], timeout: float = 60) -> dict[str, Any]:
    """Poll `GET /jobs/{id}` until its state is one of `states`; return the status."""
    last: dict[str, Any] = {}

    def reached() -> bool:
        nonlocal last
        response = client.get(f"/jobs/{job_id}")
        if response.status_code != 200:
            return False
        last = response.json()
        return last["state"] in states

    try:
        wait_for(reached, timeout, 0.2, what=f"job {job_id} to reach {sorted(states)}")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last status {last}") from None
    return last
