"""`pipeline.api`: the producer HTTP API and the job-status page (FastAPI, served by uvicorn).

`uvicorn pipeline.api:app` serves it; the application is built on first access of `app`, so importing
a submodule does not build it. Building it also sets up the process's logging and Sentry
(`pipeline.api.serving`). See docs/api.md for the routes, authentication and the page.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fastapi import FastAPI


@cache
def _app() -> FastAPI:
    from pipeline.api.factory import create_app
    from pipeline.api.serving import setup_process

    setup_process()  # the serving process's logs and Sentry, as a worker's
    return create_app()


def __getattr__(name: str) -> Any:
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
