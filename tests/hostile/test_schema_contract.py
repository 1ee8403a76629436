"""The OpenAPI document tells the truth: schemathesis, with every check it has, against a
live server with two tenants' API keys and a real Redis, must find nothing.

Every check means: responses match their documented schemas (SSE events too, each against
its event's model), every status and error type a route answers is documented for it,
schema-valid requests are accepted and invalid ones refused, documented headers come
back, `OPTIONS` and other undocumented methods get 405 with the path's methods in
`Allow`, a key is enforced wherever the document says one is needed, one tenant never
reads what another created, and the stateful phase follows the document's links (create
-> generate / score / fork / delete ...), checking that a created session is there and a
deleted one is gone.

Beside it, the behaviours the document promises that are easiest to break, pinned one by
one: each SSE stream against its events, 405's `Allow`, 422 for a body that is not JSON,
integers written as 1938.0, If-Match's forms, the key declared exactly where one is asked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

import model
from app.api.http.deps import IF_MATCH
from app.api.http.openapi import range_pattern
from tests.conftest import TINY, ServerProcess, example_count
from tests.sensitive import write_sensitive

# two tenants: the stateful phase checks that neither reads what the other created
KEYS = {"alice": "contract-key-alice", "bob": "contract-key-bob"}
KEY = KEYS["alice"]
SEED = 7
# per operation and phase, as the run: at this count in `make test-slow`, a fifth of it
# in `make test` (tests/conftest.py example_count)
EXAMPLES = 60
# statuses a schema-valid request may get besides schemathesis's defaults (2xx, 3xx, 401,
# 403, 404, 409, 429, 5xx): 412 when If-Match names another version than the session's
# (the session's state, not the request's shape), and 413 prompt_too_long past the
# server's max_prompt_tokens (tokens of a text or a rendered chat, which no schema counts)
POSITIVE_ALSO = ["412", "413"]

MAX_BATCH = 32  # the contract server's max_batch_size
VOCAB = 258  # the tiny model's: token ids 0..257

# The rules of the API that OpenAPI cannot state, as a schemathesis hook that makes a
# generated request keep them (a request that breaks one is a contradiction: 422):
# - a request that sends both the body's session_id and the X-Session-Id header names one
#   session in both: a case that sends both gets the header's;
# - a completion that continues a session has one prompt: a batch (an array of texts or
#   of token-id arrays) sent with a session keeps its first prompt;
# - a completion runs at most max_batch_size generations, n per prompt: a batch keeps
#   as many prompts as fit.
# Only a schema-valid batch is cut (so a cut never makes an invalid body valid), and only
# to a shorter one, which the schema allows as well.
HOOKS = f"""
import schemathesis

MAX_BATCH, VOCAB = {MAX_BATCH}, {VOCAB}


def _integer(x, low, high):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and low <= x <= high and float(x).is_integer()


