"""`uvicorn tests.support.api_app:app`: the API of `pipeline.api:app` with the test tasks and flows declared too
(`test_chain`, `test_fan`, `test_diamond`), so tests start the test flows over HTTP as a client starts the shipped
ones. `ApiServer(..., app=TEST_APP)` serves it."""

from __future__ import annotations

from typing import Any

from tests.support import worker_app  # noqa: F401  # declares the test tasks and flows before the app is built


def __getattr__(name: str) -> Any:
    if name == "app":
        from pipeline.api import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
