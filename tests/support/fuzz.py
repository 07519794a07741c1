"""Fuzzing the API from the schema it serves (schemathesis): the operations, the check and how one operation's
generated cases are built and run.

`tests/integration/test_api_fuzz.py` and `tests/integration/test_api_fuzz_jobs.py` each fuzz a part of the
operations against a server of their own (the `fuzz_api` fixture): the job submissions are most of the work, and a
file runs whole in one test process (`--dist loadfile`), so two files end sooner than one.

The tests are built when they run, from the schema the server serves, in the one process that runs the file: every
test process collects every file, and building schemathesis' tests while collecting (its coverage cases, the most of
it) cost about 10 s of CPU in each. So the operations are named here, one test each, and
`test_every_operation_the_api_serves_is_fuzzed` keeps the list whole.
"""

from __future__ import annotations

import secrets
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

#: The token of the servers under test; `Bearer` hands it to schemathesis.
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
#: The job submissions (one job or a batch of a kind): their payloads make the most cases.
SUBMISSIONS = tuple(op for op in OPERATIONS if op.startswith("POST /jobs/") and "{" not in op)
#: The rest: reads, the DLQ, flows, cancel, pause and resume.
OTHERS = tuple(op for op in OPERATIONS if op not in SUBMISSIONS)


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


def served_schema(api: ApiServer) -> Any:
    """The schema `api` serves at /openapi.json."""
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json")


def fuzz(schema: Any, operation: str, api: ApiServer) -> None:
    """The operation's generated cases (schemathesis' phases: examples, coverage, fuzzing) all answered below 500,
    built and run as schemathesis runs a schema loaded by a fixture (`schemathesis.pytest.from_fixture`)."""
    (built,) = get_all_tests(
        schema=schema.include(name=operation), test_func=no_server_error, settings=None, given_kwargs=None
    )
    if not isinstance(built, Ok):
        raise built.err()  # the schema's own error for this operation
    _, test = built.ok()
    try:
        test(fuzz_api=api)
    except FailureGroup as exc:
        raise as_reported_failure(exc) from None
    except SkipTest as exc:
        pytest.skip(str(exc))
