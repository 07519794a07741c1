"""A real HTTP server on 127.0.0.1 (free port) that answers each path from a script and records requests."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.procs import free_port


@dataclass(frozen=True)
class Received:
    path: str
    t: float
    headers: dict[str, str]
    body: bytes


class HttpPeer:
    """`script(path, [(status, headers), ...])`: the n-th request to `path` gets the n-th answer (last repeats)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[Received] = []
        self._script: dict[str, list[tuple[int, dict[str, str]]]] = {}
        self._count: dict[str, int] = defaultdict(int)
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                peer.requests.append(Received(self.path, time.time(), dict(self.headers.items()), body))
                answers = peer._script.get(self.path, [(200, {})])
                status, headers = answers[min(peer._count[self.path], len(answers) - 1)]
                peer._count[self.path] += 1
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None: ...

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def script(self, path: str, answers: list[tuple[int, dict[str, str]]]) -> None:
        self._script[path] = answers

    def received(self, path: str) -> list[Received]:
        return [r for r in self.requests if r.path == path]

    def start(self) -> HttpPeer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
