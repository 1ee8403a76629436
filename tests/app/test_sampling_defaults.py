"""A checkpoint's recommended sampling reaches every route that generates (issue 44): a
request that leaves a control out gets the checkpoint's value, one that sends it gets its
own, and `GET /v1/models` shows them. The served tiny model recommends greedy decoding and
replies of at most 7 tokens, so the effect is exact: a request without a temperature gives
the greedy text whatever its seed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model import generation_config
from model.chat_template import play_script
from model.generation_config import GenerationConfig
from tests.app.servers import serve
from tests.conftest import TINY, ServerProcess
from tests.sensitive import write_sensitive

RECOMMENDED = GenerationConfig(temperature=0.0, max_tokens=7)


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("recommending") / "tiny"
    write_sensitive(path, seed=0, chat_template=play_script(), **TINY)
    generation_config.write(path, RECOMMENDED)
    yield from serve(path, redis_url, tmp_path_factory, max_tokens=200)


def test_models_shows_the_recommendation(server):
    card = server.openai().models.list().data[0].model_dump()
    assert card["sampling_defaults"]["temperature"] == 0.0
    assert card["sampling_defaults"]["max_tokens"] == 7
    assert card["sampling_defaults"]["top_p"] is None
    assert card["sampling_defaults"]["source"].endswith("generation_config.json")


def test_completions_take_the_recommendation_for_what_they_leave_out(server):
    oa = server.openai()
    greedy = oa.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0)
    for seed in (1, 2, 3):
        left_out = oa.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, seed=seed)
        assert left_out.choices[0].text == greedy.choices[0].text
    sampled = {oa.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, seed=s, temperature=1.0)
               .choices[0].text for s in (1, 2, 3)}  # fmt: skip
    assert len(sampled) > 1  # a temperature sent is the request's own
    # no max_tokens: the recommended 7 (the legacy completions route's own default is 16)
    bounded = oa.chat.completions.create(  # (min_tokens: the turn's stop cannot end it sooner)
        model="tiny", messages=[{"role": "user", "content": "Speak."}], extra_body={"min_tokens": 50}
    )
    assert bounded.usage.completion_tokens == 7


def test_the_session_route_and_responses_take_it_too(server):
    with server.client() as c:
        sid = c.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
        fork = c.post(f"/v1/sessions/{sid}/fork").json()["id"]
        a = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 10, "stream": False, "seed": 5}).json()
        b = c.post(f"/v1/sessions/{fork}/generate", json={"max_tokens": 10, "stream": False, "temperature": 0})
        assert a["text"] == b.json()["text"]
    oa = server.openai()
    r = oa.responses.create(input="Good morrow.", store=False, extra_body={"min_tokens": 50})  # bound: 7
    assert r.usage.output_tokens == 7
