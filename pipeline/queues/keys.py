"""The names of a queue's Redis keys, in one place: one function per kind of key.

On a single Redis (and Sentinel) each name is the one the pipeline has always used, kombu's own for the lists and
kombu's global delivery records: a stock Celery producer pushes on `<queue>` and `<queue>\\x06\\x16<step>`, and a
rolling upgrade finds the keys the previous release wrote. On a Redis Cluster (`REDIS_URL=redis+cluster://...`)
every key of a queue carries the queue's hash tag, `{<queue>}`, so all of them live in one slot: the slot of the
queue's step-0 list `<queue>` too, which keeps kombu's name. The layout, and which scripts touch which key, is in
docs/redis-layout.md.

Each function takes `cluster`: None (the default) follows the broker URL of the settings; True or False asks for
one layout whatever the settings say. Names of keys that are not a queue's (results, job records, limiters) are not
here: they are single keys and hash wherever they do.
"""

from __future__ import annotations

from pipeline.config import get_settings
from pipeline.config.cluster import is_cluster
from pipeline.constants import (
    DEAD_LETTER_QUEUE,
    DELAYED_DEST_KEY,
    DELAYED_KEY,
    DELAYED_MESSAGE_KEY,
    DELIVERIES_KEY,
    DELIVERY_LOG_KEY,
    DLQ_INDEX_KEY,
    DLQ_TASKS_KEY,
    ENQUEUE_IDEMPOTENCY_KEY,
    GROUP_KEY_PREFIX,
    KEY_PREFIX,
    LEASE_KEY,
    PAUSED_KEY,
    PRIORITY_SEPARATOR,
    PRIORITY_STEPS,
    RECENT_JOBS_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)
from pipeline.queues.priority import level_key

#: (settings, whether their broker URL names a cluster): the answer for the process's settings, kept (a producer asks
#: on every enqueue).
_known: list[tuple[object, bool]] = []


def clustered(cluster: bool | None = None) -> bool:
    """`cluster`, or whether the broker URL names a Redis Cluster when it is None."""
    if cluster is not None:
        return cluster
    settings = get_settings()
    if not _known or _known[0][0] is not settings:
        _known[:] = [(settings, is_cluster(settings.broker_url))]
    return _known[0][1]


def tag(queue: str) -> str:
    """The hash tag of `queue`, `{<queue>}`; ValueError for a name Redis would cut short (it holds a brace)."""
    if not queue or "{" in queue or "}" in queue:
        raise ValueError(f"a queue name on a Redis Cluster may not be empty or hold '{{' or '}}': {queue!r}")
    return f"{{{queue}}}"


def _scoped(queue: str, kind: str) -> str:
    return f"{KEY_PREFIX}{tag(queue)}:{kind}"


def tagged_queue(key: str) -> str | None:
    """The queue whose hash tag a key carries (`pipeline:{<q>}:<kind>` on a cluster: `<q>`); None for a key without."""
    start, end = key.find("{"), key.find("}")
    return key[start + 1 : end] if 0 <= start < end else None


def level(queue: str, step: int, cluster: bool | None = None) -> str:
    """The list `queue`'s jobs of priority step `step` wait in (step 0: the queue's own name in both layouts)."""
    if step == 0 or not clustered(cluster):
        return level_key(queue, step)
    return f"{tag(queue)}{PRIORITY_SEPARATOR}{step}"


def levels(queue: str, cluster: bool | None = None) -> list[str]:
    """Every list of `queue`, one per priority step, most urgent first."""
    return [level(queue, step, cluster) for step in PRIORITY_STEPS]


def listed(key: str, cluster: bool | None = None) -> str:
    """The layout's name of kombu's list key `key` (`<queue>` or `<queue>\\x06\\x16<step>`, what a captured publish
    pushes on): the same on a single Redis, the queue's tagged list of that step on a cluster."""
    if not clustered(cluster):
        return key
    queue, _, step = key.partition(PRIORITY_SEPARATOR)
    return level(queue_of(queue, cluster), int(step) if step else 0, cluster)


def queue_of(key: str, cluster: bool | None = None) -> str:
    """The queue a list key belongs to: `email` for `email` and `email\\x06\\x163` (`{email}\\x06\\x163` on a
    cluster; on a single Redis a queue may be named `{email}`)."""
    name = key.split(PRIORITY_SEPARATOR, 1)[0]
    if name.startswith("{") and name.endswith("}") and clustered(cluster):
        return name[1:-1]
    return name


def wake(queue: str, cluster: bool | None = None) -> str:
    """The wake-up marker list of `queue` (`pipeline.queues.wake`)."""
    return _scoped(queue, "wake") if clustered(cluster) else f"{KEY_PREFIX}wake:{queue}"


def unacked(queue: str, cluster: bool | None = None) -> str:
    """kombu's delivery record (tag -> message): one hash for every queue on a single Redis."""
    return _scoped(queue, "unacked") if clustered(cluster) else UNACKED_KEY


def unacked_index(queue: str, cluster: bool | None = None) -> str:
    """The lease expiry of each delivery (kombu's index): one sorted set for every queue on a single Redis."""
    return _scoped(queue, "unacked_index") if clustered(cluster) else UNACKED_INDEX_KEY


def lease(queue: str, cluster: bool | None = None) -> str:
    """The owner of each delivery's lease (`pipeline.delivery.lease`)."""
    return _scoped(queue, "lease") if clustered(cluster) else LEASE_KEY


