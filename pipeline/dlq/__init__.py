"""The dead-letter queue: where a job that finally failed is kept, with what is needed to judge and replay it.

- `envelope`: the entry (`DeadLetter`: task, payload, queue, attempts, exception, traceback, time), publishing it
  to the `dead_letter` queue, and the on-disk spool used while the broker refuses it.
- `capture`: the one place entries are made: a failed task, a rejected, unknown or undecodable message.
- `consumer`: the worker's consumer, extended to dead-letter messages Celery cannot decode or would crash on.
- `poison`: the checks a message passes before Celery turns it into a job (shape, task id, size).
- `transport`: kombu's Redis transport, extended to dead-letter queue elements that are not messages.
- `admin`: list (with filters), show, replay, delete, purge, retention by age and count.

No worker consumes `dead_letter` (a worker asked to refuses to start: `pipeline.runtime.worker`);
`pipeline dlq` and the API's `/dlq` routes operate it.
"""
