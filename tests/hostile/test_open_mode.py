"""Open mode is safe on a laptop (issue 25, attack 10).

Without keys (`make run`, the compose default), any `Host` header was accepted and import
took `text/plain`: a web page could reach the server through DNS rebinding, or post to it
cross-site. Now the Host must be one the server answers to (`allowed_hosts`, localhost by
default); a request that changes state is refused when its Origin names another site, or
when its body is of a type any page may send cross-site (text/plain, a form); and a server
without keys says so in its log when it starts, as the image and compose file say in words.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from .conftest import assert_error
from .states import full_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "10.0.0.7", "rebind.attacker.test:80"])
def test_a_host_the_server_does_not_answer_to_is_refused(http, host):
    for method, path in (("GET", "/v1/sessions"), ("POST", "/v1/sessions"), ("GET", "/healthz")):
        r = http.request(method, path, headers={"Host": host})
        assert_error(r, 403, "forbidden")


def test_its_own_names_are_answered(http, server):
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        assert http.get("/healthz", headers={"Host": host}).status_code == 200


def test_simple_cross_site_requests_change_nothing(http, server, hostile_models):
    """What a page on another site can send without a CORS preflight: a form or text/plain
    body, or a body-less POST that carries the page's Origin."""
    made = http.post("/v1/sessions", json={"prompt": "x"}).json()["id"]
    own = f"http://127.0.0.1:{server.port}"
    before = http.get("/v1/usage").json()["sessions"]
    blob = full_state(hostile_models["txl"])[1].to_bytes()
    attempts = [
        ("POST", "/v1/sessions/import", {"Content-Type": "text/plain"}, blob, 422),
        (
            "POST",
            f"/v1/sessions/{made}/fork",
            {"Content-Type": "application/x-www-form-urlencoded"},
            b"",
            422,
        ),
        ("POST", "/v1/sessions", {"Content-Type": "multipart/form-data; boundary=x"}, b"--x--\r\n", 422),
        ("POST", f"/v1/sessions/{made}/fork", {"Origin": "http://evil.example"}, b"", 403),
        ("POST", "/v1/sessions", {"Origin": "null", "Content-Type": "application/json"}, b"{}", 403),
        ("DELETE", f"/v1/sessions/{made}", {"Origin": "https://evil.example:8443"}, b"", 403),
    ]
    for method, path, headers, body, status in attempts:
        r = http.request(method, path, headers=headers, content=body)
        assert_error(r, status)
    assert http.get("/v1/usage").json()["sessions"] == before
    assert http.get(f"/v1/sessions/{made}").status_code == 200
    # the server's own pages (the playground) send their Origin: answered
    r = http.post(f"/v1/sessions/{made}/fork", headers={"Origin": own})
    assert r.status_code == 201, r.text
    # and reads from another site pass (a page cannot read their answers without CORS)
    assert http.get(f"/v1/sessions/{made}", headers={"Origin": "http://evil.example"}).status_code == 200


def test_the_get_form_of_generate_commits_nothing_from_another_site(http, server):
    """EventSource can only GET, so `GET .../generate` streams and commits: a page on another
    site could make a visitor's browser run it (issue 39). Refused when the browser says the
    request is cross-site (its Origin, or Sec-Fetch-Site); the server's own page is served."""
    sid = http.post("/v1/sessions", json={"prompt": "Hello"}).json()["id"]
    path = f"/v1/sessions/{sid}/generate?prompt=x&max_tokens=2"
    for headers in (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"},
    ):
        assert_error(http.get(path, headers=headers), 403, "forbidden")
    assert http.get(f"/v1/sessions/{sid}").json()["version"] == 0
    own = {"Origin": f"http://127.0.0.1:{server.port}", "Sec-Fetch-Site": "same-origin"}
    for headers in (own, {}):  # its own page, and a client that is not a browser
        r = http.get(path, headers=headers)
        assert r.status_code == 200 and "event: done" in r.text, r.text[:300]
    assert http.get(f"/v1/sessions/{sid}").json()["version"] == 2


def test_a_server_without_keys_says_so(server):
    assert "no API keys are set" in server.log.read_text()
    assert "WITHOUT API KEYS THIS IMAGE SERVES /v1 TO ANYONE" in (ROOT / "Dockerfile").read_text()
    assert "NO API KEYS HERE: /v1 IS OPEN" in (ROOT / "docker" / "compose.yaml").read_text()


def test_the_default_allows_only_localhost():
    from app.config import Settings

    assert Settings().allowed_hosts == "localhost,127.0.0.1,::1"
    assert Settings().host == "127.0.0.1"


def test_metrics_can_require_a_key(tenants):
    """`/metrics` may be kept to key holders (metrics_access=api_key); the docs say how."""
    from app.config import Settings

    assert "api_key" in Settings.model_fields["metrics_access"].description
    assert "RECUR_METRICS_ACCESS=api_key" in (ROOT / "docs" / "DEPLOY.md").read_text()
    assert httpx.get(tenants.url + "/metrics").status_code == 200  # (open: this server's setting)