def deliveries(queue: str, cluster: bool | None = None) -> str:
    """How many times each delivery tag was delivered."""
    return _scoped(queue, "deliveries") if clustered(cluster) else DELIVERIES_KEY


def delivery_log(queue: str, delivery_tag: str, cluster: bool | None = None) -> str:
    """The last deliveries of one delivery tag."""
    if clustered(cluster):
        return _scoped(queue, f"deliveries:{delivery_tag}")
    return DELIVERY_LOG_KEY.format(tag=delivery_tag)


#: One set of delivery records: kombu's unacked, its index, the lease owners, the delivery counts and the delivery
#: history's key prefix.
Records = tuple[str, str, str, str, str]


def records(queue: str, cluster: bool | None = None) -> Records:
    """The delivery records `queue`'s deliveries are kept in: one set shared by every queue on a single Redis, the
    queue's own (all in its slot) on a cluster."""
    return (
        unacked(queue, cluster),
        unacked_index(queue, cluster),
        lease(queue, cluster),
        deliveries(queue, cluster),
        delivery_log(queue, "", cluster),
    )


def group_prefix(queue: str, cluster: bool | None = None) -> str:
    """The prefix P of the fair groups' keys of `queue`'s lists (the layout is at the top of `fetch.lua`)."""
    return _scoped(queue, "group:") if clustered(cluster) else GROUP_KEY_PREFIX


def group_state(queue: str, key: str, cluster: bool | None = None) -> str:
    """The hash group -> state ('r' ringed, 'c' capped) of `queue`'s list `key` (one of `levels(queue)`)."""
    return f"{group_prefix(queue, cluster)}state:{key}"


def group_jobs(queue: str, key: str, group: str, cluster: bool | None = None) -> str:
    """The list `group`'s jobs of `queue`'s list `key` wait in."""
    return f"{group_prefix(queue, cluster)}jobs:{key}:{group}"


def group_ring(queue: str, key: str, cluster: bool | None = None) -> str:
    """The list of `queue`'s groups with jobs ready in its list `key`, each once."""
    return f"{group_prefix(queue, cluster)}ring:{key}"


def group_count(queue: str, cluster: bool | None = None) -> str:
    """The hash list key -> grouped jobs waiting, that holds `queue`'s counts."""
    return group_prefix(queue, cluster) + "count"


def paused(queue: str, cluster: bool | None = None) -> str:
    """Where `queue`'s pause is kept: on a single Redis the set of paused queue names (`queue` a member of it), on a
    cluster a flag of the queue's own (a string: set while paused)."""
    return _scoped(queue, "paused") if clustered(cluster) else PAUSED_KEY


def delayed(queue: str, cluster: bool | None = None) -> tuple[str, str, str]:
    """The parked delayed jobs: the due-time index, the messages and their destination lists (on a single Redis
    shared by every queue)."""
    if clustered(cluster):
        return _scoped(queue, "delayed"), _scoped(queue, "delayed:message"), _scoped(queue, "delayed:dest")
    return DELAYED_KEY, DELAYED_MESSAGE_KEY, DELAYED_DEST_KEY


def cancel(queue: str, task_id: str, cluster: bool | None = None) -> str:
    """The tombstone of cancelled job `task_id` of `queue`."""
    return _scoped(queue, f"cancel:{task_id}") if clustered(cluster) else f"{KEY_PREFIX}cancel:{task_id}"


def recent(queue: str, cluster: bool | None = None) -> str:
    """The recent-jobs index of `queue` (`pipeline.records`)."""
    return _scoped(queue, "recent") if clustered(cluster) else RECENT_JOBS_KEY.format(queue=queue)


def idempotency(queue: str, task: str, key: str, cluster: bool | None = None) -> str:
    """The claim of idempotency key `key` of `task` (a job of `queue`)."""
    if clustered(cluster):
        return _scoped(queue, f"enqueue:{task}:{key}")
    return ENQUEUE_IDEMPOTENCY_KEY.format(task=task, key=key)


def dlq_index(cluster: bool | None = None) -> tuple[str, str]:
    """The dead-letter queue's two hashes (entry -> element, task id -> entry), in the slot of its list
    `dead_letter` on a cluster (`pipeline.dlq.store` changes the three in one MULTI)."""
    if clustered(cluster):
        return _scoped(DEAD_LETTER_QUEUE, "dlq:index"), _scoped(DEAD_LETTER_QUEUE, "dlq:tasks")
    return DLQ_INDEX_KEY, DLQ_TASKS_KEY


def every(queue: str, cluster: bool | None = None) -> list[str]:
    """One name of each kind of `queue`'s keys (with a sample delivery tag, task id, task and key where a kind is
    named by one): what a check of the layout walks."""
    names = [*levels(queue, cluster), wake(queue, cluster), unacked(queue, cluster), unacked_index(queue, cluster)]
    names += [lease(queue, cluster), deliveries(queue, cluster), delivery_log(queue, "tag-1", cluster)]
    prefix = group_prefix(queue, cluster)
    for key in levels(queue, cluster):
        names += [group_state(queue, key, cluster), group_jobs(queue, key, "tenant-1", cluster)]
        names += [group_ring(queue, key, cluster), f"{prefix}capped:{key}"]
    names += [group_count(queue, cluster), f"{prefix}turn", f"{prefix}leases:tenant-1", paused(queue, cluster)]
    names += [*delayed(queue, cluster), cancel(queue, "id-1", cluster), recent(queue, cluster)]
    return [*names, idempotency(queue, "email.send", "key-1", cluster)]
