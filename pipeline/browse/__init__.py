"""The job browser: every queue's jobs by state, with counts and stable cursor paging, never a payload.

Where each state is read (nothing here consumes or changes anything):

* ``waiting`` — the queue's Redis lists (every priority sub-queue, highest priority first), newest first;
* ``scheduled`` — parked delayed jobs (``pipeline:delayed`` and its destination hash), earliest due first;
* ``running`` — kombu's ``unacked`` hash: delivered to a worker and not yet acknowledged (running, or
  reserved by a worker's prefetch / held until its ETA);
* ``retrying``, ``succeeded``, ``failed`` — the queue's recent-jobs index (`pipeline.records`, the newest
  RECENT_JOBS_MAX accepted jobs), each resolved from the first bytes of its result-backend entry (Celery
  writes ``{"status": ...`` first), so counting reads no results; ``failed`` omits dead-lettered jobs;
* ``dead_lettered`` — the dead-letter queue, by the original queue of each entry, newest first.

A retrying job is also where it waits for its next attempt. Rows carry ids, task, queue, state, times
and attempts; the detail is `pipeline.status.job_status` (and the dead-letter entry). Cursors are opaque
(`pipeline.browse.model`): an offset into the lists (newest first: workers taking the oldest never make a
page skip a job), else a (score, id) position. `pipeline.browse.listing.browse` reads one page.
"""
