"""`GET /docs`: Swagger UI, served with its scripts and styles from this API (no CDN: it works offline).

The assets come from the `swagger-ui-bundle-v2` package (Swagger UI 5, which reads the OpenAPI 3.1
documents FastAPI writes; Apache-2.0), served under `/static/swagger-ui/`. Only the three files the page
loads are served, not the rest of the distribution (its stock index page points at a demo API). The page
is FastAPI's own `get_swagger_ui_html` with those URLs; there is no OAuth2 redirect page, since the API
uses a bearer token (*Authorize* in the UI).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

ASSETS_URL = "/static/swagger-ui"
#: The files the page loads, with their content types.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
ASSET_HEADERS = {"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"}


def mount(app: FastAPI) -> None:
    """Add `/docs` and its assets. Call it before `/static` is mounted (a mount takes every path below it)."""
    directory = Path(str(swagger_ui_path))
    routes = APIRouter(include_in_schema=False)

    @routes.get("/docs")
    def swagger_ui(request: Request) -> HTMLResponse:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"),
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon-32x32.png",
            oauth2_redirect_url=None,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    @routes.get(ASSETS_URL + "/{name}")
    def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise HTTPException(404, detail="not found")
        return FileResponse(directory / name, media_type=ASSETS[name], headers=ASSET_HEADERS)

    app.include_router(routes)
