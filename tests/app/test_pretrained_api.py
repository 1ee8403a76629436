"""A converted pretrained-layout Transformer-XL served through every session route (issue 9).

The checkpoint is a tiny random HF `TransfoXLLMHeadModel` written by transformers 4.37.2
(tests/model/hf_reference.py, in the isolated reference environment), converted with
`recur convert --tgt-len 8` and served by the real server over real HTTP. Scoring over
the API must match the reference evaluation: segments of tgt_len tokens from the start
of each request, memory carried between requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from app.cli import main as recur_cli
from tests.conftest import ServerProcess
from tests.model.test_hf_parity import TGT_LEN, make_reference

from .sse_client import generate

TOL = 1e-4
SETTINGS = {"max_tokens": 100, "max_prompt_tokens": 100, "cpu_threads": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("pretrained")
    src = make_reference(out, {"segment": dict(untie_r=False, pre_lnorm=True)})["segment"]
    assert recur_cli(["convert", str(src), str(out / "native"), "--tgt-len", str(TGT_LEN)]) == 0
    return {"hf": src, "native": out / "native"}


def _serve(model_dir: Path, workdir: Path, redis_url: str) -> Iterator[httpx.Client]:
    srv = ServerProcess(model_dir, workdir, redis_url, **SETTINGS).start()
    try:
        with srv.client() as client:
            yield client
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(checkpoints, redis_url, tmp_path_factory) -> Iterator[httpx.Client]:
    yield from _serve(checkpoints["native"], tmp_path_factory.mktemp("server"), redis_url)


def _reference_scores(src: Path) -> tuple[list[int], list[float]]:
    """Stream 0 of the reference run: its ids and log p(id t | ids < t) for t >= 1."""
    ref = load_file(str(src / "reference.safetensors"))
    ids, lp = ref["input_ids"][0], ref["logprobs"][0]
    return ids.tolist(), lp[:-1].gather(1, ids[1:, None])[:, 0].tolist()


def _create(http: httpx.Client, prompt: str | list[int] = "") -> dict:
    r = http.post("/v1/sessions", json={"prompt": prompt})
    assert r.status_code == 201, r.text
    return r.json()


def _score_by_segment(http: httpx.Client, sid: str, ids: list[int]) -> list[float | None]:
    """`ids` scored into session `sid` one committed request per tgt_len segment: each
    token's log-prob."""
    got: list[float | None] = []
    for start in range(0, len(ids), TGT_LEN):
        r = http.post(
            f"/v1/sessions/{sid}/score", json={"prompt": ids[start : start + TGT_LEN], "commit": True}
        )
        assert r.status_code == 200, r.text
        got += [t["logprob"] for t in r.json()["tokens"]]
    return got


def test_score_matches_reference_segmentation(http, checkpoints):
    ids, want = _reference_scores(checkpoints["hf"])
    s = _create(http)
    assert s["n_tokens"] == 0  # a word vocabulary has no BOS
    # one request: cut into tgt_len segments from its start, as the reference evaluation
    r = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": ids})
    assert r.status_code == 200, r.text
    got = [t["logprob"] for t in r.json()["tokens"]]
    assert got[0] is None
    assert max(abs(a - b) for a, b in zip(got[1:], want, strict=True)) <= TOL
    # one committed request per segment: the memory is carried through Redis between them
    parts = _score_by_segment(http, s["id"], ids)
    assert max(abs(a - b) for a, b in zip(parts[1:], want, strict=True)) <= TOL
    detail = http.get(f"/v1/sessions/{s['id']}").json()
    assert detail["n_tokens"] == len(ids) and detail["version"] == len(ids) // TGT_LEN


def test_word_prompts_get_and_delete(http):
    s = _create(http, "w5 w7 unknown-word\n w9")
    assert s["n_tokens"] == 5  # w5 w7 <unk> <eos> w9
    r = http.get(f"/v1/sessions/{s['id']}")
    assert r.status_code == 200 and r.json()["state_bytes"] > 0
    r = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "w3\nw4"})
    assert [(t["id"], t["text"]) for t in r.json()["tokens"]] == [(3, " w3"), (0, "\n"), (4, " w4")]
    assert http.delete(f"/v1/sessions/{s['id']}").status_code == 204
    assert http.get(f"/v1/sessions/{s['id']}").status_code == 404


def test_generate_stream_and_not_and_fork(http):
    s = _create(http, "w11 w12 w13 w14 w15 w16 w17 w18 w19 w20")
    r = http.post(f"/v1/sessions/{s['id']}/fork")
    assert r.status_code == 201, r.text
    twin = r.json()
    body = {"prompt": "w21 w22", "max_tokens": 12, "temperature": 0}
    tokens, event, done = generate(http, s["id"], **body)
    assert event == "done", done
    r = http.post(f"/v1/sessions/{twin['id']}/generate", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    result = r.json()
    # the fork is independent and identical: greedy decoding gives the same words
    assert [t["id"] for t in result["tokens"]] == [t["id"] for t in tokens]
    assert result["text"] == done["text"] == "".join(t["text"] for t in tokens)
    assert all(t["text"] == "\n" or t["text"].startswith(" w") or t["text"] == " <unk>" for t in tokens)
    assert done["finish_reason"] == ("eos" if tokens[-1]["id"] == 0 else "length")
    assert done["usage"] == {"prompt_tokens": 2, "completion_tokens": len(tokens)}
    assert done["session"]["n_tokens"] == result["session"]["n_tokens"] == 10 + 2 + len(tokens)


def test_serve_takes_the_hf_directory_directly(checkpoints, redis_url, tmp_path):
    """`recur serve --model HF_DIR`: tgt_len defaults to 128, so requests of tgt_len=8
    tokens are one segment each and the scores are the reference's again."""
    ids, want = _reference_scores(checkpoints["hf"])
    for client in _serve(checkpoints["hf"], tmp_path / "server-hf", redis_url):
        got = _score_by_segment(client, _create(client)["id"], ids)
        assert max(abs(a - b) for a, b in zip(got[1:], want, strict=True)) <= TOL
