"""Mamba and Mamba-2 served through the unchanged session server, over real HTTP (issue 29).

The server knows nothing of the family: every route must give a state-space model the
invariants it gives the others. Its state is one size from the first token on and changes
wholly at every token, so a commit writes it whole; requests in any chunking score alike
(the prompt crosses the serving chunk of 8 and SSD's chunks of 3); the history (versions,
a past version's export), fork, rollback, export and import continue exactly; SSE, the
OpenAI routes and the transcript's replay (ratio 1 within 1e-5) work unchanged. Prefix reuse is covered for both families in
test_prefix_reuse.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

import model
from app.replay_client import fetch_transcript
from model.chat_template import play_script
from model.replay import replay_transcript, transcript_rollout
from tests.app.boundaries import assert_scored_alike, create
from tests.app.servers import serve
from tests.app.session_walk import (
    assert_a_streamed_generation_is_the_generation,
    assert_history_fork_rollback_export_and_import_continue_exactly,
    assert_the_openai_routes_answer,
    ok,
)
from tests.conftest import SSM_TINY, ServerProcess
from tests.sensitive import write_sensitive

KEY = "key-ssm"
SETTINGS = {
    "api_keys": KEY,
    "precision": "fp32",
    "max_tokens": 100,
    "max_prompt_tokens": 400,
    "cpu_threads": 1,
}
TEXT = "Now is the winter of our discontent made glorious summer — ça va? — by this sun of York."


@pytest.fixture(scope="module", params=list(SSM_TINY))
def server(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A tiny model of each family in turn (with the play-script chat template), served."""
    path = tmp_path_factory.mktemp(request.param) / "tiny"
    write_sensitive(
        path, family=request.param, seed=0, chat_template=play_script(), **SSM_TINY[request.param]
    )
    yield from serve(path, redis_url, tmp_path_factory, **SETTINGS)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.mark.parametrize("cuts", [[1], [5, 6, 7, 30], list(range(3, 90, 11))])
def test_scores_are_the_same_in_one_request_or_many(http, cuts):
    assert_scored_alike(http, list(TEXT.encode()), cuts, max_tokens=20)


def test_the_state_is_one_size_from_the_first_token(http):
    s = create(http, prompt="N")
    sizes = {ok(http.get(f"/v1/sessions/{s['id']}"))["state_bytes"]}
    for _ in range(3):
        ok(http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": TEXT, "commit": True}))
        sizes.add(ok(http.get(f"/v1/sessions/{s['id']}"))["state_bytes"])
    assert max(sizes) - min(sizes) <= 16  # one size: only the header's token count grows digits
    # a past version exports whole, as large as the latest
    past = http.get(f"/v1/sessions/{s['id']}/state", params={"version": 1})
    assert past.status_code == 200 and len(past.content) == len(
        http.get(f"/v1/sessions/{s['id']}/state").content
    )


def test_a_streamed_generation_is_the_generation(http):
    assert_a_streamed_generation_is_the_generation(http)


def test_history_fork_rollback_export_and_import_continue_exactly(http):
    assert_history_fork_rollback_export_and_import_continue_exactly(http, "ROMEO:")


def test_the_openai_routes(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert_the_openai_routes_answer(oa)
    card = oa.models.list().data[0]
    assert (
        card.model_extra is not None
        and card.model_extra["family"] == model.load(server.model_dir, device="cpu").family
    )
    assert card.model_extra["context_window"] is None  # no attention window: not d_conv's few tokens


def test_the_transcript_replays_to_ratio_one(server, http):
    s = create(http, prompt="ROMEO:")
    turns = [
        {"prompt": " O", "max_tokens": 30, "temperature": 0.8, "top_k": 20, "seed": 1},
        {"prompt": "", "max_tokens": 30, "temperature": 1.2, "top_p": 0.9, "seed": 2},
        {"prompt": " thee", "max_tokens": 20, "temperature": 0.9, "repetition_penalty": 1.3, "seed": 3},
    ]
    sampled = 0
    for turn in turns:
        sampled += len(
            ok(http.post(f"/v1/sessions/{s['id']}/generate", json={"stream": False, **turn}))["tokens"]
        )
    ok(http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": TEXT, "commit": True}))
    tail = {"prompt": ",", "max_tokens": 20, "temperature": 1.0, "seed": 4}
    sampled += len(
        ok(http.post(f"/v1/sessions/{s['id']}/generate", json={"stream": False, **tail}))["tokens"]
    )
    rollout = transcript_rollout(fetch_transcript(server.url, s["id"], KEY))
    result = replay_transcript(model.load(server.model_dir, device="cpu", precision="fp32"), rollout)
    assert len(result.ratios) == sampled
    assert max(abs(r - 1) for r in result.ratios) <= 1e-5
