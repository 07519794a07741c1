"""The owner stamp beside each result on a Redis Cluster: how a late result of a worker whose lease a peer took is
refused in one slot.

On a single Redis a result is stored by a script that reads the job's lease (`pipeline:lease`) in the same step.
On a cluster the lease lives in the job's queue's slot and the result wherever its key hashes, so no script can read
both. So when a worker takes a delivery (`pipeline.delivery.fetch.deliver`, after the fetch and before the job is
handed to Celery) it writes its lease owner into the result's owner stamp (`pipeline:owner:{celery-task-meta-<id>}`,
`pipeline.queues.jobkeys`: in the result's slot), ordered by the delivery's count (`stamp.lua`); every state the job
stores is then checked against the stamp by `store.lua` in the same step (`pipeline.compat.clusterresults`). A peer
that takes the job after this worker's lease lapsed stamps it before it runs it, and from then on this worker's
states are refused. A SUCCESS stored deletes the stamp (and the job's record) with it.

A delivery whose stamp a later delivery of the same tag wrote already (this worker was frozen between its fetch and
its stamp, for longer than its lease) is not this worker's: it is forgotten here, unrun. Written only when results
live on the cluster (RESULT_BACKEND_URL unset, or the cluster's URL); a job whose message carries no id (Celery's
message protocol 1), whose result is ignored (its message's `ignore_result`, or its task's: nothing to fence, and no
stamp left behind for RESULT_EXPIRES) or whose result key has no slot tag (`jobkeys.slot_tag`) gets none, and its
states are stored unfenced by it.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.config.cluster import is_cluster
from pipeline.constants import HEADER_DELIVERY_COUNT, HEADER_LEASE_OWNER
from pipeline.lua import script
from pipeline.queues import jobkeys

log = logging.getLogger(__name__)

#: A delivery handed to kombu: its tag, its queue and its envelope.
Ready = tuple[str, str, Any]


def wanted(channel: Any) -> bool:
    """Whether `channel`'s deliveries are stamped: a cluster channel, results on the cluster."""
    return bool(getattr(channel, "cluster", False)) and is_cluster(get_settings().result_url)


def stamped(channel: Any, ready: list[Ready]) -> list[Ready]:
    """Stamp each of `ready` (one `stamp.lua` call each, in its result's slot); the deliveries still this worker's,
    in order. One a later delivery stamped is let go here (`Leases.release`: not run, not acknowledged)."""
    if not ready or not wanted(channel):
        return ready
    kept: list[Ready] = []
    for tag, dest, payload in ready:
        headers = payload.get("headers") if isinstance(payload, dict) else None
        if isinstance(headers, dict) and not one(channel, tag, headers, headers[HEADER_LEASE_OWNER]):
            log.warning("delivery %s of job %s: a later delivery took it already; not run here", tag, headers.get("id"))
            channel.leases.release(tag)
            continue
        kept.append((tag, dest, payload))
    return kept


def _ignored(headers: dict[str, Any]) -> bool:
    """Whether the job stores no result: its message's `ignore_result` when it has one, else its task's (Celery's
    `get_actual_ignore_result`); no stamp to keep for it."""
    if "ignore_result" in headers:
        return bool(headers["ignore_result"])
    task = get_app().tasks.get(str(headers.get("task")))
    return bool(task is not None and task.ignore_result)


def one(channel: Any, tag: str, headers: dict[str, Any], owner: str) -> bool:
    """Stamp delivery `tag` (its envelope's `headers`: the job's id, the delivery count) as `owner`'s; False when a
    later delivery stamped it already. Also for a delivery fetched again while this worker still holds it (the held copy
    goes on: `Leases.rehold`), so the stamp names this worker again if a peer took the job in between."""
    task_id = headers.get("id")
    stamp = jobkeys.stamp(jobkeys.result(str(task_id))) if tag and task_id and wanted(channel) else None
    if stamp is None or _ignored(headers):
        return True
    args = [tag, owner, headers[HEADER_DELIVERY_COUNT], get_settings().result_expires]
    return bool(int(script("stamp")(keys=[stamp], args=args, client=channel.client)))
