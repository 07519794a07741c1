"""Canvas on the pool the external worker runs: copied into the suite as `t/integration/test_pipeline_pools.py`.

It runs in Celery's own harness (its conftest, its `manager` fixture), on prefork, solo and the asyncio pool: a chord
of plain tasks, a chain whose steps are `async def` typed tasks, a group of typed tasks and a chord of async typed
tasks (`tests.celery_suite.pool_tasks`, registered on the pipeline's worker). The typed tasks are called by name,
as any Celery client calls them.
"""

import os

from celery import chain, chord, group, signature

from .tasks import add, tsum

TIMEOUT = 60


def test_worker_runs_the_pool_under_test(manager):
    stats = manager.inspect().stats()
    assert stats, "no worker answered"
    (node,) = stats.values()
    assert node["pool"]["implementation"] == os.environ["CELERY_SUITE_POOL_CLASS"]


def test_chord_of_plain_tasks(manager):
    result = chord(add.s(i, i) for i in range(10))(tsum.s())
    assert result.get(timeout=TIMEOUT) == 90


def test_chain_of_async_typed_tasks(manager):
    steps = chain(signature("suite.double", args=({"value": 1},)), signature("suite.double"), signature("suite.double"))
    assert steps.apply_async().get(timeout=TIMEOUT) == {"value": 8}


def test_group_of_typed_tasks(manager):
    squares = group(signature("suite.square", args=({"value": i},)) for i in range(6))
    assert squares.apply_async().get(timeout=TIMEOUT) == [{"value": i * i} for i in range(6)]


def test_chord_of_async_typed_tasks(manager):
    header = [signature("suite.double", args=({"value": i},)) for i in range(5)]
    assert chord(header, signature("suite.total")).apply_async().get(timeout=TIMEOUT) == 20
