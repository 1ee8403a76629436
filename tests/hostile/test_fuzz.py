"""Schemathesis against the live server's /openapi.json: valid and invalid requests,
generated from the schema, for every route. No response may be a 5xx, and every error
must carry exactly the error body `{"error": {"type", "message"}}`.

Half the requests on a session route are aimed at one of a few live sessions
(schemathesis alone would only ever find unknown ids), so fuzzed bodies, headers and
If-Match values reach the engine and the store.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from app.api.http.errors import ErrorType
from tests.conftest import example_count

# at the full count (`make test-slow`; a fifth in `make test`: tests/conftest.py example_count)
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


class LiveSessions:
    """A few live sessions that fuzzed requests on session routes are aimed at, half the
    time; one that a fuzzed DELETE removed is replaced by a fresh one."""

    def __init__(self, url: str, size: int = 6):
        self.client = httpx.Client(base_url=url, timeout=30)
        self.rng = random.Random(0)
        self.ids = [self._create() for _ in range(size)]

    def _create(self) -> str:
        r = self.client.post("/v1/sessions", json={"prompt": "fuzz"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def aim(self, case) -> int | None:
        """Point `case` at a live session (returns its slot), or leave it as generated."""
        if not (case.path_parameters and "session_id" in case.path_parameters) or self.rng.random() < 0.5:
            return None
        slot = self.rng.randrange(len(self.ids))
        case.path_parameters["session_id"] = self.ids[slot]
        return slot

    def after(self, slot: int | None, case, status: int) -> None:
        if slot is not None and case.method.upper() == "DELETE" and status == 204:
            self.ids[slot] = self._create()


@pytest.fixture(scope="module")
def live(server) -> Iterator[LiveSessions]:
    sessions = LiveSessions(server.url)
    yield sessions
    sessions.client.close()


@pytest.mark.full_examples
def test_api_never_fails_with_5xx_or_a_malformed_error(server, live):
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
            max_examples=example_count(EXAMPLES_PER_OPERATION),
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
        )
        def fuzz(case) -> None:
            slot = live.aim(case)
            response = case.call(timeout=30)
            live.after(slot, case, response.status_code)
            counts[case.operation.label] += 1
            case.validate_response(response, checks=checks)

        fuzz()
    print(f"fuzz: {sum(counts.values())} cases over {len(counts)} operations, none a 5xx")
    # at least MIN_CASES generated requests, spread over every route
    assert sum(counts.values()) >= example_count(MIN_CASES), counts
    assert len(counts) >= 10, counts
