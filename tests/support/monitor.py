"""Redis MONITOR for a test: every command any client sent while the block ran, in order.

    with Monitor(redis_server.client()) as seen:
        ...
    seen.commands   # [{'command': 'LPUSH default ...', 'client_type': 'tcp' | 'lua', 'client_address': ..., ...}]

The block ends with an ECHO of a unique marker from another connection; the reader stops on it, so every
command sent inside the block is in the list.
"""

from __future__ import annotations

import threading
import uuid
from types import TracebackType
from typing import Any

import redis


class Monitor:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.commands: list[dict[str, Any]] = []
        self._marker = f"monitor-end-{uuid.uuid4().hex}"
        self._monitor = client.monitor()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> Monitor:
        self._monitor.__enter__()  # MONITOR acknowledged: commands from here on are seen
        self._thread.start()
        return self

    def _read(self) -> None:
        for item in self._monitor.listen():
            if self._marker in item["command"]:
                return
            self.commands.append(item)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.client.echo(self._marker)
        self._thread.join(10)
        self._monitor.__exit__(kind, exc, tb)
        assert not self._thread.is_alive(), "MONITOR reader did not see the end marker"

    def mentioning(self, text: str) -> list[dict[str, Any]]:
        return [c for c in self.commands if text in c["command"]]
