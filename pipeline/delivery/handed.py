"""Jobs a lost connection finds in a prefork pool process's pipe, not taken yet: they run, and are settled as usual.

Celery's prefork pool writes a job into a pool process's pipe; the process says it took the job (its ACK, which
makes the request active) when it reads it. After a lost connection Celery's consumer flushes the pool
(`Consumer.on_close` → `AsynPool.flush`, `celery/concurrency/asynpool.py`), which forgets every job not taken yet
(`ApplyResult.discard`: out of the pool's job table) "since they will be redelivered by the broker". A job written
to a pipe already is read and run by its process all the same, and the main process then ignores its ACK and its
outcome (a job no longer in the table): the job ran, its request never ended, and its delivery was neither
acknowledged nor given back (it stayed leased, renewed for good: issue 39).

`in_pipes` names those jobs before the flush (a job's writer has started once it names the process, `_write_to`:
the flush finishes every write it started), and `keep` puts the flushed ones back in the table after it, so the
process's ACK and result reach their request: the job is acknowledged when it ends, as any running job is. The
delivery step keeps their leases through the lost connection (`pipeline.delivery.fencing`). Jobs Celery had not
written to a process yet are never run: their leases are given up, for a sweep to put them back on their queues.
"""

from __future__ import annotations

from typing import Any


def _table(pool: Any) -> Any:
    """The prefork pool's job table (billiard's `Pool._cache`: job id → `ApplyResult`), None for other pools."""
    return getattr(getattr(pool, "_pool", None), "_cache", None)


def flushed(pool: Any) -> bool:
    """Whether Celery's flush after a lost connection forgets the jobs `pool` was handed (the prefork pool's do; a
    job handed to another pool runs there)."""
    return _table(pool) is not None


def in_pipes(pool: Any) -> list[Any]:
    """The jobs written (or being written) to a pool process that has not taken them yet (none with Celery's synack:
    its flush cancels them, and the process does not run them)."""
    table = _table(pool)
    if table is None or getattr(pool._pool, "synack", False):
        return []
    return [
        job for job in list(table.values()) if not getattr(job, "_accepted", True) and getattr(job, "_write_to", None)
    ]


def keep(pool: Any, jobs: list[Any]) -> None:
    """Put `jobs` back in the pool's job table (after Celery's flush): their process's ACK and result are handled."""
    table = _table(pool)
    if table is None:
        return
    for job in jobs:
        table.setdefault(job._job, job)
