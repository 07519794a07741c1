"""`/docs` in a real browser (Debian's chromium through Playwright): Swagger UI renders with nothing but the API.

Every request to another origin is refused by the browser context, so a page that still needed a CDN
would stay blank and fail here.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Route, expect, sync_playwright

from tests.support.api import ApiServer

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


@pytest.fixture(scope="module")
def api(work_dir: Path) -> Iterator[ApiServer]:
    server = ApiServer("docs", work_dir / "logs").start()
    yield server
    server.stop()


def test_swagger_ui_renders_offline(api: ApiServer) -> None:
    origin = urlsplit(api.url).netloc
    elsewhere: list[str] = []
    errors: list[str] = []

    def only_this_origin(route: Route) -> None:
        if urlsplit(route.request.url).netloc == origin:
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(base_url=api.url)
            context.route("**/*", only_this_origin)
            page = context.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto("/docs")
            expect(page.locator(".swagger-ui .info .title")).to_contain_text("pipeline", timeout=30_000)
            expect(page.locator('.opblock-summary-path[data-path="/jobs/probe"]')).to_be_visible()
            expect(page.locator('.opblock-summary-path[data-path="/jobs/probe/batch"]')).to_be_visible()
            expect(page.locator(".swagger-ui .btn.authorize")).to_be_visible()
        finally:
            browser.close()
    assert elsewhere == []
    assert errors == []
