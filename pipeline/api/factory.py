"""The FastAPI application: routes, auth, error translation, body limit and the page, built by `create_app`.

Job-kind routes come from `pipeline.task.REGISTRY` after every task module is imported, so a kind added
to TASK_MODULES gets its `POST /jobs/<kind>` route (and OpenAPI schema) without touching this package; flows
declared by those modules get their `POST /flows/<name>` route the same way (`pipeline.api.flows`).
The server refuses to start without API_TOKEN: there is no unauthenticated mode. It writes jobs itself (kombu's
envelope, Redis layout), so it also refuses to start on a Celery, kombu or redis-py the producer was not verified
on (`pipeline.compat.versions.require`), unless ALLOW_UNVERIFIED_VERSIONS=true.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pipeline.api import docs, errors, events, flows, jobs, ops, page
from pipeline.api.limits import BodyLimit
from pipeline.compat import PRODUCER_LIBRARIES, versions
from pipeline.config import Settings, get_settings
from pipeline.errors import ConfigError
from pipeline.task import load_task_modules

DESCRIPTION = """Accept background jobs over HTTP and follow them to the end.

Every route except `/`, `/healthz`, `/readyz` and these docs needs `Authorization: Bearer <API_TOKEN>`.
A `202` means the job (or the flow and its first steps' jobs) is stored in the broker; a `503` (with `Retry-After`)
means nothing was stored.
"""


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    if get_settings().api_token is None:
        raise ConfigError(
            "pipeline api: API_TOKEN is not set; the API does not run without authentication. "
            "Set API_TOKEN to a random secret of 16+ characters (`pipeline run` generates one for development)."
        )
    yield


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    versions.require("API", PRODUCER_LIBRARIES, settings.allow_unverified_versions)
    registry = {kind: typed for kind, typed in load_task_modules().items() if typed.public}
    app = FastAPI(
        title="pipeline",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served by pipeline.api.docs, with Swagger UI's assets from this API
        redoc_url=None,
    )
    errors.install(app)
    app.include_router(jobs.router(registry))
    app.include_router(events.router())
    app.include_router(flows.router())  # after load_task_modules: one start route per declared flow
    app.include_router(ops.router())
    app.include_router(ops.health_router())
    docs.mount(app)  # before the page's /static mount, which would take /static/swagger-ui/* too
    page.mount(app)
    app.add_middleware(BodyLimit, max_bytes=settings.api_max_body_bytes, timeout_s=settings.api_body_timeout)
    return app
