"""Names shared by producers, workers and operators: queues, routes, Redis keys and message headers.

Nothing here reads configuration; everything here is part of the wire contract, so renaming a value
orphans messages already in Redis.
"""

from __future__ import annotations

from typing import Final

#: Queue for pipeline maintenance tasks and any task without a route of its own.
DEFAULT_QUEUE: Final = "default"
EMAIL_QUEUE: Final = "email"
PDF_QUEUE: Final = "pdf"
TRANSCODE_QUEUE: Final = "transcode"
WEBHOOKS_QUEUE: Final = "webhooks"
#: Failed jobs land here as envelopes. No worker consumes it: the `pipeline dlq` commands operate it.
DEAD_LETTER_QUEUE: Final = "dead_letter"

#: Queues a worker consumes when started without `-Q`.
WORK_QUEUES: Final = (DEFAULT_QUEUE, EMAIL_QUEUE, PDF_QUEUE, TRANSCODE_QUEUE, WEBHOOKS_QUEUE)

#: Queues of long jobs (minutes to hours): a worker consuming any of them runs the `long` profile.
LONG_JOB_QUEUES: Final = (PDF_QUEUE, TRANSCODE_QUEUE)

#: Task-name glob → queue. Routing is by name so foreign clients calling `send_task` land right too.
ROUTES: Final = {
    "email.*": EMAIL_QUEUE,
    "pdf.*": PDF_QUEUE,
    "media.*": TRANSCODE_QUEUE,
    "webhooks.*": WEBHOOKS_QUEUE,
}

#: Modules holding the product's tasks, imported by the worker (by string: `pipeline` never imports `tasks`).
TASK_MODULES: Final = (
    "tasks.housekeeping",
    "tasks.probe",
    "tasks.email",
    "tasks.pdf",
    "tasks.media",
    "tasks.webhooks",
    "tasks.flows",
)

#: Every Redis key the pipeline owns starts with this (kombu's own keys keep kombu's names).
KEY_PREFIX: Final = "pipeline:"
#: `SET NX` guard that turns a repeated enqueue with the same idempotency key into the first job's id.
ENQUEUE_IDEMPOTENCY_KEY: Final = KEY_PREFIX + "enqueue:{task}:{key}"
#: Written before a job is published (task name, accepted time, ETA) so status can tell queued from unknown.
JOB_RECORD_KEY: Final = KEY_PREFIX + "job:{id}"
#: Celery's result key prefix (its key-value backends' `task_keyprefix`): a job's result is `celery-task-meta-<id>`.
RESULT_KEY_PREFIX: Final = "celery-task-meta-"
#: The queue's recently accepted jobs, ZSET task id → accepted time (epoch s), capped at RECENT_JOBS_MAX;
#: written in the same round trip as the record. The job browser (`pipeline.browse`) reads it.
RECENT_JOBS_KEY: Final = KEY_PREFIX + "recent:{queue}"

#: The dead-letter index (`pipeline.dlq.store`): hashes entry id → the `dead_letter` list element, and
#: original task id → entry id, written in the same MULTI as the list.
DLQ_INDEX_KEY: Final = KEY_PREFIX + "dlq:index"
DLQ_TASKS_KEY: Final = KEY_PREFIX + "dlq:tasks"

#: Parked delayed jobs: ZSET task id → due time (epoch s), and hashes task id → kombu envelope / queue list key.
DELAYED_KEY: Final = KEY_PREFIX + "delayed"
DELAYED_MESSAGE_KEY: Final = KEY_PREFIX + "delayed:message"
DELAYED_DEST_KEY: Final = KEY_PREFIX + "delayed:dest"

#: A cancelled job's tombstone (`pipeline.control.cancel`), kept RESULT_EXPIRES: a worker's fetch drops the job's
#: message unrun (`fetch.lua` spells the prefix out), and a worker holding it stops it. The id is also PUBLISHed on
#: CANCEL_CHANNEL, which every worker listens to (`pipeline.runtime.cancels`).
CANCEL_KEY: Final = KEY_PREFIX + "cancel:{id}"
CANCEL_CHANNEL: Final = KEY_PREFIX + "cancel"
#: SET of the names of paused work queues (`pipeline.scheduling.pause`): the fetch (`fetch.lua`) pops none of their
#: jobs.
PAUSED_KEY: Final = KEY_PREFIX + "paused"

#: celery-redbeat's keys: entries `pipeline:beat:<name>`, `pipeline:beat::schedule`, the lock `pipeline:beat::lock`.
BEAT_KEY_PREFIX: Final = KEY_PREFIX + "beat:"
#: On a Redis Cluster: redbeat's keys under one hash tag (it writes an entry and the schedule in one pipeline).
BEAT_CLUSTER_KEY_PREFIX: Final = KEY_PREFIX + "{beat}:"
#: Message header stamped at publish time (epoch seconds, float) for queue-wait measurement.
HEADER_PUBLISHED_AT: Final = "pipeline_published_at"
#: Message header carrying the caller's idempotency key, if any.
HEADER_IDEMPOTENCY_KEY: Final = "pipeline_idempotency_key"

