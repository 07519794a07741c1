"""Groups: fair shares of a queue between tenants (customers, accounts, imports).

A job enqueued with `group="tenant-42"` (`TypedTask.enqueue`/`enqueue_many`, `?group=` on the API, `--group` on
the CLI, or the `pipeline_group` header from any other client) waits in its group's own list. Within a queue and
priority level the worker's fetch takes jobs round-robin across the groups that have jobs ready, with the
ungrouped jobs taking every other turn: a group with a backlog of 50,000 delays another group's next job by about
one job per worker, not by its backlog. `GROUP_CONCURRENCY` (0: no cap) caps how many jobs of one group run at
once across every worker; a capped group leaves the round until one of its jobs ends, so it never holds a worker
while another group's job is ready. The Redis layout (a ring of ready groups per queue list, a list per group,
the running jobs' delivery tags per group, checked against their leases) is written at the top of
`pipeline/lua/fetch.lua`; `pipeline/lua/enqueue.lua` puts a job in its group.

Leases, fencing, the delivery limit, retries, delayed jobs and the dead-letter queue work on grouped jobs as on
any other: a grouped message that comes back through a queue's plain list (a retry, a lease restored after a
worker died, a delayed release, a message from a foreign client) is moved to its group by the next fetch, and a
job whose lease ended by any path (done, restored, given up) frees its group's slot.
"""

from __future__ import annotations

from typing import Any

from pipeline.constants import GROUP_MAX_LENGTH
from pipeline.errors import PayloadInvalid
from pipeline.queues import keys


def checked(task: str, group: str | None) -> str | None:
    """`group` as given (None or '' for none), or `PayloadInvalid` naming what is wrong with it."""
    if group is None or group == "":
        return None
    problem = None
    if not isinstance(group, str):
        problem = f"group must be a string, got {type(group).__name__}"
    elif len(group) > GROUP_MAX_LENGTH:
        problem = f"group is {len(group)} characters; the limit is {GROUP_MAX_LENGTH}"
    elif not group.isprintable() or group != group.strip():
        problem = "group must be printable, without leading or trailing spaces"
    if problem is not None:
        raise PayloadInvalid(task, [{"loc": ["group"], "msg": problem, "type": "group"}])
    return group


def job_lists(client: Any, key: str) -> list[str]:
    """The lists of the groups with jobs waiting on queue list `key` (its priority level), by group name."""
    groups = sorted(
        g.decode() if isinstance(g, bytes) else str(g) for g in client.hkeys(keys.group_state(keys.queue_of(key), key))
    )
    return [keys.group_jobs(keys.queue_of(key), key, group) for group in groups]
