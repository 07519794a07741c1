"""The development webhook sink `pipeline run` starts: it answers every POST with 204 and prints it.

`python -m tasks.webhook_sink PORT SECRET_FILE`: listens on 127.0.0.1:PORT; for each request it prints the path,
the event and idempotency headers, whether the signature header signs the body with the secret in SECRET_FILE (the
stack's development WEBHOOK_SIGNING_SECRET), checked as any receiver checks it (`tasks.webhook_http.verify`), and the
body (the first 2,000 characters). The local
stack points the page's and the API's webhook examples at it (EXAMPLE_WEBHOOK_URL), so a webhook delivery and the
`media` flow succeed without a network.
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tasks.webhook_http import EVENT_HEADER, IDEMPOTENCY_HEADER, SIGNATURE_HEADER, verify

#: What a body is cut to when printed.
SHOWN = 2000


def serve(port: int, secret: bytes) -> None:
    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            verdict = "valid" if verify(secret, self.headers.get(SIGNATURE_HEADER, ""), body) else "INVALID"
            print(
                f"webhook {self.path} event={self.headers.get(EVENT_HEADER)} signature={verdict} "
                f"idempotency-key={self.headers.get(IDEMPOTENCY_HEADER)}: {body.decode(errors='replace')[:SHOWN]}",
                flush=True,
            )
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # http.server's signature
            return  # one line per request is printed above

    print(f"webhook sink listening on http://127.0.0.1:{port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Sink).serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]).read_bytes().strip())