def _batch(prompt):
    \"\"\"A schema-valid batch of several prompts, or None.\"\"\"
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt):
        return prompt
    if all(isinstance(p, list) and all(_integer(t, 0, VOCAB - 1) for t in p) for p in prompt):
        return prompt
    return None


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    headers = case.headers or {{}}
    header = next((v for k, v in headers.items() if k.lower() == "x-session-id"), None)
    body = case.body if isinstance(case.body, dict) else {{}}
    if isinstance(body.get("session_id"), str) and header is not None:
        body["session_id"] = header
    batch = _batch(body.get("prompt")) if case.operation.path == "/v1/completions" else None
    if batch is not None:
        n = int(body["n"]) if _integer(body.get("n"), 1, MAX_BATCH) else 1
        session = header is not None or isinstance(body.get("session_id"), str)
        body["prompt"] = batch[: 1 if session else max(1, MAX_BATCH // n)]
"""

CONFIG = f"""
hooks = "contract_hooks"

[auth.wfc]
path = "wfc-auth.json"
peers = {json.dumps(list(KEYS))}

[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx", {", ".join(f'"{s}"' for s in POSITIVE_ALSO)}]

[checks.negative_data_rejection]
# a body past the server's size limit is refused before it is read: 413 body_too_large
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
# a JSON schema (response_format, text.format, a tool's parameters) is data to the API: whether
# it is a JSON Schema a grammar can be made of, or a tool_choice names a tool offered, is more
# than the document states, so 400 invalid_schema is expected
[[operations]]
include-path = "/v1/chat/completions"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx", {", ".join(f'"{s}"' for s in POSITIVE_ALSO)}
]
[[operations]]
include-path = "/v1/responses"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx", {", ".join(f'"{s}"' for s in POSITIVE_ALSO)}
]
# an import's body is a state blob: whether bytes are one (safetensors, checksum, the served
# model's fingerprint) is more than any schema can say, so 422 invalid_state is expected
[[operations]]
include-path = "/v1/sessions/import"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx", {", ".join(f'"{s}"' for s in POSITIVE_ALSO)}
]
"""


@pytest.fixture(scope="module")
def contract_server(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A tiny model with the shipped chat template (so the chat route can answer 200), two
    keys (/metrics asks for one too), and a small generation cap so fuzzed requests stay
    cheap."""
    path = tmp_path_factory.mktemp("contract-model") / "tiny"
    write_sensitive(path, seed=0, chat_template=model.checkpoint.chat_template("shakespeare"), **TINY)
    srv = ServerProcess(
        path,
        tmp_path_factory.mktemp("contract"),
        redis_url,
        cpu_threads=1,
        max_tokens=8,
        max_prompt_tokens=300,
        max_batch_size=MAX_BATCH,
        api_keys=",".join(KEYS.values()),
        metrics_access="api_key",
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def http(contract_server: ServerProcess) -> Iterator[httpx.Client]:
    with contract_server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.mark.slow  # (a minute: make test keeps the schema's own checks above)
@pytest.mark.full_examples
def test_schemathesis_with_every_check_finds_nothing(contract_server: ServerProcess, tmp_path: Path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    (tmp_path / "contract_hooks.py").write_text(HOOKS)
    # Web Fuzzing Commons' auth file: each tenant's key as a fixed header
    users = [
        {"name": name, "fixedHeaders": [{"name": "Authorization", "value": f"Bearer {key}"}]}
        for name, key in KEYS.items()
    ]
    (tmp_path / "wfc-auth.json").write_text(json.dumps({"schemaVersion": "0.2.0", "auth": users}))
    st = Path(sys.executable).with_name("st")
    cmd = [
        str(st), "--config-file", str(config), "--no-color",
        "run", f"{contract_server.url}/openapi.json",
        "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(example_count(EXAMPLES)),
        "--seed", str(SEED),
        "--workers", "1",
        "--request-timeout", "30",
        "--output-truncate", "false",
        "--report", "junit", "--report-dir", str(tmp_path / "report"),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-30000:] + "\n--- server log ---\n" + contract_server.log_tail()
    print(out[out.rfind("API Operations") :])  # (its summary: operations, phases, cases)
    # it ran the stateful phase too, following the document's links
    assert re.search(r"Scenarios:\s+[1-9]", out), out[-5000:]


# one streamed request per SSE route, with every event kind it can send but `error`
STREAMS = {
    ("/v1/sessions/{session_id}/generate", "POST"): dict(
        body={"prompt": "ab", "max_tokens": 3, "logprobs": True, "stream": True}
    ),
    ("/v1/sessions/{session_id}/generate", "GET"): dict(
        query={"prompt": "ab", "max_tokens": 3, "logprobs": "true"}
    ),
    ("/v1/completions", "POST"): dict(
        body={
            "prompt": "ab",
            "max_tokens": 3,
            "stream": True,
            "logprobs": 1,
            "stream_options": {"include_usage": True},
        }
    ),
    ("/v1/chat/completions", "POST"): dict(
        body={
            "messages": [{"role": "user", "content": "ab"}],
            "max_tokens": 3,
            "stream": True,
            "logprobs": True,
            "stream_options": {"include_usage": True},
        }
    ),
}


def test_every_stream_is_its_documented_events(http: httpx.Client, contract_server: ServerProcess):
    """Each SSE route's events against the document's `itemSchema`, as schemathesis reads
    it (fuzzing alone reaches a 200 stream on some routes only now and then); and the
    check is not vacuous: a route's stream is refused against another route's events."""
    schema = schemathesis.openapi.from_url(f"{contract_server.url}/openapi.json")
    auth = {"Authorization": f"Bearer {KEY}"}
    got = {}
    for (path, method), kw in STREAMS.items():
        sid = http.post("/v1/sessions", json={"prompt": "x"}).json()["id"]
        operation = schema[path][method]
        case = operation.Case(
            path_parameters={"session_id": sid} if "{" in path else None, headers=auth, **kw
        )
        response = case.call(timeout=60)
        assert response.status_code == 200, (path, method, response.text)
        assert response.headers["content-type"][0].startswith("text/event-stream"), (path, method)
        case.validate_response(response, checks=[response_schema_conformance])
        got[(path, method)] = (case, response)
    # the generate stream is not a completion's, nor a completion's a chat's
    for mine, other in [
        (("/v1/sessions/{session_id}/generate", "POST"), ("/v1/completions", "POST")),
        (("/v1/completions", "POST"), ("/v1/chat/completions", "POST")),
    ]:
        _, response = got[mine]
        case = schema[other[0]][other[1]].Case(headers=auth)
        with pytest.raises(FailureGroup, match="SSE event violates schema"):
            case.validate_response(response, checks=[response_schema_conformance])


def test_every_other_method_gets_405_with_the_methods_of_the_path(http: httpx.Client):
    paths = http.get("/openapi.json").json()["paths"]
    sid = http.post("/v1/sessions").json()["id"]
    for template, ops in paths.items():
        url = template.replace("{session_id}", sid)
        # methods some route serves at this URL (GET /v1/sessions/import is a session's GET)
        served = {
            m.upper()
            for other, other_ops in paths.items()
            if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", other), url)
            for m in other_ops
        }
        for method in sorted({"OPTIONS", "PUT", "PATCH", "DELETE", "POST", "GET"} - served):
            r = http.request(method, url)
            assert r.status_code == 405, (method, url, r.status_code, r.text)
            assert r.headers["allow"] == ", ".join(sorted(m.upper() for m in ops)), (method, url)
            assert r.json()["error"]["type"] == "method_not_allowed"
    # a literal path's own methods, not those of the template it also matches
    assert http.options("/v1/sessions/import").headers["allow"] == "POST"


@pytest.mark.parametrize("body", [b"\xff\xfe{", b"{not json", b"\x00", b""])
def test_a_body_that_is_not_json_is_422(http: httpx.Client, body: bytes):
    r = http.post("/v1/sessions/x/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, (body, r.status_code, r.text)
    assert r.json()["error"]["type"] == "invalid_request"


def test_integers_may_be_written_with_a_zero_fraction(http: httpx.Client):
    """JSON Schema's `integer` is any number without a fractional part: 1938.0 is one."""
    r = http.post("/v1/sessions", json={"ttl_seconds": 1938.0, "prompt": [65.0, 66]})
    assert r.status_code == 201, r.text
    assert r.json()["n_tokens"] == 3  # BOS, then the two ids
    sid = r.json()["id"]
    r = http.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2.0, "seed": 3.0, "stream": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for bad in ({"ttl_seconds": 1938.5}, {"prompt": [65.5]}, {"ttl_seconds": True}, {"ttl_seconds": "1938"}):
        r = http.post("/v1/sessions", json=bad)
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", (bad, r.text)


def test_if_match_takes_exactly_the_forms_its_pattern_documents(http: httpx.Client):
    spec = http.get("/openapi.json").json()
    params = spec["paths"]["/v1/sessions/{session_id}/fork"]["post"]["parameters"]
    (doc,) = [p for p in params if p["name"] == "If-Match"]
    assert doc["schema"] == {**doc["schema"], "type": "string", "pattern": IF_MATCH}
    sid = http.post("/v1/sessions").json()["id"]
    for good in ['"0"', 'W/"0"', "0", "*", "000"]:
        assert re.fullmatch(IF_MATCH, good)
        r = http.post(f"/v1/sessions/{sid}/fork", headers={"If-Match": good})
        assert r.status_code == 201, (good, r.text)
    for bad in ["null", "", '"0', "W/0", "0x", "-1", '"1" "2"', "1" * 19]:
        assert not re.fullmatch(IF_MATCH, bad)
        r = http.post(f"/v1/sessions/{sid}/fork", headers={"If-Match": bad})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", (bad, r.text)
    r = http.post(f"/v1/sessions/{sid}/fork", headers={"If-Match": '"7"'})
    assert r.status_code == 412 and r.json()["error"]["type"] == "version_mismatch"


def test_the_document_declares_the_key_only_where_one_is_asked(http: httpx.Client, contract_server):
    spec = http.get("/openapi.json").json()
    assert set(spec["components"]["securitySchemes"]) == {"bearer", "access_token"}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            secured = "security" in op
            r = httpx.request(method.upper(), contract_server.url + path.replace("{session_id}", "0" * 32))
            assert (r.status_code == 401) == secured, (method, path, r.status_code)
            assert ("401" in op["responses"]) == secured, (method, path)


@given(maximum=st.integers(0, 10**7), data=st.data())
def test_a_range_pattern_matches_exactly_the_numbers_up_to_its_maximum(maximum: int, data):
    """The pattern a string-held bound gets (logit_bias's keys: token ids of the vocabulary)."""
    pattern = re.compile(f"^({range_pattern(maximum)})$")
    n = data.draw(st.integers(0, 2 * maximum + 10))
    assert bool(pattern.match(str(n))) == (n <= maximum)
    assert not pattern.match("0" + str(n)) and not pattern.match(f"-{n}") and not pattern.match(f"{n} ")
