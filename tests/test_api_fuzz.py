"""Property-based fuzzing of the control plane's OpenAPI spec (schemathesis over real
HTTP): whatever a client sends, with or without the token, the API never answers 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a test dependency")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from api.app import create_app  # noqa: E402
from tests.fake_handle import FakeRun  # noqa: E402
from tests.http_server import serving  # noqa: E402

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def base_url():
    with serving(create_app(FakeRun(islands=3), TOKEN)) as url:
        yield url


def test_fuzz_every_operation_no_5xx(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    calls = {"requests": 0}
    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def fuzz(case):
            for headers in ({"Authorization": f"Bearer {TOKEN}"}, {}):
                response = case.call(base_url=base_url, headers=headers)
                calls["requests"] += 1
                case.validate_response(response, checks=[not_a_server_error])

        fuzz()
    print(f"fuzzed {calls['requests']} requests across {len(list(schema.get_all_operations()))} operations")
    assert calls["requests"] >= 200
