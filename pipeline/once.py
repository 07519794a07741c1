"""Doing an external side effect (sending an email) at most once per idempotency key, across retries and redeliveries.

One Redis key per effect, `pipeline:once:<task>:<idempotency key>`, moves through three states::

    (absent) --claim()--> claimed --committing()--> sending --done(result)--> sent
                 ^            |                        |
                 +--release()-+------------------------+   (the effect certainly did not happen)

- `claimed` (short lease, LEASE_S): preparing, nothing sent yet. A later attempt of the *same* job
  finding it takes it over (the earlier attempt died before sending); another job with the same key
  gets a `TransientError` and retries later.
- `sending` (kept for the full TTL): the point of no return, entered just before the side effect.
  If an attempt dies here (killed child, lost worker) nobody can know whether the effect happened, so
  a later attempt raises a `PermanentError` naming the key: the job goes to the dead-letter queue for
  a person to check, instead of risking a second send. Deleting the key allows a resend.
- `sent` (full TTL): holds the result; any later attempt returns it without doing the effect again.

Every transition is a compare-and-set on the exact value (one Lua script), so two concurrent copies of
one job cannot both reach `sending`: `pipeline/lua/once_cas.lua`.

A routine shutdown never leaves an effect in `sending`: the asyncio pool lets a job that is sending (`sending`, the
task ids of this process between `committing` and `done`/`release`) finish instead of stopping it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from pipeline.constants import KEY_PREFIX
from pipeline.errors import PermanentError, TransientError
from pipeline.lua import script

ONCE_KEY = KEY_PREFIX + "once:{task}:{key}"
#: How long a `claimed` record holds off other jobs with the same key (covers connect + render).
LEASE_S = 120


#: Task ids of the jobs of this process sending their effect now (between `committing` and `done` or `release`): a
#: worker's shutdown lets them finish instead of stopping them (`pipeline.runtime.asyncshutdown`).
sending: set[str] = set()


class OutcomeUnknown(PermanentError):
    """An earlier attempt died while performing the effect: whether it happened is unknown."""


class Once:
    """The once-guard of one effect; see the module docstring for the states."""

    def __init__(self, client: redis.Redis, task: str, key: str, task_id: str, ttl: int) -> None:
        self.client = client
        self.key = ONCE_KEY.format(task=task, key=key)
        self.task_id = task_id
        self.ttl = ttl
        self.token = uuid.uuid4().hex
        self._value: str | None = None

    def _record(self, state: str, **extra: Any) -> str:
        return json.dumps({"state": state, "task_id": self.task_id, "token": self.token, "at": time.time(), **extra})

    def _cas(self, old: str, new: str | None, ttl: int) -> bool:
        return bool(script("once_cas")(keys=[self.key], args=[old, new or "", ttl], client=self.client))

    def claim(self) -> dict[str, Any] | None:
        """Own the effect (returns None), or return the stored result of the job that already did it."""
        for _ in range(5):
            mine = self._record("claimed")
            if self.client.set(self.key, mine, nx=True, ex=LEASE_S):
                self._value = mine
                return None
            raw = self.client.get(self.key)
            if raw is None:
                continue  # expired between SET NX and GET
            current = raw.decode() if isinstance(raw, bytes) else str(raw)
            record = json.loads(current)
            if record["state"] == "sent":
                return dict(record["result"])
            if record["state"] == "sending":
                raise OutcomeUnknown(
                    f"an earlier attempt (task {record['task_id']}) stopped while sending: it may or may not have "
                    f"been delivered. Check the mail server's log; to send again, delete the Redis key {self.key} "
                    "and replay the job."
                )
            if record["task_id"] != self.task_id:
                raise TransientError(f"job {record['task_id']} with the same idempotency key is being prepared")
            if self._cas(current, mine, LEASE_S):  # an earlier attempt of this job died before sending
                self._value = mine
                return None
        raise TransientError(f"could not claim {self.key}: contended")

    def committing(self) -> None:
        """Enter `sending`, just before the effect. Raises TransientError if another attempt took over."""
        if self._value is None:
            raise RuntimeError("claim() first")
        record = self._record("sending")
        if not self._cas(self._value, record, self.ttl):
            raise TransientError(f"lost the claim on {self.key} to another attempt")
        self._value = record
        sending.add(self.task_id)

    def release(self) -> None:
        """The effect certainly did not happen: let a retry claim again."""
        sending.discard(self.task_id)
        if self._value is not None:
            self._cas(self._value, None, 0)
            self._value = None

    def done(self, result: dict[str, Any]) -> None:
        """Record the effect's result; later attempts return it."""
        self.client.set(self.key, self._record("sent", result=result), ex=self.ttl)
        self._value = None
        sending.discard(self.task_id)
