"""What a client sees when the server has a bug: a JSON 500 naming the request, never a
traceback. Served by uvicorn over real HTTP (the route needs neither the model nor Redis)."""

from __future__ import annotations

import httpx

from app.api import create_app
from app.config import Settings
from tests.conftest import serve_in_process


def test_an_unexpected_error_is_a_json_500_that_names_the_request():
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0"))

    @app.get("/boom")
    def boom() -> None:  # a bug in a route: an exception nothing maps to an error type
        raise RuntimeError("secret internals /etc/passwd")

    with serve_in_process(app) as url:
        r = httpx.get(f"{url}/boom", headers={"X-Request-Id": "trace-123"}, timeout=10)
        assert r.status_code == 500
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-request-id"] == "trace-123"  # to find its lines in the server log
        error = r.json()["error"]
        assert error["type"] == "internal_error"
        assert "RuntimeError" in error["message"] and "trace-123" in error["message"]
        assert "secret internals" not in r.text and "Traceback" not in r.text
        # without an id from the client, the server's own is given back the same way
        r = httpx.get(f"{url}/boom", timeout=10)
        assert r.status_code == 500 and r.headers["x-request-id"] in r.json()["error"]["message"]
