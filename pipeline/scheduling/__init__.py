"""Scheduling: when jobs run.

- `delayed`: releases parked delayed jobs (parked by `pipeline.publish`) onto their queues when due, exactly once.
- `ratelimit`: the cluster-wide limiter (GCRA in Redis) that defers a job to its slot instead of running it.
- `pause`: paused queues (`pipeline:paused`), whose jobs wait and none starts until the queue is resumed.

Beat's schedule (UTC cron entries, the HA redbeat lock) is configuration: `pipeline.config.beat`; its scheduler
(redbeat's, made to survive Redis outages; `beat_scheduler` names it) is `pipeline.compat.redbeat`.
Per-worker rate limits are Celery's own `rate_limit`, set by TASK_RATE_LIMITS (`pipeline.config.celery`).
"""
