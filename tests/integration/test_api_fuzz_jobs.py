"""Property-based fuzzing of the API's job submissions (one job or a batch of each kind) from its own OpenAPI schema
(schemathesis): no 5xx for any input. The other operations: `test_api_fuzz.py`; why two files: `tests.support.fuzz`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.api import ApiServer
from tests.support.fuzz import SUBMISSIONS, fuzz

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("operation", SUBMISSIONS)
def test_no_server_errors_for_generated_requests(operation: str, fuzz_schema: Any, fuzz_api: ApiServer) -> None:
    fuzz(fuzz_schema, operation, fuzz_api)
