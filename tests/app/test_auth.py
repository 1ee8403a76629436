"""API keys and tenants over real HTTP: keys from RECUR_API_KEYS and a key file, 401
without a valid key, and another tenant's sessions answered with 404 on every route."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from pydantic import SecretStr

from app.config import Settings
from tests.conftest import ROOT, ServerProcess

A, B, C = "key-a-0123456789", "key-b-abcdefghij", "key-c-from-the-file"


@pytest.fixture(scope="module")
def server(tiny_model_dir, redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    keyfile = tmp_path_factory.mktemp("keys") / "api-keys"
    keyfile.write_text(f"# tenants\n{C}\n\n")
    srv = ServerProcess(
        tiny_model_dir,
        tmp_path_factory.mktemp("server"),
        redis_url,
        cpu_threads=1,
        api_keys=f"{A}, {B}",
        api_keys_file=keyfile,
        metrics_access="api_key",
    )
    srv.start()
    yield srv
    srv.stop()


def client(server: ServerProcess, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return server.client(headers=headers)


def unauthorized(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "unauthorized"
    assert r.headers["www-authenticate"].startswith("Bearer")


def test_every_v1_route_needs_a_valid_key(server):
    sid = "0" * 32
    routes = [
        ("POST", "/v1/sessions", {}),
        ("GET", f"/v1/sessions/{sid}", None),
        ("DELETE", f"/v1/sessions/{sid}", None),
        ("POST", f"/v1/sessions/{sid}/fork", None),
        ("POST", f"/v1/sessions/{sid}/score", {"prompt": "x"}),
        ("POST", f"/v1/sessions/{sid}/generate", {}),
        ("GET", f"/v1/sessions/{sid}/generate", None),
        ("POST", "/v1/completions", {"prompt": "x"}),
        ("GET", "/v1/models", None),
    ]
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {A}"},
        {"Authorization": A},
    ):
        with server.client(headers=headers) as c:
            for method, path, body in routes:
                unauthorized(c.request(method, path, json=body))
    # a bad key is refused before the body is even looked at
    with server.client() as c:
        unauthorized(c.post("/v1/sessions", content=b"not json"))
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
        unauthorized(c.get("/metrics"))  # metrics_access=api_key
    with client(server, C) as c:  # a key from the file
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 200


def test_a_session_belongs_to_the_key_that_created_it(a, b, redis_url, server):
    s = a.post("/v1/sessions", json={"prompt": "secret"}).json()
    sid = s["id"]
    # every route, for the other tenant: 404, exactly as for a session that does not exist
    missing = "f" * 32
    for target in (sid, missing):
        answers = [
            b.get(f"/v1/sessions/{target}"),
            b.delete(f"/v1/sessions/{target}"),
            b.post(f"/v1/sessions/{target}/fork"),
            b.post(f"/v1/sessions/{target}/score", json={"prompt": "x"}),
            b.post(f"/v1/sessions/{target}/score", json={"prompt": "x", "commit": True}),
            b.post(f"/v1/sessions/{target}/generate", json={"max_tokens": 2, "stream": False}),
            b.post(f"/v1/sessions/{target}/generate", json={"max_tokens": 2}),
            b.get(f"/v1/sessions/{target}/generate", params={"max_tokens": 2}),
            b.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "session_id": target}),
            b.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Session-Id": target}
            ),
        ]
        for r in answers:
            assert r.status_code == 404, (r.request.method, r.request.url, r.text)
            assert r.json()["error"]["type"] == "session_not_found"
            assert target in r.json()["error"]["message"]
    # untouched: the owner sees version 0 and can do everything
    assert a.get(f"/v1/sessions/{sid}").json()["version"] == 0
    r = a.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, "stream": False})
    assert r.status_code == 200 and r.json()["session"]["version"] == 1
    fork = a.post(f"/v1/sessions/{sid}/fork").json()["id"]
    assert b.get(f"/v1/sessions/{fork}").status_code == 404  # a fork belongs to its creator
    r = a.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "session_id": fork})
    assert r.status_code == 200 and r.json()["session"]["version"] == 1
    assert a.delete(f"/v1/sessions/{fork}").status_code == 204

    # Redis holds a hash of the key, never the key itself
    store = redis.Redis.from_url(redis_url)
    key = f"{server.settings['key_prefix']}session:{{{sid}}}"
    fields = store.hgetall(key)
    assert fields[b"owner"].decode() == "sha256:" + hashlib.sha256(A.encode()).hexdigest()
    for k in (A, B, C):
        assert not any(k.encode() in v for v in fields.values())


def test_the_openai_sdk_sends_its_key(server):
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=B, max_retries=0)
    c = ok.completions.create(model="tiny", prompt="hi", max_tokens=2, seed=1)
    assert c.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.type == "unauthorized"
    # another tenant's session, through the SDK: NotFoundError
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=A, max_retries=0).completions.create(
            model="tiny",
            prompt="x",
            max_tokens=1,
            extra_body={"session_id": c.session_id},  # type: ignore[attr-defined]
        )


def test_eventsource_can_pass_the_key_in_the_query(server, a):
    sid = a.post("/v1/sessions").json()["id"]
    with server.client() as anon:
        r = anon.get(f"/v1/sessions/{sid}/generate", params={"max_tokens": 2, "access_token": A})
        assert r.status_code == 200 and "event: done" in r.text
        r = anon.get(f"/v1/sessions/{sid}/generate", params={"max_tokens": 2, "access_token": B})
        assert r.status_code == 404
    # the access log never shows the query string
    assert A not in server.log.read_text()


def test_a_key_file_without_keys_refuses_to_start(tmp_path: Path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# no keys here\n\n")
    r = subprocess.run(
        [sys.executable, "-m", "app", "--model", str(tmp_path / "none"), "--api-keys-file", str(keyfile)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 2 and "holds no keys" in r.stderr and "Traceback" not in r.stderr
    # (an unset /v1 would be open: an empty or unreadable file is refused, never ignored)
    with pytest.raises(ValueError, match="cannot read the API key file"):
        Settings(api_keys_file=tmp_path / "missing").load_api_keys()
    both = Settings(api_keys=SecretStr(" k1 ,k2,"), api_keys_file=keyfile.with_name("k"))
    keyfile.with_name("k").write_text("k3\n# k4\n k5 \n")
    assert both.load_api_keys() == ["k1", "k2", "k3", "k5"]
    assert Settings().load_api_keys() == []


def test_chat_sends_the_key_from_its_key_file(server, a, tmp_path: Path):
    sid = a.post("/v1/sessions", json={"prompt": "hi"}).json()["id"]
    keyfile = tmp_path / "key"

    def chat(key: str) -> subprocess.CompletedProcess:
        keyfile.write_text(key + "\n")
        return subprocess.run(
            [sys.executable, "-m", "app.chat", sid, "--url", server.url, "--api-key-file", str(keyfile)],
            input="/info\n",
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        )

    r = chat(A)
    assert r.returncode == 0 and f"[session {sid} · version 0 · 3 tokens]" in r.stdout, r.stdout + r.stderr
    r = chat(B)  # another tenant: the session does not exist for it
    assert r.returncode == 1 and "session_not_found" in r.stderr
