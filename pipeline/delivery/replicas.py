"""The delivery layer's writes on replicated Redis: made durable with WAIT when REDIS_WAIT_REPLICAS asks for it.

Redis replicates asynchronously: a primary killed before its last writes reached a replica loses them in the
failover. For a worker that means a fetch lost (the promoted replica still has the jobs on their queues, so they
run twice) or an acknowledgement lost (a finished job runs again). With REDIS_WAIT_REPLICAS = N ≥ 1, every fetch
is followed on the same connection by `WAIT N REDIS_WAIT_TIMEOUT_MS` (WAIT covers the writes of its connection;
inside a script or a MULTI it returns at once), and so is every settle (acknowledgements with their results) and
every result a pool process stores: a job starts only once its lease record is on N replicas, and its
acknowledgement counts once it is there. A WAIT that times out is logged (the job goes on, or is done): only those
writes can be lost in a failover, so a job runs twice only when its fetch or its acknowledgement was in that
window.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.broker import replicas_wanted, run_script_waited
from pipeline.config import get_settings

log = logging.getLogger(__name__)


def wait_command() -> list[Any] | None:
    """The WAIT to send after a write on the same connection, or None when REDIS_WAIT_REPLICAS is 0."""
    wanted = replicas_wanted()
    if wanted <= 0:
        return None
    return ["WAIT", wanted, get_settings().redis_wait_timeout_ms]


def check(reached: Any, what: str) -> bool:
    """True when WAIT's reply reached REDIS_WAIT_REPLICAS; else a WARNING naming `what`."""
    wanted = replicas_wanted()
    if int(reached) >= wanted:
        return True
    log.warning(
        "%s reached %d of %d Redis replica(s) within %d ms (REDIS_WAIT_REPLICAS): a failover now could undo it",
        what,
        int(reached),
        wanted,
        get_settings().redis_wait_timeout_ms,
    )
    return False


def run(client: Any, name: str, keys: list[Any], args: list[Any], what: str) -> Any:
    """Run the Lua script `name` with `keys` and `args` on `client`, then WAIT for the replicas on the same
    connection (one round trip, `pipeline.broker.run_script_waited`) when REDIS_WAIT_REPLICAS asks for it; the
    script's reply (a WAIT short of the replicas is logged: the write is made)."""
    runner = getattr(client, "run_replicated", None)  # a client that lends a connection per call (Sentinel)
    if runner is not None and replicas_wanted() > 0:
        return runner(name, keys, args, what)
    reply, reached = run_script_waited(client, name, keys, args)
    if reached is not None:
        check(reached, what)
    return reply
