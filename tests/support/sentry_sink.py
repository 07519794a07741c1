"""A local HTTP server standing in for Sentry's ingest endpoint: it keeps every envelope POSTed to it."""

from __future__ import annotations

import gzip
import itertools
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.procs import free_port


class Ingest:
    """Collects every envelope POSTed to it (decompressed)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.key = f"sentrykey{uuid.uuid4().hex}"  # the DSN's public key
        self.lock = threading.Lock()
        ingest = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                with ingest.lock:
                    ingest.bodies.append(raw)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def dsn(self) -> str:
        return f"http://{self.key}@127.0.0.1:{self.server.server_address[1]}/1"

    def events(self) -> list[dict[str, Any]]:
        found = []
        with self.lock:
            bodies = list(self.bodies)
        for body in bodies:
            lines = body.split(b"\n")
            for header, payload in itertools.pairwise(lines[1:]):
                try:
                    if json.loads(header).get("type") == "event":
                        found.append(json.loads(payload))
                except ValueError:
                    continue
        return found

    def text(self) -> str:
        """Every event received, as JSON text (to look for what must never leak)."""
        return "\n".join(json.dumps(event) for event in self.events())

    def stop(self) -> None:
        self.server.shutdown()
