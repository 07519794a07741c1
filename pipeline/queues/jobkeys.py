"""The names of one job's keys outside its queue: its result, its accepted-job record and its result's owner stamp.

A result is Celery's single key, `celery-task-meta-<id>`, which lives wherever its name hashes. On a single Redis
(and Sentinel) the record is `pipeline:job:<id>`. On a Redis Cluster the record and the owner stamp carry the
result's own name as their hash tag (`pipeline:job:{celery-task-meta-<id>}`, `pipeline:owner:{celery-task-meta-<id>}`):
a name without a tag hashes whole, so the three share one slot, and the script that stores a job's result reads the
stamp and drops the record in the same step (`pipeline/lua/store.lua`). docs/redis-layout.md has the layout.

An id that Redis would read a different tag from (a name holding '}' with no tag before it) has no stamp and keeps
`pipeline:job:<id>`: its result is stored unfenced by a stamp, and its record expires.
"""

from __future__ import annotations

from pipeline.constants import JOB_RECORD_KEY, KEY_PREFIX, RESULT_KEY_PREFIX
from pipeline.queues.keys import clustered


def result(task_id: str) -> str:
    """Celery's result key of `task_id` (its Redis backend's `get_key_for_task`, no global prefix)."""
    return RESULT_KEY_PREFIX + task_id


def slot_tag(name: str) -> str | None:
    """A hash tag that puts a key in `name`'s slot: `name`'s own tag when it has one (Redis hashes the part between
    the first '{' and the next '}', when not empty), else `{name}`; None when `name` hashes whole yet holds a '}'."""
    start = name.find("{")
    end = name.find("}", start + 1) if start >= 0 else -1
    if start >= 0 and end > start + 1:
        return name[start : end + 1]
    return None if "}" in name else f"{{{name}}}"


def beside(result_key: str, kind: str) -> str | None:
    """`pipeline:<kind>:<tag>`, a key in the slot of the result key `result_key` (None: see `slot_tag`)."""
    tag = slot_tag(result_key)
    return None if tag is None else f"{KEY_PREFIX}{kind}:{tag}"


def record(task_id: str, cluster: bool | None = None) -> str:
    """The accepted-job record of `task_id` (`pipeline.records`): in its result's slot on a cluster."""
    if clustered(cluster):
        found = beside(result(task_id), "job")
        if found is not None:
            return found
    return JOB_RECORD_KEY.format(id=task_id)


def record_of_result(result_key: str, cluster: bool | None = None) -> str | None:
    """The record of the job whose result key is `result_key` (None: not a key of Celery's prefix)."""
    if not result_key.startswith(RESULT_KEY_PREFIX):
        return None
    return record(result_key[len(RESULT_KEY_PREFIX) :], cluster)


def stamp(result_key: str) -> str | None:
    """The owner stamp of a result on a cluster (hash: delivery tag -> lease owner, `<tag>#` -> its delivery count):
    in the result's slot (None: see `slot_tag`)."""
    return beside(result_key, "owner")
