"""The job-status page: `GET /` (HTML) and `/static/*` (CSS, JS). No build step, no data without the token.

The page holds no data itself; its script asks for the API token once, keeps it in sessionStorage and
calls the same JSON routes as any client, with the `Authorization` header (the events stream too, read
with fetch(), so the token never appears in a URL or an access log).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
#: Scripts and styles only from this origin, no inline code, no framing.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def mount(app: FastAPI) -> None:
    routes = APIRouter(include_in_schema=False)

    @routes.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    app.include_router(routes)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
