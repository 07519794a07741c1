"""`pipeline.queues.jobkeys`: the keys put beside a result on a Redis Cluster hash to the result's own slot, whatever
braces its name holds (Redis's hash-tag rule, computed by redis-py's `key_slot`), or there is none."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from pipeline.queues import jobkeys


@pytest.mark.parametrize(
    "name",
    [
        "celery-task-meta-5f0c8c1e-1b7e-4e57-9a51-3d1f2f0e8a11",
        "celery-task-meta-{tenant}-1",
        "celery-task-meta-a{b}c{d}",
        "celery-task-meta-{}x",
        "celery-task-meta-{}{x}",
        "celery-task-meta-a{b",
        "celery-task-meta-a}b",
        "celery-task-meta-{}}",
    ],
)
def test_a_key_beside_a_result_shares_its_slot_or_there_is_none(name: str) -> None:
    beside = jobkeys.beside(name, "owner")
    if "}" in name and jobkeys.slot_tag(name) is None:
        assert beside is None
        return
    assert beside is not None and beside.startswith("pipeline:owner:")
    assert key_slot(beside.encode()) == key_slot(name.encode())


def test_records_are_named_by_the_layout() -> None:
    assert jobkeys.record("abc", False) == "pipeline:job:abc"
    assert jobkeys.record("abc", True) == "pipeline:job:{celery-task-meta-abc}"
    assert jobkeys.record("a}b", True) == "pipeline:job:a}b", "no tag reaches its result's slot: the plain name"
    assert jobkeys.record_of_result("celery-task-meta-abc", True) == jobkeys.record("abc", True)
    assert jobkeys.record_of_result("other-abc", True) is None
