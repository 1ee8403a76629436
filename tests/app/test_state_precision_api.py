"""`--state-dtype int8` over real HTTP, for a LLaMA-architecture model whose state matters:
the server passes the setting to the model and never learns the family; a text scored in
one request or in many, cut across the sinks and the sliding window, gives the same
log-probs and greedy tokens; the stored state is the compact int8 form; an import is
checked against it, and a float32 state imported is converted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import model
from model.state import peek
from tests.app.boundaries import assert_scored_alike, create
from tests.app.servers import serve
from tests.conftest import ServerProcess
from tests.sensitive import write_sensitive

CONFIG = dict(
    n_layer=2, d_model=64, n_head=4, n_kv_head=2, head_dim=32, d_ff=96, sinks=2, window=10, tgt_len=8
)  # fmt: skip
TEXT = b"Now is the winter of our discontent made glorious summer by this sun of York."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-int8") / "m"
    write_sensitive(path, family="llama", seed=5, **CONFIG)
    return path


@pytest.fixture(scope="module")
def server(
    checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from serve(checkpoint, redis_url, tmp_path_factory, state_dtype="int8", max_tokens=50)


def payload(blob: bytes) -> int:
    """A blob's bytes past its headers (a tiny state's headers are as large as its tensors)."""
    return len(blob) - 8 - int.from_bytes(blob[:8], "little")


def exported(http: httpx.Client, sid: str) -> bytes:
    r = http.get(f"/v1/sessions/{sid}/state")
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.parametrize("cuts", [[1], [5, 6, 7, 14], [11, 12, 13, 30, 31], list(range(3, 70, 9))])
def test_int8_scores_are_the_same_in_one_request_or_many(http, cuts):
    ids = list(TEXT)
    assert len(ids) > 4 * (CONFIG["sinks"] + CONFIG["window"])
    assert_scored_alike(http, ids, cuts, max_tokens=12, from_token=1)


def test_the_stored_state_is_int8_and_a_quarter_of_float32(http, checkpoint):
    sid = create(http, prompt=TEXT.decode())["id"]
    blob = exported(http, sid)
    declared = peek(blob)
    assert declared.header["precision"] == "int8"
    assert declared.tensors["k"][0] == declared.tensors["k.exp"][0] == "I8"
    lm = model.load(checkpoint, device="cpu")  # float32 states, as a server by default keeps them
    _, state = lm.consume(list(TEXT), lm.new_state(1))
    assert payload(blob) <= 0.3 * payload(state.to_bytes())


def test_an_import_is_verified_and_a_float32_state_converted(http, checkpoint):
    lm = model.load(checkpoint, device="cpu")
    _, state = lm.consume(list(TEXT), lm.new_state(1))
    params = {"ttl_seconds": 600}
    headers = {"Content-Type": "application/octet-stream"}
    r = http.post("/v1/sessions/import", content=state.to_bytes(), params=params, headers=headers)
    assert r.status_code == 201, r.text
    assert peek(exported(http, r.json()["id"])).header["precision"] == "int8"
    # an int8 state whose exponents went missing: refused, naming what is wrong
    good = exported(http, r.json()["id"])
    n = int.from_bytes(good[:8], "little")
    outer = json.loads(good[8 : 8 + n])
    recur = json.loads(outer["__metadata__"]["recur"])
    recur["precision"] = "bfloat16"
    outer["__metadata__"]["recur"] = json.dumps(recur)
    head = json.dumps(outer).encode()
    head += b" " * (-len(head) % 8)
    lie = len(head).to_bytes(8, "little") + head + good[8 + n :]
    r = http.post("/v1/sessions/import", content=lie, params=params, headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_state"
