"""An RLT model served through the unchanged session server, over real HTTP (issue 5).

The server knows nothing of the family: the same routes must give RLT the invariants they
give Transformer-XL. The text is longer than the model's max_context and decoder window,
so the bounded caches slide across request boundaries.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import model
from model.replay import Rollout, replay
from model.sampling import SamplingParams
from tests.app.boundaries import assert_scored_alike, create
from tests.conftest import RLT_TINY, ServerProcess
from tests.sensitive import write_sensitive

SETTINGS = {"max_tokens": 100, "max_prompt_tokens": 400, "cpu_threads": 1}
TEXT = "Now is the winter of our discontent made glorious summer — ça va? — by this sun of York."


@pytest.fixture(scope="module")
def rlt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rlt") / "tiny-rlt"
    write_sensitive(path, family="rlt", seed=0, **RLT_TINY)
    return path


@pytest.fixture(scope="module")
def http(rlt_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    srv = ServerProcess(rlt_dir, tmp_path_factory.mktemp("rlt-server"), redis_url, **SETTINGS).start()
    try:
        with srv.client() as client:
            yield client
    finally:
        srv.stop()


@pytest.mark.parametrize("cuts", [[1], [5, 6, 7, 30], [16, 17, 33, 60, 61], list(range(3, 90, 11))])
def test_scores_are_the_same_in_one_request_or_many(http, cuts):
    ids = list(TEXT.encode())
    assert len(ids) > 4 * RLT_TINY["max_context"]
    for sid in assert_scored_alike(http, ids, cuts, max_tokens=20)[:2]:
        http.delete(f"/v1/sessions/{sid}")


def test_state_stays_bounded_as_the_session_grows(http):
    s = create(http)
    sizes = []
    for _ in range(4):
        r = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": TEXT[:40], "commit": True})
        assert r.status_code == 200
        sizes.append(http.get(f"/v1/sessions/{s['id']}").json()["state_bytes"])
    assert sizes[-1] == sizes[-2]  # past max_context the state stops growing


def test_generate_logprobs_are_the_replay_behaviour_logprobs(http, rlt_dir):
    """Sampled tokens and their `logprob`s from the endpoint replay to ratio 1 locally."""
    prompt = "Now is the winter"
    s = create(http, prompt=prompt)
    body = {"stream": False, "max_tokens": 30, "temperature": 0.8, "top_k": 40, "seed": 7, "logprobs": True}
    d = http.post(f"/v1/sessions/{s['id']}/generate", json=body).json()
    lm = model.load(rlt_dir, device="cpu")
    bos = [lm.tokenizer.bos_id] if lm.tokenizer.bos_id is not None else []
    rollout = Rollout(
        prompt=bos + lm.tokenizer.encode(prompt),
        response=[t["id"] for t in d["tokens"]],
        behaviour_logprobs=[t["logprob"] for t in d["tokens"]],
    )
    assert len(rollout.response) == d["usage"]["completion_tokens"] and rollout.response
    ratios = replay(lm, rollout, SamplingParams(temperature=0.8, top_k=40)).ratios
    assert all(r is not None and abs(r - 1) <= 1e-5 for r in ratios), ratios
