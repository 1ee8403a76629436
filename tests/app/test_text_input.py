"""Text that is not text (issue 39, item 6): JSON may escape one half of a UTF-16 surrogate
pair alone (`"\\ud800"`), which Python reads as a string no UTF-8 encoder takes; every
route that tokenizes text answered `500 internal_error`, for every family. Such a string
is now refused at validation, `422` with the error body, on every route that takes text;
a surrogate pair escaped whole (an emoji) is text, and served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.app.servers import serve
from tests.conftest import ServerProcess, tiny_model_of

LONE = "a\ud800b"  # sent escaped: json.dumps writes "a\ud800b"
PAIR = "smile \U0001f600"  # escaped as the pair "\ud83d\ude00"


@pytest.fixture(scope="module", params=["transformer-xl", "rlt", "llama-gguf"])
def server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tiny_gguf: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    path = (
        tiny_gguf
        if request.param == "llama-gguf"
        else tiny_model_of(request.param, tiny_model_dir, tmp_path_factory)
    )
    yield from serve(path, redis_url, tmp_path_factory, max_tokens=4, max_prompt_tokens=300)


def post(c: httpx.Client, path: str, body: dict) -> httpx.Response:
    # ensure_ascii escapes the lone surrogate as JSON allows; a UTF-8 encoder could not write it
    return c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def bodies(sid: str, conv: str, text: str) -> list[tuple[str, dict]]:
    chat = [{"role": "user", "content": text}]
    return [
        ("/v1/sessions", {"prompt": text}),
        (f"/v1/sessions/{sid}/score", {"prompt": text}),
        (f"/v1/sessions/{sid}/generate", {"prompt": text, "stream": False, "max_tokens": 2}),
        (f"/v1/sessions/{sid}/generate", {"prompt": text, "max_tokens": 2}),
        (f"/v1/sessions/{sid}/generate", {"prompt": "x", "stop": [text], "max_tokens": 2}),
        ("/tokenize", {"prompt": text}),
        ("/v1/completions", {"model": "m", "prompt": text, "max_tokens": 2}),
        ("/v1/completions", {"model": "m", "prompt": [text], "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "m", "messages": chat, "max_tokens": 2}),
        ("/v1/responses", {"model": "m", "input": text, "max_output_tokens": 2}),
        ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": text}]}),
        (
            f"/v1/conversations/{conv}/items",
            {"items": [{"type": "message", "role": "user", "content": text}]},
        ),
    ]


def test_a_lone_surrogate_is_refused_on_every_route_that_takes_text(server: ServerProcess) -> None:
    with server.client() as c:
        sid = c.post("/v1/sessions", json={"prompt": "Hi"}).json()["id"]
        r = c.post("/v1/conversations", json={})  # (400 no_chat_template: a model without one)
        conv = r.json()["id"] if r.status_code == 200 else "conv_0"
        for path, body in bodies(sid, conv, LONE):
            r = post(c, path, body)
            error = r.json()["error"]
            if r.status_code == 400 and error["type"] == "no_chat_template":
                continue  # a chat route of a model that cannot chat says so first
            assert r.status_code == 422, (path, body, r.status_code, r.text[:300])
            assert error["type"] == "invalid_request" and "surrogate" in error["message"], (path, error)
        # a key is text too
        r = post(c, f"/v1/sessions/{sid}/generate", {"logit_bias": {LONE: 1}, "stream": False})
        assert r.status_code == 422, r.text[:300]
        # nothing was committed
        assert c.get(f"/v1/sessions/{sid}").json()["version"] == 0


def test_a_surrogate_pair_escaped_whole_is_text(server: ServerProcess) -> None:
    with server.client() as c:
        r = post(c, "/tokenize", {"prompt": PAIR})
        assert r.status_code == 200, r.text
        r = post(c, "/v1/sessions", {"prompt": PAIR})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = post(c, f"/v1/sessions/{sid}/generate", {"prompt": PAIR, "stream": False, "max_tokens": 2})
        assert r.status_code == 200, r.text
