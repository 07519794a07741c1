"""Celery's own integration suite (`t/integration` of the locked Celery's sdist) against the pipeline's worker.

`make test-celery` runs `python -m tests.celery_suite`: the sdist is fetched and checked against the lock's hash
(`sdist`), then the chosen modules run once per variant (`variants`): a stock Celery worker as the baseline, the
pipeline's worker on prefork and on the asyncio pool, and our own canvas checks (`suite_pools`) on prefork, solo and
the asyncio pool too. Each pytest process starts its own throwaway redis-server and one external worker
(`plugin`), and stops both by PID. Tests that fail on purpose or by a known bug are listed in `expected.txt` with
their cause: they run as strict xfails, so a new failure and a listed test that starts passing both fail the step.
docs/celery-compat.md has the counts and the differences.
"""
