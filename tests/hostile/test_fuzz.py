"""Schemathesis against the live server's /openapi.json: valid and invalid requests,
generated from the schema, for every route. No response may be a 5xx, and every error
must carry exactly the error body `{"error": {"type", "message"}}`.

Half the requests on a session route are aimed at a real, live session (schemathesis
alone would only ever find unknown ids), so fuzzed bodies reach the engine and the store.
"""

from __future__ import annotations

import random
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from app.api.errors import ErrorType

MIN_CASES = 1000
EXAMPLES_PER_OPERATION = 135  # x 8 routes with parameters; the 4 without yield one case each
_ERROR_TYPES = {e.value for e in ErrorType}


@schemathesis.check
def error_body_is_the_error_schema(ctx, response, case) -> None:
    """Every 4xx/5xx body is exactly {"error": {"type": <ErrorType>, "message": <str>}}."""
    if response.status_code < 400:
        return
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"not the error body: {body!r}"
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"type", "message"}, f"not the error body: {body!r}"
    assert err["type"] in _ERROR_TYPES, f"unknown error type {err['type']!r}"
    assert isinstance(err["message"], str) and err["message"], "empty error message"


@pytest.fixture(scope="module")
def live_session(server):
    """A callable giving the id of a live session (a fresh one each time: fuzzed requests
    may delete, fill or lock the sessions they are given)."""
    client = httpx.Client(base_url=server.url, timeout=30)
    rng = random.Random(0)

    def make() -> str | None:
        if rng.random() < 0.5:
            return None
        r = client.post("/v1/sessions", json={"prompt": "fuzz"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    yield make
    client.close()


def test_api_never_fails_with_5xx_or_a_malformed_error(server, live_session):
    # (schemathesis's pytest plugin does not run on pytest 9: drive its strategies directly)
    api = schemathesis.openapi.from_url(server.url + "/openapi.json")
    checks = [not_a_server_error, error_body_is_the_error_schema]
    counts: Counter[str] = Counter()
    for result in api.get_all_operations():
        operation = result.ok()
        strategy = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
        )

        @given(case=strategy)
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
        )
        def fuzz(case) -> None:
            if case.path_parameters and "session_id" in case.path_parameters:
                sid = live_session()
                if sid is not None:
                    case.path_parameters["session_id"] = sid
            response = case.call(timeout=30)
            counts[case.operation.label] += 1
            case.validate_response(response, checks=checks)

        fuzz()
    # at least MIN_CASES generated requests, spread over every route
    assert sum(counts.values()) >= MIN_CASES, counts
    assert len(counts) >= 10, counts
