"""The result backend on a Redis Cluster: Celery's Redis backend on the process's cluster client, with the fenced
one-trip store.

Celery's backend takes one Redis URL and makes a plain client of it: given a cluster URL it would talk to one seed
node alone (and a URL with several seeds does not parse at all). A result is a single key (`celery-task-meta-<id>`)
that lives wherever its name hashes, so this backend reads and writes through `pipeline.cluster.shared`, which sends
each command to the master serving the key's slot and follows MOVED, ASK and a new slot map. An MGET of many results
is split by slot (`mget`).

What it stores is Celery's own (the meta, its key, its expiry): every reader (`AsyncResult`, `pipeline.status`, the
job browser) is unchanged. A worker's states go through `pipeline.compat.results.OneTripStore` (one `store.lua` call
in the result's slot), fenced by the result's owner stamp instead of the lease: the lease lives in the job's queue's
slot, the stamp beside the result (`pipeline.queues.jobkeys`, written when the worker takes the delivery:
`pipeline.delivery.stamps`). A SUCCESS drops the job's record and the stamp in the same call. No result is carried
by another script (the acknowledgement, a flow's node): those run in the queue's slot.

Groups and chords: every key of a group (its saved result, and the chord's counters, Celery's `.j`, `.t`, `.s`, `.d`,
`.c`, which its `on_chord_part_return` script touches together) carries the group id as its hash tag
(`get_key_for_group`: `celery-taskset-meta-{<group id>}<suffix>`), so Celery's chord script runs in one slot.

`pipeline.config.celery` names this class (`BACKENDS["rediscluster"]`) as the result backend when RESULT_BACKEND_URL
(or REDIS_URL without it) is a cluster URL. It replaces Celery's `client` (a cached property Celery's backend sends
every command through), `mget` and `_set` (Celery's pipelines its SETEX with a PUBLISH, which a cluster pipeline
refuses; Celery's `set` checks the value's size before it); its entry in `pipeline.compat.ENTRIES` names the parity
test that stores and reads results through Celery's own methods on a real cluster.
"""

from __future__ import annotations

from typing import Any

from celery.backends.redis import RedisBackend
from kombu.utils.encoding import bytes_to_str

from pipeline import cluster
from pipeline.broker import run_script_waited
from pipeline.compat.results import OneTripStore, _fenced, _held, _short_of_replicas
from pipeline.queues import jobkeys


class ClusterBackend(OneTripStore, RedisBackend):
    """Celery's Redis backend whose client is the process's cluster client."""

    #: RESULT_EXPIRES in seconds, set by Celery's backend (celery-types does not declare it).
    expires: Any
    #: No script of the queue's slot carries a result here (`OneTripStore.carrier`).
    carrier = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["url"] = None  # the seeds are the settings' (`pipeline.cluster`): Celery's URL parsing takes one host
        super().__init__(*args, **kwargs)

    @property
    def client(self) -> Any:
        return cluster.shared()

    def mget(self, keys: list[Any]) -> list[Any]:
        """One MGET per slot (`pipeline.cluster.get_many`): results of many jobs hash to many slots."""
        return cluster.get_many(self.client, [str(key) if isinstance(key, str) else key for key in keys])

    def get_key_for_group(self, group_id: Any, key: Any = "") -> Any:
        """Celery's group key with the group id as hash tag: a group's keys (a chord's counters) share one slot."""
        return super().get_key_for_group(f"{{{bytes_to_str(group_id)}}}", key)

    def success_to_store(self, task: Any, result: Any) -> None:
        """None: a flow's node is recorded in the flow's slot, not the result's (the backend stores the SUCCESS)."""
        return None

    def _set(self, key: Any, value: Any, expires: Any = None) -> None:
        """Celery's store (SETEX, then PUBLISH on the key's name for `AsyncResult.get`'s listeners), as two commands:
        a cluster pipeline refuses PUBLISH, which has no key to route by."""
        expires = self.expires if expires is None else expires
        if expires:
            self.client.setex(key, expires, value)
        else:
            self.client.set(key, value)
        self.client.publish(key, value)

    def _store_once(
        self, key: bytes, value: Any, expires: int, tag: str = "", owner: str = "", lease: str = ""
    ) -> None:
        """`store.lua` in the result's slot, fenced by the result's owner stamp (a worker the stamp does not name
        stores nothing), dropping the job's record and the stamp with a SUCCESS; with REDIS_WAIT_REPLICAS, WAIT on the
        result's master. A result with no stamp beside it (`jobkeys.slot_tag`) is fenced by a read of its lease
        first."""
        name = bytes_to_str(key)
        stamp, record = jobkeys.stamp(name), jobkeys.record_of_result(name, True)
        drop = [record] if record is not None and jobkeys.slot_tag(record) == jobkeys.slot_tag(name) else []
        if stamp is None:
            if tag and not _held(tag, owner, lease):
                _fenced(key, tag)
                return
            stamp, tag, owner = name, "", ""  # checked: stored unfenced (KEYS[2] is not read)
        else:
            drop.append(stamp)
        reply, reached = run_script_waited(
            self.client, "store", [name, stamp, *drop], [value, expires, tag, owner, "1"]
        )
        if reached is not None:
            _short_of_replicas(key, int(reached))
        if reply == -1:
            _fenced(key, tag)
