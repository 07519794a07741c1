"""The dead-letter queue: where a job that finally failed is kept, with what is needed to judge and replay it.

- `envelope`: the entry (`DeadLetter`: task, payload, queue, attempts, exception, traceback, time), publishing it
  to the `dead_letter` queue, and the on-disk spool used while the broker refuses it.
- `capture`: the one place entries are made: a failed task, a rejected, unknown or undecodable message.
- `consumer`: the worker's consumer, extended to dead-letter messages Celery cannot decode.
- `admin`: list (with filters), show, replay, delete, purge, retention by age and count.

No worker consumes `dead_letter`; `pipeline dlq` and the API's `/dlq` routes operate it.
"""
