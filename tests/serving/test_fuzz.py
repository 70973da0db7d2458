"""Property-based fuzzing of the server's own OpenAPI schema: no input may cause a 5xx.

Valid (positive) and invalid (negative) cases for every operation, drawn by schemathesis'
hypothesis strategies and sent to the live server. (Schemathesis' pytest plugin is not
used: it does not support this pytest version.)
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.serving.server import ServerProcess

EXAMPLES_PER_OPERATION = 20


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_causes_a_server_error(server: ServerProcess, mode: GenerationMode) -> None:
    # The schema is behind the API key, as the API is.
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=server.headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/tokenize",
        "/detokenize",
    }
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and not len(operation.body):
            continue  # an operation without a body (GET, POST /ping) has nothing invalid to generate

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
        def no_server_error(case: Any) -> None:
            response = case.call(base_url=server.base_url, headers=server.headers, timeout=60)
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code}: {response.text[:500]}"
            )
            if response.status_code >= 400 and case.path.startswith("/v1"):
                assert "error" in response.json()

        no_server_error()
