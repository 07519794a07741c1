"""Property-based fuzzing of the API from its own OpenAPI schema (schemathesis): no 5xx for any input.

The server under test has a Redis of its own that no worker consumes, so the fuzzed jobs it accepts
(probe jobs asking to sleep for minutes, say) are stored and never run; both are stopped by PID after.
Every operation gets a bounded number of generated cases, so the whole run takes seconds.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.support.api import ApiServer
from tests.support.procs import ROOT, RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fuzz_api(work_dir: Path) -> Iterator[ApiServer]:
    redis = RedisServer(work_dir / "fuzz-redis").start()
    server = ApiServer("fuzz", work_dir / "logs", {"REDIS_URL": redis.url}, token=TOKEN).start()
    yield server
    server.stop()
    redis.stop()


def app_schema() -> Any:
    """The schema the app serves at /openapi.json, built by a fresh interpreter as the server's own is.

    (This test process may have imported test-only tasks that a server never registers.)
    """
    build = "import json; from pipeline.api.factory import create_app; print(json.dumps(create_app().openapi()))"
    out = subprocess.run([sys.executable, "-c", build], cwd=ROOT, capture_output=True, text=True, check=True)
    return schemathesis.openapi.from_dict(json.loads(out.stdout))


schema = app_schema()
#: The token of the server under test; `Bearer` hands it to schemathesis (which may ask while collecting).
TOKEN = "fuzz-token-" + secrets.token_hex(12)


@schemathesis.auth()
class Bearer:
    """Tells schemathesis how this API authenticates, so its negative cases know what auth looks like."""

    def get(self, case: Any, ctx: Any) -> str:
        return TOKEN

    def set(self, case: Any, data: str, ctx: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors_for_generated_requests(case: Any, fuzz_api: ApiServer) -> None:
    case.call_and_validate(
        base_url=fuzz_api.url,
        # Cross-field rules (delay_seconds xor eta, an eta at most 365 days ahead) cannot be said in
        # OpenAPI, so a schema-valid request may rightly get a 422; every other check stays on.
        excluded_checks=[positive_data_acceptance],
    )