#: A job deferred by the cluster-wide rate limiter carries the slot it was given (epoch s), and how many
#: times it was deferred; `pipeline.scheduling.ratelimit` owns both. The slot is only a mark: the one a deferred job
#: starts on is the one the limiter recorded for its id (`RATE_SLOT_KEY`), taken once.
HEADER_RATE_SLOT: Final = "pipeline_rate_slot"
HEADER_THROTTLED: Final = "pipeline_throttled"
#: A job of a task whose cluster-wide limit has a key (`typed_task(rate_key=...)`) carries that key, computed from its
#: payload at enqueue: the worker's fetch (`fetch.lua`) takes the job's slot in the same call that takes the job.
HEADER_RATE_KEY: Final = "pipeline_rate_key"
#: Set by the worker's fetch on the delivery it hands over (never trusted from a message): the slot the fetch took,
#: {"key": the limiter's key, "slot": epoch s on Redis's clock, "due": epoch s on this host's clock}.
HEADER_RATE_GRANT: Final = "pipeline_rate_grant"
#: Message header: the job's group (a tenant, a customer): within a queue and priority level, jobs are taken
#: round-robin across groups, and GROUP_CONCURRENCY caps how many of one group run at once (`pipeline.groups`).
HEADER_GROUP: Final = "pipeline_group"
#: Message header of a job that is a step of a flow: {"flow": name, "id": flow id, "step": step, "item": index of a
#: fan-out item or null} (`pipeline.flows`). A worker builds a joining step's payload from it, and records the step's
#: result in the flow when it succeeds.
HEADER_FLOW: Final = "pipeline_flow"
#: A flow's keys share one hash tag, its id: `pipeline:flow:{<id>}` and `...:results`, `...:tasks`, `...:failed`,
#: `...:wait:<step>` (the layout is written at the top of `pipeline/lua/flow_advance.lua`).
FLOW_KEY: Final = KEY_PREFIX + "flow:{{{id}}}"
#: ZSET flow id -> start time (epoch s) of the recent flows, trimmed to RECENT_JOBS_MAX.
FLOWS_INDEX_KEY: Final = KEY_PREFIX + "flows"
#: STRING: the id of the flow whose start claimed idempotency key `key` (expires after ENQUEUE_IDEMPOTENCY_TTL).
FLOW_IDEMPOTENCY_KEY: Final = KEY_PREFIX + "flow-start:{flow}:{key}"
#: ZSET flow id -> when its latest hand-off began (epoch s), on a Redis Cluster only: the flows whose claimed steps the
#: reconciler checks are queued (`pipeline.flows.handoff`, `pipeline.flows.reconcile`).
FLOW_HANDOFFS_KEY: Final = KEY_PREFIX + "flow-handoffs"
#: Prefix of the groups' keys (their layout is written at the top of `pipeline/lua/fetch.lua`).
GROUP_KEY_PREFIX: Final = KEY_PREFIX + "group:"
#: Grouped jobs waiting, per queue list key (kept by `enqueue.lua` and `fetch.lua`).
GROUP_COUNT_KEY: Final = GROUP_KEY_PREFIX + "count"
#: The longest group name, in characters.
GROUP_MAX_LENGTH: Final = 128
#: GCRA state of a cluster-wide limit: the theoretical arrival time (ms), per task and optional key.
RATE_LIMIT_KEY: Final = KEY_PREFIX + "ratelimit:{task}"
#: STRING: the slot (epoch s on Redis's clock) the rate limiter gave a job it deferred, by job id; taken (GETDEL)
#: when the deferred job starts, so no message can name a slot of its own (`pipeline.scheduling.ratelimit`).
RATE_SLOT_KEY: Final = KEY_PREFIX + "rate-slot:{id}"

#: kombu's separator and steps for priority sub-queues on Redis: `<queue>\x06\x16<priority>`.
PRIORITY_SEPARATOR: Final = "\x06\x16"
PRIORITY_STEPS: Final = (0, 3, 6, 9)
#: kombu's Redis key holding delivered-but-unacknowledged messages.
UNACKED_KEY: Final = "unacked"
#: kombu's ZSET beside it (delivery tag → score); with leases, each lease's expiry.
UNACKED_INDEX_KEY: Final = "unacked_index"

#: Leases (`pipeline.delivery.lease`): HASH delivery tag → the worker incarnation that holds the delivery.
LEASE_KEY: Final = KEY_PREFIX + "lease"
#: HASH delivery tag → how many times it was delivered (the `x-delivery-count` header a worker sees).
DELIVERIES_KEY: Final = KEY_PREFIX + "deliveries"
#: LIST of the last deliveries of one delivery tag, JSON {"at": epoch s, "worker": hostname}, newest last.
DELIVERY_LOG_KEY: Final = KEY_PREFIX + "deliveries:{tag}"
#: Message header: how many times this message was delivered, 1 the first time (as RabbitMQ quorum queues set).
HEADER_DELIVERY_COUNT: Final = "x-delivery-count"
#: The lease owner a worker's fetch wrote for a delivery, set on the message it delivers: a result of that job is
#: stored only while this owner still holds the job's lease (`store.lua`).
HEADER_LEASE_OWNER: Final = "x-lease-owner"
#: On a Redis Cluster, the queue whose slot keeps the lease of a delivery (set by the fetch, as the owner).
HEADER_LEASE_QUEUE: Final = "x-lease-queue"
#: Headers a worker's fetch sets on one delivery: they describe that delivery and never travel on a message
#: published from it (a retry, a deferred job), where a worker that takes it unleased would read them as its own.
DELIVERY_HEADERS: Final = (HEADER_DELIVERY_COUNT, HEADER_LEASE_OWNER, HEADER_LEASE_QUEUE, HEADER_RATE_GRANT)
