"""The result backend on a Redis Cluster: Celery's Redis backend on the process's cluster client.

Celery's backend takes one Redis URL and makes a plain client of it: given a cluster URL it would talk to one seed
node alone (and a URL with several seeds does not parse at all). A result is a single key (`celery-task-meta-<id>`)
that lives wherever its name hashes, so this backend reads and writes through `pipeline.cluster.shared`, which sends
each command to the master serving the key's slot and follows MOVED, ASK and a new slot map. An MGET of many results
is split by slot (`mget`).

What it stores is Celery's own (the meta, its key, its expiry): every reader (`AsyncResult`, `pipeline.status`, the
job browser) is unchanged. The fenced one-round-trip store of `pipeline.compat.results` is not used here: its script
checks the job's lease, a key of the queue's slot.

`pipeline.config.celery` names this class (`BACKENDS["rediscluster"]`) as the result backend when RESULT_BACKEND_URL
(or REDIS_URL without it) is a cluster URL. It replaces Celery's `client` (a cached property Celery's backend sends
every command through), `mget` and `set` (Celery's `_set` pipelines its SETEX with a PUBLISH, which a cluster
pipeline refuses); its entry in `pipeline.compat.ENTRIES` names the parity test that stores and
reads results through Celery's own methods on a real cluster.
"""

from __future__ import annotations

from typing import Any

from celery.backends.redis import RedisBackend

from pipeline import cluster


class ClusterBackend(RedisBackend):
    """Celery's Redis backend whose client is the process's cluster client."""

    #: RESULT_EXPIRES in seconds, set by Celery's backend (celery-types does not declare it).
    expires: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["url"] = None  # the seeds are the settings' (`pipeline.cluster`): Celery's URL parsing takes one host
        super().__init__(*args, **kwargs)

    @property
    def client(self) -> Any:
        return cluster.shared()

    def mget(self, keys: list[Any]) -> list[Any]:
        """One MGET per slot (`pipeline.cluster.get_many`): results of many jobs hash to many slots."""
        return cluster.get_many(self.client, [str(key) if isinstance(key, str) else key for key in keys])

    def set(self, key: Any, value: Any, expires: Any = None, **retry_policy: Any) -> Any:
        """Celery's store (SETEX, then PUBLISH on the key's name for `AsyncResult.get`'s listeners), as two commands:
        a cluster pipeline refuses PUBLISH, which has no key to route by."""
        return self.ensure(self._write, (key, value, expires), **retry_policy)

    def _write(self, key: Any, value: Any, expires: Any) -> None:
        expires = self.expires if expires is None else expires
        if expires:
            self.client.setex(key, expires, value)
        else:
            self.client.set(key, value)
        self.client.publish(key, value)
