"""One answer to "which pool runs the jobs", for a `-P` alias, Celery's resolved class, or a pool instance."""

from __future__ import annotations

from typing import Any

import pytest
from celery.concurrency import get_implementation

from pipeline.pools import is_solo, pool_kind


@pytest.mark.parametrize(
    ("alias", "kind"), [("solo", "solo"), ("prefork", "prefork"), ("processes", "prefork"), ("threads", "threads")]
)
def test_an_alias_and_the_class_celery_resolves_it_to_agree(alias: str, kind: str) -> None:
    cls: Any = get_implementation(alias)
    assert pool_kind(alias) == pool_kind(cls) == kind
    assert pool_kind(cls(limit=1)) == kind  # the pool itself, as the consumer holds it
    assert is_solo(alias) is (kind == "solo")


@pytest.mark.parametrize("pool", [None, "custom", "bogus", object(), type("Pool", (), {})])
def test_anything_else_is_other(pool: Any) -> None:
    assert pool_kind(pool) == "other"
    assert not is_solo(pool)
