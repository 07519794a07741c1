"""Jobs on a test's own broker, recorded in a ledger Redis: what the lease fault tests send and count.

A `test.ledger` job records each start in `test:ledger:<key>` and each completion in `test:done:<key>` of the ledger
(`TEST_LEDGER_URL`), which the test never stops, so the record is whole across kills and outages.
"""

from __future__ import annotations

import collections
import json
from typing import Any

from celery import Celery

from tests.support.procs import RedisServer, waiting

#: A short lease for tests about the mechanism: renewed every 2 s, restored 6 s after the last renewal.
SHORT_LEASE = {"LEASE_SECONDS": "6", "UNACKED_RESTORE_INTERVAL": "1"}


def env_for(own_redis: RedisServer, ledger: RedisServer, **extra: str) -> dict[str, str]:
    return {"REDIS_URL": own_redis.url, "TEST_LEDGER_URL": ledger.url, **extra}


def send(producer: Celery, key: str, sleep_s: float) -> str:
    return str(producer.send_task("test.ledger", args=[{"key": key, "sleep_s": sleep_s}], queue="default").id)


def starts(ledger: RedisServer, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in ledger.client().lrange(f"test:ledger:{key}", 0, -1)]


def done(ledger: RedisServer, key: str) -> collections.Counter[str]:
    return collections.Counter(x.decode() for x in ledger.client().lrange(f"test:done:{key}", 0, -1))


def settled(broker: RedisServer) -> bool:
    """Nothing queued or held: no job can run (again) from here on."""
    client = broker.client()
    return client.hlen("unacked") == 0 and waiting(client, "default") == 0
