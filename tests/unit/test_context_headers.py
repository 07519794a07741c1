"""The task context's custom headers (`pipeline.compat.context`) are the ones Celery's own method finds.

Requests are drawn from the keys the installed Celery knows, read from it now: `Context`'s attributes and every
string its own `_get_custom_headers` names, plus keys of no one; each is compared with what Celery's method returns.
"""

from __future__ import annotations

import ast
import inspect
import random
import string
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from celery.app.task import Context

from pipeline.compat import context
from tests.support.compat import verified_as_installed

pytestmark = pytest.mark.parity


def _named_by(function: Any) -> set[str]:
    """Every string constant in `function`'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


CELERY_KEYS = sorted({*Context.__dict__.keys(), *_named_by(context.CELERY_CUSTOM_HEADERS)})


@pytest.fixture
def installed() -> Iterator[None]:
    with verified_as_installed():
        context.install()
    yield
    context.uninstall()


def _request(rng: random.Random) -> dict[str, Any]:
    request: dict[str, Any] = {}
    for _ in range(rng.randint(0, 30)):
        key = rng.choice(CELERY_KEYS) if rng.random() < 0.7 else "".join(rng.choices(string.ascii_lowercase, k=6))
        request[key] = rng.choice([None, 0, "v", ["x"], {"k": 1}])
    return request


def test_custom_headers_are_celerys_for_any_request() -> None:
    rng = random.Random(12)
    for _ in range(2000):
        request, extra = _request(rng), _request(rng)
        ctx = Context()
        ours = context.custom_headers(ctx, request, **extra)
        celerys = context.CELERY_CUSTOM_HEADERS(ctx, request, **extra)
        assert ours == celerys
        assert list(ours or ()) == list(celerys or ())  # same order


def test_a_context_keeps_its_custom_headers(installed: None) -> None:
    request = {"id": "job-1", "task": "email.send", "retries": 1, "pipeline_published_at": 1.5, "x-trace": "t"}
    ctx = Context(request, args=[1], called_directly=False, kwargs={})
    assert ctx.headers == {"pipeline_published_at": 1.5, "x-trace": "t"}
    assert Context({"id": "job-2", "retries": 0}).headers is None


def test_an_attribute_added_to_context_later_is_a_celery_key_again(installed: None) -> None:
    ctx = Context()
    assert context.custom_headers(ctx, {"late_attr": 1}) == {"late_attr": 1}
    Context.late_attr = None  # type: ignore[attr-defined]  # what a newer Celery or a plugin may add
    try:
        assert context.custom_headers(ctx, {"late_attr": 1}) is None
        assert context.CELERY_CUSTOM_HEADERS(ctx, {"late_attr": 1}) is None
    finally:
        del Context.late_attr  # type: ignore[attr-defined]
    assert context.custom_headers(ctx, {"late_attr": 1}) == {"late_attr": 1}


def test_the_answers_kept_stay_bounded() -> None:
    ctx = Context()
    for n in range(context.MAX_KEYS + 10):
        assert context.custom_headers(ctx, {f"x-header-{n}": n}) == {f"x-header-{n}": n}
    assert len(context._answers) <= context.MAX_KEYS + 1
