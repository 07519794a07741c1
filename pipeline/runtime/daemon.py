"""The worker's background threads: one daemon thread each, running `_run` until `stop()` sets `_stopped`."""

from __future__ import annotations

import threading
from typing import ClassVar, Self


class Daemon:
    """A daemon thread named `thread_name`; a subclass's `_run` loops until `_stopped` is set."""

    thread_name: ClassVar[str]

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        raise NotImplementedError
