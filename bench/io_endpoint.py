"""The webhook endpoint of `bench.io_concurrency`: answers every POST with 200 after a fixed latency, counting.

    python -m bench.io_endpoint PORT LATENCY_SECONDS

One asyncio process (no framework), HTTP/1.1 with keep-alive, on 127.0.0.1:PORT; its open-file limit is raised to
the hard limit so it holds thousands of connections. Any request but the three below is a delivery: it counts as an
arrival (distinct `Idempotency-Key`s too), is in flight until its answer is written, and the peak number in flight at
once is kept. `GET /stats` answers those figures as JSON; `POST /reset` zeroes them and closes the gate; `POST /open`
opens it. While the gate is closed deliveries are held (in flight, unanswered); when it opens, each held one waits its
latency from then, and the first arrival's time is the opening's: so every worker can be booted with its slots full
before the clock starts. The gate is open at start.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections.abc import Awaitable, Callable

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"


class Counts:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        if hasattr(self, "gate"):
            self.gate.set()  # nothing held stays held
        self.gate = asyncio.Event()
        self.arrivals = 0
        self.keys: set[str] = set()
        self.first: float | None = None
        self.last: float | None = None
        self.in_flight = 0
        self.peak = 0
        #: Seconds from each delivery's arrival (or the gate's opening, if it was held) to its answer, summed.
        self.held = 0.0
        self.answered = 0

    def open(self) -> None:
        self.first = self.last = time.time() if self.arrivals else None
        self.gate.set()

    def arrive(self, key: str | None) -> None:
        if self.gate.is_set():
            now = time.time()
            self.first = self.first or now
            self.last = now
        self.arrivals += 1
        if key:
            self.keys.add(key)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def stats(self) -> dict[str, float | int | None]:
        return {
            "arrivals": self.arrivals,
            "distinct": len(self.keys),
            "first": self.first,
            "last": self.last,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak,
            "mean_answer_s": self.held / self.answered if self.answered else None,
            "open": self.gate.is_set(),
        }


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    """Read (and drop) the request body: Content-Length or chunked."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    length = int(headers.get("content-length", "0"))
    if length:
        await reader.readexactly(length)


def serve(counts: Counts, latency: float) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                line, *rest = head.split("\r\n")
                method, target, _ = line.split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in rest if h)}
                await _body(reader, headers)
                began: float | None = None
                if target == "/stats":
                    body = json.dumps(counts.stats()).encode()
                elif target == "/reset" and method == "POST":
                    counts.reset()
                    body = b"{}"
                elif target == "/open" and method == "POST":
                    counts.open()
                    body = b"{}"
                else:
                    counts.arrive(headers.get("idempotency-key"))
                    try:
                        await counts.gate.wait()
                        began = time.monotonic()
                        await asyncio.sleep(latency)
                    finally:
                        counts.in_flight -= 1
                    body = b'{"ok":true}'
                writer.write(_OK % (len(body), body))
                await writer.drain()
                if began is not None:  # a delivery: its time from the gate to its answer written
                    counts.held += time.monotonic() - began
                    counts.answered += 1
                if headers.get("connection", "").lower() == "close":
                    return
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return
        finally:
            writer.close()

    return handle


async def main(port: int, latency: float) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    counts = Counts()
    counts.open()
    server = await asyncio.start_server(serve(counts, latency), "127.0.0.1", port, backlog=4096)
    print(f"listening on 127.0.0.1:{port}, latency {latency} s, open files {soft} -> {hard}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
