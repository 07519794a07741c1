"""Property-based fuzzing of the API from its own OpenAPI schema (schemathesis): no 5xx for any input. This file:
the reads, the DLQ, flows, cancel, pause and resume; `test_api_fuzz_jobs.py` the job submissions (`tests.support.fuzz`
says why two files, and why the operations are listed).

Every operation gets a bounded number of generated cases, so the whole run takes seconds.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.api import ApiServer
from tests.support.fuzz import OPERATIONS, OTHERS, fuzz

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("operation", OTHERS)
def test_no_server_errors_for_generated_requests(operation: str, fuzz_schema: Any, fuzz_api: ApiServer) -> None:
    fuzz(fuzz_schema, operation, fuzz_api)


def test_every_operation_the_api_serves_is_fuzzed(fuzz_schema: Any) -> None:
    served = {result.ok().label for result in fuzz_schema.get_all_operations()}
    assert served == set(OPERATIONS), f"OPERATIONS lacks {served - set(OPERATIONS)}, has {set(OPERATIONS) - served}"
