"""State export and import over real HTTP, and listing a key's own sessions: an exported
state is the state format itself, an import verifies every byte of it (never unpickling
anything), and a round trip continues exactly as the original would."""

from __future__ import annotations

import httpx
import pytest

import model
from tests.conftest import TINY
from tests.sensitive import write_sensitive

A, B = "key-export-a", "key-export-b"
SERVER_SETTINGS = {"api_keys": f"{A},{B}", "max_import_mb": 0.02}  # 20 KiB: a few tiny states


def create(c: httpx.Client, prompt: str = "ROMEO:") -> dict:
    r = c.post("/v1/sessions", json={"prompt": prompt})
    assert r.status_code == 201, r.text
    return r.json()


def greedy(c: httpx.Client, sid: str, n: int = 12) -> dict:
    r = c.post(
        f"/v1/sessions/{sid}/generate",
        json={"stream": False, "max_tokens": n, "temperature": 0, "logprobs": True},
    )
    assert r.status_code == 200, r.text
    return r.json()


def import_state(c: httpx.Client, blob: bytes, **params) -> httpx.Response:
    return c.post(
        "/v1/sessions/import",
        content=blob,
        params=params,
        headers={"Content-Type": "application/octet-stream"},
    )


def invalid_state(r: httpx.Response, words: str) -> None:
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_state"
    assert words in r.json()["error"]["message"]


def test_export_delete_import_continues_as_the_original(a):
    s = create(a)
    greedy(a, s["id"], 20)  # some history, committed as a delta
    twin = a.post(f"/v1/sessions/{s['id']}/fork").json()  # continues as the original would
    r = a.get(f"/v1/sessions/{s['id']}/state")
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert r.headers["etag"] == '"1"'
    blob = r.content
    assert a.delete(f"/v1/sessions/{s['id']}").status_code == 204
    r = import_state(a, blob, ttl_seconds=600)
    assert r.status_code == 201, r.text
    back = r.json()
    assert back["id"] != s["id"] and back["version"] == 0 and back["n_tokens"] == twin["n_tokens"]
    want, got = greedy(a, twin["id"]), greedy(a, back["id"])
    assert [t["id"] for t in got["tokens"]] == [t["id"] for t in want["tokens"]]
    # (the imported state's caches are rebuilt from its bytes: equal to rounding)
    assert [t["logprob"] for t in got["tokens"]] == pytest.approx(
        [t["logprob"] for t in want["tokens"]], abs=1e-4
    )


def test_export_is_conditional_and_narrows_on_request(a):
    s = create(a)
    r = a.get(f"/v1/sessions/{s['id']}/state", headers={"If-Match": '"3"'})
    assert r.status_code == 412 and r.json()["error"]["type"] == "version_mismatch"
    full = a.get(f"/v1/sessions/{s['id']}/state").content
    half = a.get(f"/v1/sessions/{s['id']}/state", params={"dtype": "bfloat16"}).content
    assert len(half) < len(full)
    assert import_state(a, half).status_code == 201  # a bf16 state imports too
    r = a.get(f"/v1/sessions/{s['id']}/state", params={"dtype": "int8"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"


def test_bad_bytes_get_a_clear_4xx_and_create_nothing(a, tmp_path, tiny_model_dir):
    s = create(a)
    blob = a.get(f"/v1/sessions/{s['id']}/state").content
    before = a.get("/v1/usage").json()["sessions"]
    invalid_state(import_state(a, blob[: len(blob) // 2]), "cannot be imported")
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF  # inside the tensor payload
    invalid_state(import_state(a, bytes(flipped)), "checksum")
    invalid_state(import_state(a, b"\x80\x04\x95 a pickle, say"), "cannot be imported")
    # a state of another model: same family and shapes, other weights
    write_sensitive(tmp_path / "other", seed=1, **TINY)
    lm = model.load(tmp_path / "other", device="cpu")
    st = lm.new_state(1)
    _, st = lm.consume([lm.tokenizer.bos_id, 65], st)
    invalid_state(import_state(a, st.to_bytes()), "made by model")
    # the served model's own state, but of two streams: not a session's
    served = model.load(tiny_model_dir, device="cpu")
    _, two = served.consume([[served.tokenizer.bos_id, 65]] * 2, served.new_state(2))
    invalid_state(import_state(a, two.to_bytes()), "single-stream")
    r = import_state(a, b"x" * 30_000)  # past RECUR_MAX_IMPORT_MB
    assert r.status_code == 413 and r.json()["error"]["type"] == "body_too_large"
    assert a.get("/v1/usage").json()["sessions"] == before


def test_a_key_exports_lists_and_imports_only_its_own(a, b):
    mine = {create(a, f"a{i}")["id"] for i in range(5)}
    theirs = create(b)["id"]
    assert b.get(f"/v1/sessions/{next(iter(mine))}/state").status_code == 404
    seen: set[str] = set()
    cursor, pages = "0", 0
    while cursor is not None:
        page = a.get("/v1/sessions", params={"limit": 2, "cursor": cursor}).json()
        seen |= {s["id"] for s in page["sessions"]}
        cursor, pages = page["next_cursor"], pages + 1
        assert pages < 100
    assert mine <= seen and theirs not in seen
    listed_b = {s["id"] for s in b.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]}
    assert theirs in listed_b and not (mine & listed_b)
    # an import belongs to the key that imported it
    blob = a.get(f"/v1/sessions/{next(iter(mine))}/state").content
    imported = import_state(b, blob).json()["id"]
    assert a.get(f"/v1/sessions/{imported}").status_code == 404
    assert b.get(f"/v1/sessions/{imported}").status_code == 200
    # a deleted session leaves the listing
    gone = next(iter(mine))
    assert a.delete(f"/v1/sessions/{gone}").status_code == 204
    listed = {s["id"] for s in a.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]}
    assert gone not in listed
    for bad in ("x", "-1", str(2**64), "9" * 21):
        r = a.get("/v1/sessions", params={"cursor": bad})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", (bad, r.text)
