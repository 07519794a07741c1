"""The producer's hot path: one enqueue is one Redis round trip, thousands of jobs a few round trips.

* `client`: one Redis client per process on the broker (configured by kombu exactly as Celery's is: TLS,
  Sentinel, timeouts), reused across publishes and rebuilt after a fork.
* `template`: per task, kombu's envelope (and the `task-sent` event when the app sends it) captured once from a
  real Celery publish and split around the fields that change per job (ids, payload, timestamps), so a job's
  message is the bytes Celery would have built, at a fraction of the cost.
* `write`: the job record, the recent-jobs index and the message (queued, or parked until due) written in one
  MULTI; `enqueue_many` validates a batch in one call and writes records and messages per chunk.
* `idempotency`: an idempotency key yields the same job, not a second one.

Each publish pushes its queue's wake-up marker with its message (`pipeline.queues.wake`).
"""
