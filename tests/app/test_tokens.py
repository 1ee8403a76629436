"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes, over real HTTP: the ids are the
ones a session's state consumes, and the text comes back from them."""

from __future__ import annotations


def test_tokenize_gives_the_ids_a_session_consumes(http):
    r = http.post("/tokenize", json={"prompt": "ROMEO: é"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"][0] == 256  # BOS, as a new session's state starts
    assert body["tokens"][1:] == list("ROMEO: é".encode())
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 300
    # a session created with the same prompt has consumed exactly as many tokens
    s = http.post("/v1/sessions", json={"prompt": "ROMEO: é"}).json()
    assert s["n_tokens"] == body["count"]
    bare = http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()
    assert bare["tokens"] == [97, 98]


def test_detokenize_returns_the_text(http):
    ids = list(b"To be, or not")
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "To be, or not"}


def test_bad_requests_get_the_error_body(http):
    for path, body, etype in [
        ("/detokenize", {"tokens": [99999]}, "invalid_request"),
        ("/detokenize", {"tokens": [-1]}, "invalid_request"),
        ("/tokenize", {"prompt": 3}, "invalid_request"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model_not_found"),
    ]:
        r = http.post(path, json=body)
        assert r.status_code in (404, 422) and r.json()["error"]["type"] == etype, (path, r.text)
