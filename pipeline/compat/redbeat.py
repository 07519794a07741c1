"""Beat's scheduler: celery-redbeat's, made to survive a Redis outage instead of exiting.

celery-redbeat 2.4 (`redbeat/schedulers.py`) renews its leader lock at the top of every
`RedBeatScheduler.tick` with `self.lock.extend(...)`; the lock talks to Redis directly (not through
redbeat's `RetryingConnection`), so the first tick of an outage raises `redis.ConnectionError` out of
`tick`, out of Celery's `beat.Service.start` loop, and beat exits. With one Redis behind both HA
replicas, both die together. A standby that was waiting in redbeat's `acquire_distributed_beat_lock`
(`beat_init`) when Redis went away gets the error there instead: Celery's signal dispatch logs and
swallows it, leaving `scheduler.lock` None, and the next `tick` fails on `None.extend`.

`Scheduler` keeps redbeat's behaviour while Redis answers and adds:

- a beat started while Redis is away waits for it (`setup_schedule` retried) instead of exiting;
- a Redis error in a tick is logged and the tick is tried again `OUTAGE_RETRY_S` later: the process
  never exits because of the broker; Redis at maxmemory refusing beat's writes is not an outage: said once
  ("Redis is at maxmemory"), and once when a tick goes through again ("Redis has room again");
- after an error the lease counts as lost; the next tick renews it if this beat still holds the lock,
  or takes it if it is free (the lease expired during the outage), or stands by if another beat took
  it: a standby sends nothing and polls the lock every `max_interval`;
- an entry is sent only while the lease this beat renewed is known to hold (its renewal began less
  than `lock_timeout - LEASE_MARGIN_S` ago by this process's monotonic clock), so a beat that stalls
  past its lease does not send what the new leader may already have sent;
- a slot that fell due during the outage is sent once afterwards: its last run (redbeat's `reserve`,
  written to Redis before the send) never advanced while Redis was away;
- with REDIS_WAIT_REPLICAS >= 1, the lock's renewal (or its acquisition) and a slot's reservation are confirmed by
  that many replicas before the entry is sent (Redis's `WAIT`, on the connection that wrote them: redbeat writes
  both with no WAIT, so a failover could give the promoted replica a free lock or an older `last_run_at`, and a
  second beat, or this one, would fire the slot again). The renewal runs redbeat's extend-to script and WAIT in one
  pipeline without MULTI; the reservation is redbeat's, then the entry's new `meta` and score written again with
  WAIT (the same values: whichever primary the second write reaches holds the advanced slot). Unconfirmed, nothing
  is sent: a reservation is rolled back to the entry's previous run and the tick is tried again `OUTAGE_RETRY_S`
  later. The rollback itself is not confirmed: if the primary is lost right after it, the promoted replica may
  keep the advanced slot, which is then skipped (never sent twice).

Beat sends through kombu's Redis transport with wake-up markers (`pipeline.compat.marking`: its `connection`), so an
idle worker starts a cron job at once.

It copies the second half of redbeat's `tick` and its `maybe_due`, reads redbeat's `_maybe_due_kwargs`, builds
the lock as redbeat's `acquire_distributed_beat_lock` does (its extend-to script on redis-py's `Lock`) and writes an
entry's run as redbeat's `RedBeatSchedulerEntry._next_instance` does (the `meta` field, the schedule ZSET's score).
So beat refuses to start, when its scheduler is built, on a Celery, kombu, celery-redbeat or redis-py this was not
verified on (`pipeline.compat.BEAT_LIBRARIES`, `pipeline.compat.versions.require`), unless
ALLOW_UNVERIFIED_VERSIONS=true.
kombu is among them for what beat writes besides: the delayed jobs it releases go onto kombu's queues as kombu
lays them out.

On a Redis Cluster URL (`redis+cluster://`) redbeat's client is a `RedisCluster` on every seed of the URL, with its
credentials and TLS (`pipeline.cluster.client`), wrapped in redbeat's `RetryingConnection` as its `get_redis` wraps
its own, and set where `get_redis` looks for it (the app's `redbeat_redis` attribute, `REDBEAT_REDIS_KEY`) before
redbeat's scheduler is built: redbeat's own cluster branches take one seed (`cluster: True`, `from_url`) or hand
redis-py plain dicts as startup nodes, which redis-py 8 refuses. Its keys share one hash tag (`pipeline:{beat}:`,
`pipeline.config.celery.beat_conf`), so its MULTI pipelines and the lock's scripts touch one slot. Jobs go out
through the cluster transport (`pipeline.delivery.clustered`: the queue's list and wake-up marker). With
REDIS_WAIT_REPLICAS >= 1 the lock's renewal and the run's rewrite, each followed by its WAIT, go to the master serving
the `{beat}` slot now, in one pipeline without MULTI on one connection of redis-py's client of that node
(`pipeline.cluster.node_of`, `_primary`): a WAIT in a cluster pipeline would run on whichever node redis-py picks, not
on the connection that wrote. A write there that fails (MOVED after a resharding, the master gone) is followed by a
read of beat's schedule key through the cluster client, which follows the redirection or the failover and refreshes
its slot map, so the next tick writes to the master serving the slot then (`_follow`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from functools import cached_property
from typing import Any

import redis
from redbeat import RedBeatScheduler
from redbeat.decoder import RedBeatJSONEncoder
from redbeat.schedulers import LUA_EXTEND_TO_SCRIPT, REDBEAT_REDIS_KEY, RetryingConnection, get_redis
from redis.cluster import RedisCluster
from redis.exceptions import LockError, LockNotOwnedError

from pipeline import cluster
from pipeline.broker import MemoryStats, add_wait, check_replicas, is_oom, replicas_wanted
from pipeline.compat import BEAT_LIBRARIES, marking, versions
from pipeline.config import get_settings
from pipeline.config.celery import BEAT_SOCKET_TIMEOUT_S, is_sentinel
from pipeline.config.cluster import is_cluster
from pipeline.errors import NotReplicated

log = logging.getLogger("celery.beat")

#: Pause between ticks while Redis does not answer.
OUTAGE_RETRY_S = 1.0
#: An entry is not sent in the last this-many seconds of the lease (a tick's own Redis calls take time).
LEASE_MARGIN_S = 1.0

_REDIS_DOWN = (redis.RedisError, OSError)


def use_cluster(app: Any) -> RedisCluster:
    """redbeat's client on the broker's Redis Cluster: every seed, credentials, TLS; replies as str, and redbeat's
    retries when its `retry_period` is set (as `get_redis` makes and wraps its own). Returns the cluster client
    itself (its slot map: where the master serving beat's keys is)."""
    client = cluster.client(BEAT_SOCKET_TIMEOUT_S, decode_responses=True)
    install_client(app, client)
    return client


def install_client(app: Any, client: Any) -> None:
    """Make `client` the one redbeat's `get_redis(app)` returns, wrapped as it wraps a client it makes itself."""
    retry_period = dict(app.conf.redbeat_redis_options or {}).get("retry_period")
    setattr(app, REDBEAT_REDIS_KEY, client if retry_period is None else RetryingConnection(retry_period, client))


class Scheduler(RedBeatScheduler):  # type: ignore[misc]  # redbeat ships no type hints
    """`redbeat.RedBeatScheduler` that logs and retries Redis errors and re-takes its lock after an outage."""

    lock: Any = None
    _lease_until = 0.0
    #: Redis refused a write for memory (maxmemory, noeviction) and has not taken one since: said once.
    _at_maxmemory = False
    #: On a Redis Cluster, the cluster client under redbeat's (`use_cluster`); None on a single Redis or Sentinel.
    _cluster: RedisCluster | None = None

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        versions.require("beat", BEAT_LIBRARIES, get_settings().allow_unverified_versions)
        if is_cluster(get_settings().broker_url):
            self._cluster = use_cluster(app)
        super().__init__(app, *args, **kwargs)

    @cached_property
    def connection(self) -> Any:
        """Celery's, on the transport that pushes each job's wake-up marker with it (`pipeline.compat.marking`; on
        a cluster the configured cluster transport, which does)."""
        if is_cluster(get_settings().broker_url):
            return self.app.connection_for_write()
        url = str(self.app.conf.broker_write_url or self.app.conf.broker_url)
        return self.app.connection_for_write(transport=marking.transport(is_sentinel(url)))

    def setup_schedule(self) -> None:
        """redbeat's, retried until Redis answers: a beat started during an outage waits instead of exiting
        (and crash-looping under a supervisor)."""
        while True:
            try:
                super().setup_schedule()
            except _REDIS_DOWN as exc:
                if not self._full(exc, "the start"):
                    log.warning("beat: Redis unreachable at start, retrying in %.0fs: %r", OUTAGE_RETRY_S, exc)
                time.sleep(OUTAGE_RETRY_S)
            else:
                self._room()
                return

    def tick(self, min: Any = min, **kwargs: Any) -> float:
        try:
            if self.lock_key and not self._hold_lock():
                return float(self.max_interval)
            due = float(self._send_due(min))
            self._room()
            return due
        except NotReplicated as exc:
            log.warning("beat: %s; nothing sent, retrying in %.0fs", exc, OUTAGE_RETRY_S)
            return float(min(OUTAGE_RETRY_S, self.max_interval))
        except _REDIS_DOWN as exc:
            self._lease_until = 0.0  # unknown whether the renewal reached Redis: assume the lease is gone
            if not self._full(exc, "each tick"):
                log.warning("beat: Redis error in a tick, retrying in %.0fs: %r", OUTAGE_RETRY_S, exc)
            return float(min(OUTAGE_RETRY_S, self.max_interval))

    def _full(self, exc: BaseException, what: str) -> bool:
        """True if `exc` is Redis's refusal at maxmemory (not an outage): said once until Redis has room again."""
        if not is_oom(exc):
            return False
        if not self._at_maxmemory:
            log.warning(
                "beat: Redis is at maxmemory (%s): %s wait for room, tried every %.0fs", exc, what, OUTAGE_RETRY_S
            )
        self._at_maxmemory = True
        return True

    def _room(self) -> None:
        """After a call that went through: said once Redis is below maxmemory again (a tick may write nothing)."""
        if self._at_maxmemory and not MemoryStats.from_info(self._memory_info()).full:
            self._at_maxmemory = False
            log.warning("beat: Redis has room again (below maxmemory)")

    def _memory_info(self) -> Any:
        """`INFO memory` of the Redis holding beat's keys (on a cluster, the master serving their slot)."""
        client = get_redis(self.app)
        if not is_cluster(get_settings().broker_url):
            return client.info("memory")
        node = client.get_node_from_key(self.app.redbeat_conf.schedule_key)
        return client.info("memory", target_nodes=node)

    def _send_due(self, min: Any) -> Any:
        """redbeat's `tick` after the lock renewal (unchanged)."""
        remaining_times = []
        try:
            for entry in self.schedule.values():
                next_time_to_run = self.maybe_due(entry, **self._maybe_due_kwargs)
                if next_time_to_run:
                    remaining_times.append(next_time_to_run)
        except RuntimeError:
            log.debug("beat: RuntimeError", exc_info=True)
        return min([*remaining_times, self.max_interval])

    def maybe_due(self, entry: Any, **kwargs: Any) -> Any:
        """redbeat's `maybe_due`, except that nothing is sent outside the lease and a Redis error ends the tick
        (redbeat logs it per entry and goes on, each entry waiting out its own Redis retries)."""
        is_due, next_time_to_run = entry.is_due()
        if not is_due:
            return next_time_to_run
        if self.lock_key and time.monotonic() >= self._lease_until - LEASE_MARGIN_S:
            log.warning("beat: lease about to expire; %s waits for the next tick", entry.name)
            return min(OUTAGE_RETRY_S, self.max_interval)
        log.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
        try:
            result = self.apply_async(entry, **kwargs)
        except (*_REDIS_DOWN, NotReplicated):
            raise
        except Exception as exc:
            log.exception("Scheduler: Message Error: %s", exc)
        else:
            log.debug("Scheduler: %s sent. id->%s", entry.task, getattr(result, "id", None))
        return next_time_to_run

    def reserve(self, entry: Any) -> Any:
        """redbeat's reservation of the slot (the entry's next run, written before the send); with
        REDIS_WAIT_REPLICAS, confirmed by the replicas, else rolled back and NotReplicated raised (nothing sent)."""
        if replicas_wanted() <= 0:
            return super().reserve(entry)
        client = get_redis(self.app)
        previous = client.hget(entry.key, "meta"), client.zscore(self.app.redbeat_conf.schedule_key, entry.key)
        new_entry = super().reserve(entry)
        try:
            self._write_run(new_entry, wait=True)
        except NotReplicated:
            self._restore_run(entry.key, *previous)  # the slot is due again: the next tick retries it
            raise
        return new_entry

    def _write_run(self, entry: Any, wait: bool) -> None:
        """Write `entry`'s run as redbeat's `_next_instance` does (`meta`, the schedule's score) in a pipeline
        without MULTI on the primary (`_primary`), followed by WAIT on its connection when `wait`."""
        pipe = self._primary().pipeline(transaction=False)
        meta = {"last_run_at": entry.last_run_at, "total_run_count": entry.total_run_count}
        pipe.hset(entry.key, "meta", json.dumps(meta, cls=RedBeatJSONEncoder))
        pipe.zadd(self.app.redbeat_conf.schedule_key, {entry.key: entry.score})
        waited = wait and add_wait(pipe)
        replies = self._execute(pipe)
        if waited:
            check_replicas(replies[-1])

    def _primary(self) -> Any:
        """Where beat's writes and their WAIT go, on one connection: redbeat's client on a single Redis; on a cluster
        redis-py's client of the master serving beat's slot now (every key of beat shares the `{beat}` tag)."""
        if self._cluster is None:
            return get_redis(self.app)
        return cluster.node_of(self._cluster, self.app.redbeat_conf.schedule_key)

    def _execute(self, pipe: Any) -> list[Any]:
        """`pipe`'s replies; on a cluster a Redis error there (MOVED, the master gone) is followed by `_follow`."""
        try:
            return list(pipe.execute())
        except _REDIS_DOWN:
            self._follow()
            raise

    def _follow(self) -> None:
        """A read of beat's schedule key through the cluster client, after a write to a master failed: redis-py follows
        a MOVED or a failover there and refreshes its slot map, so `_primary` names the master serving the slot."""
        if self._cluster is not None:
            with contextlib.suppress(*_REDIS_DOWN):
                self._cluster.exists(self.app.redbeat_conf.schedule_key)

    def _restore_run(self, key: str, meta: Any, score: Any) -> None:
        """Put back an entry's `meta` and score as they were read (absent ones removed)."""
        pipe = get_redis(self.app).pipeline(transaction=False)
        if meta is None:
            pipe.hdel(key, "meta")
        else:
            pipe.hset(key, "meta", meta)
        if score is None:
            pipe.zrem(self.app.redbeat_conf.schedule_key, key)
        else:
            pipe.zadd(self.app.redbeat_conf.schedule_key, {key: score})
        pipe.execute()

    def _hold_lock(self) -> bool:
        """Renew the lease, or take the lock if it is free; False: another beat holds it (stand by). With
        REDIS_WAIT_REPLICAS, the renewal (an acquisition too) counts once the replicas confirm it (NotReplicated)."""
        if self.lock is None:
            self.lock = self._new_lock()
        started = time.monotonic()
        if self.lock.local.token is not None:
            try:
                self._extend_lock()
            except LockError:  # expired during an outage or a stall, perhaps taken by another beat
                log.warning("beat: Lost the lock; taking it again or standing by")
                self.lock.local.token = None
            else:
                self._lease_until = started + self.lock_timeout
                return True
        if self.lock.acquire(blocking=False):
            log.info("beat: Acquired lock")
            if replicas_wanted() > 0:
                self._extend_lock()  # the same lease again, on a connection that WAITs for the replicas
            self._lease_until = started + self.lock_timeout
            return True
        log.debug("beat: Another beat holds the lock; standing by")
        return False

    def _extend_lock(self) -> None:
        """redbeat's renewal (`lock.extend(lock_timeout)`: its extend-to script), with REDIS_WAIT_REPLICAS followed
        by WAIT on one connection of the primary (a pipeline, `_primary`: on a cluster the node's own, which runs
        scripts); without, the script alone through redbeat's client (a cluster pipeline runs no script)."""
        lock = self.lock
        args = [lock.local.token, int(self.lock_timeout * 1000), "0"]
        if replicas_wanted() <= 0:
            replies = [lock.lua_extend(keys=[lock.name], args=args, client=get_redis(self.app))]
        else:
            pipe = self._primary().pipeline(transaction=False)
            lock.lua_extend(keys=[lock.name], args=args, client=pipe)
            add_wait(pipe)
            replies = self._execute(pipe)
        if not replies[0]:
            raise LockNotOwnedError("Cannot extend a lock that's no longer owned", lock_name=lock.name)
        if len(replies) > 1:
            check_replicas(replies[1])

    def _new_lock(self) -> Any:
        """The lock as redbeat's `acquire_distributed_beat_lock` makes it (with its extend-to script)."""
        client = get_redis(self.app)
        lock = client.lock(self.lock_key, timeout=self.lock_timeout, sleep=self.max_interval)
        lock.lua_extend = client.register_script(LUA_EXTEND_TO_SCRIPT)
        return lock

    def close(self) -> None:
        """Release the lock if Redis answers; if not, it expires on its own after its lease."""
        try:
            super().close()
        except _REDIS_DOWN as exc:
            log.warning("beat: could not release the lock: %r", exc)
            self.lock = None
