"""Property-based fuzzing of the API from its own OpenAPI schema (schemathesis): no 5xx for any input.

The server under test has a Redis of its own that no worker consumes, so the fuzzed jobs it accepts
(probe jobs asking to sleep for minutes, say) are stored and never run; both are stopped by PID after.
Every operation gets a bounded number of generated cases, so the whole run takes seconds.

The schema is the one the server serves at /openapi.json, read when the first test runs. Its tests are built then,
in the one process that runs this file: every test process collects every file, and building the schema's tests
while collecting (schemathesis' coverage cases, the most of it) cost about 8 s of CPU in each. So the operations are
named here, one test each, and `test_every_operation_the_api_serves_is_fuzzed` keeps the list whole.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import SkipTest

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.core.failures import FailureGroup, as_reported_failure
from schemathesis.core.result import Ok
from schemathesis.pytest.lazy import get_all_tests
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.support.api import ApiServer
from tests.support.procs import RedisServer

pytestmark = pytest.mark.integration

#: The token of the server under test; `Bearer` hands it to schemathesis.
TOKEN = "fuzz-token-" + secrets.token_hex(12)

#: Every operation of the API, as schemathesis labels them.
OPERATIONS = (
    "DELETE /dlq/{entry_id}",
    "GET /dlq",
    "GET /dlq/{entry_id}",
    "GET /flows",
    "GET /flows/kinds",
    "GET /flows/{flow_id}",
    "GET /healthz",
    "GET /jobs",
    "GET /jobs/{job_id}",
    "GET /jobs/{job_id}/events",
    "GET /kinds",
    "GET /queues",
    "GET /readyz",
    "POST /dlq/{entry_id}/replay",
    "POST /flows/invoice",
    "POST /flows/media",
    "POST /flows/{flow_id}/cancel",
    "POST /jobs/email",
    "POST /jobs/email/batch",
    "POST /jobs/pdf",
    "POST /jobs/pdf/batch",
    "POST /jobs/probe",
    "POST /jobs/probe/batch",
    "POST /jobs/transcode",
    "POST /jobs/transcode/batch",
    "POST /jobs/webhook",
    "POST /jobs/webhook/batch",
    "POST /jobs/{job_id}/cancel",
    "POST /queues/{name}/pause",
    "POST /queues/{name}/resume",
)


@pytest.fixture(scope="module")
def fuzz_api(work_dir: Path) -> Iterator[ApiServer]:
    redis = RedisServer(work_dir / "fuzz-redis").start()
    server = ApiServer("fuzz", work_dir / "logs", {"REDIS_URL": redis.url}, token=TOKEN).start()
    yield server
    server.stop()
    redis.stop()


@pytest.fixture(scope="module")
def served_schema(fuzz_api: ApiServer) -> Any:
    """The schema the server under test serves at /openapi.json."""
    return schemathesis.openapi.from_url(f"{fuzz_api.url}/openapi.json")


@schemathesis.auth()
class Bearer:
    """Tells schemathesis how this API authenticates, so its negative cases know what auth looks like."""

    def get(self, case: Any, ctx: Any) -> str:
        return TOKEN

    def set(self, case: Any, data: str, ctx: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def no_server_error(case: Any, fuzz_api: ApiServer) -> None:
    case.call_and_validate(
        base_url=fuzz_api.url,
        # Cross-field rules (delay_seconds xor eta, an eta at most 365 days ahead) cannot be said in
        # OpenAPI, so a schema-valid request may rightly get a 422; every other check stays on.
        excluded_checks=[positive_data_acceptance],
    )


@pytest.mark.parametrize("operation", OPERATIONS)
def test_no_server_errors_for_generated_requests(operation: str, served_schema: Any, fuzz_api: ApiServer) -> None:
    """The operation's generated cases (schemathesis' phases: examples, coverage, fuzzing) all answered below 500,
    built and run as schemathesis runs a schema loaded by a fixture (`schemathesis.pytest.from_fixture`)."""
    (built,) = get_all_tests(
        schema=served_schema.include(name=operation), test_func=no_server_error, settings=None, given_kwargs=None
    )
    if not isinstance(built, Ok):
        raise built.err()  # the schema's own error for this operation
    _, test = built.ok()
    try:
        test(fuzz_api=fuzz_api)
    except FailureGroup as exc:
        raise as_reported_failure(exc) from None
    except SkipTest as exc:
        pytest.skip(str(exc))


def test_every_operation_the_api_serves_is_fuzzed(served_schema: Any) -> None:
    served = {result.ok().label for result in served_schema.get_all_operations()}
    assert served == set(OPERATIONS), f"OPERATIONS lacks {served - set(OPERATIONS)}, has {set(OPERATIONS) - served}"
