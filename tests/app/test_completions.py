"""The OpenAI-compatible routes, driven by the official `openai` SDK over real HTTP, for
both model families (the routes never know which one they serve)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

import model
from tests.conftest import ServerProcess

SERVER_SETTINGS = {"max_tokens": 1000}


@pytest.fixture(scope="module")
def server(server_of_each_family: ServerProcess) -> ServerProcess:
    return server_of_each_family


def _generate(http: httpx.Client, sid: str, **body: object) -> dict:
    r = http.post(f"/v1/sessions/{sid}/generate", json={"stream": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _session(http: httpx.Client, sid: str) -> dict:
    r = http.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(oa: openai.OpenAI, prompt: object, max_tokens: int, **more: object):
    """A greedy completion of the served model (or a stream of one, with stream=True)."""
    return oa.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, **more)  # type: ignore[call-overload]


def test_models_lists_the_served_model(oa, server):
    models = oa.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].object == "model"
    # the context facts, as the served checkpoint has them
    lm = model.load(server.model_dir, device="cpu")
    card = models.data[0].model_dump()
    assert (card["family"], card["vocab_size"], card["context_window"]) == (lm.family, 258, lm.context_window)


def test_completion_in_a_new_session(oa, http, server):
    raw = oa.completions.with_raw_response.create(
        model="tiny", prompt="ROMEO:", max_tokens=8, temperature=0, user="user-42"
    )
    c = raw.parse()
    assert c.object == "text_completion" and c.model == "tiny" and c.id.startswith("cmpl-")
    assert len(c.choices) == 1 and c.choices[0].index == 0
    assert c.choices[0].finish_reason == "length" and c.choices[0].logprobs is None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (6, 8, 14)
    sid = c.session_id  # type: ignore[attr-defined]
    assert raw.headers["x-session-id"] == sid and len(sid) == 32
    s = _session(http, sid)
    assert s["version"] == 1 and s["n_tokens"] == 1 + 6 + 8  # BOS, prompt, completion
    assert c.session == {"id": sid, "version": 1, "n_tokens": 15}  # type: ignore[attr-defined]
    # `user` is logged (with the session), not used
    logged = [json.loads(ln) for ln in server.log.read_text().splitlines() if '"openai_user"' in ln]
    assert [(x["openai_user"], x["session_id"]) for x in logged] == [("user-42", sid)]
    # the same as the session API: a fresh session, then one generate with the prompt
    fresh = http.post("/v1/sessions").json()["id"]
    assert _generate(http, fresh, prompt="ROMEO:", max_tokens=8, temperature=0)["text"] == c.choices[0].text


def test_streaming_chunks_usage_and_done(oa, http, server):
    stream = _greedy(oa, "ab", 10, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    *tokens, finish, usage = chunks
    assert len(tokens) == 10
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in tokens)
    assert finish.choices[0].text == "" and finish.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (2, 10)
    sid = finish.session_id  # type: ignore[attr-defined]
    assert finish.session["version"] == 1  # type: ignore[attr-defined]
    text = "".join(c.choices[0].text for c in tokens)
    fresh = http.post("/v1/sessions").json()["id"]
    assert _generate(http, fresh, prompt="ab", max_tokens=10, temperature=0)["text"] == text
    assert _session(http, sid)["n_tokens"] == 1 + 2 + 10

    # on the wire: data-only events, usage null until the last chunk, then [DONE]
    body = {"prompt": "x", "max_tokens": 3, "stream": True, "session_id": sid}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-session-id"] == sid
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert '"usage":null' in lines[0]


def test_a_session_continued_across_calls(oa, http):
    first = _greedy(oa, "To be, or", 6)
    sid = first.session_id  # type: ignore[attr-defined]
    second = _greedy(oa, " not", 6, extra_body={"session_id": sid})
    assert second.session_id == sid  # type: ignore[attr-defined]
    assert second.session == {"id": sid, "version": 2, "n_tokens": 1 + 9 + 6 + 4 + 6}  # type: ignore[attr-defined]
    assert second.usage.prompt_tokens == 4
    # the second call continued the recurrent state: it equals one generate in one session
    # that consumed everything before it (as token ids: a random model's text need not be
    # valid UTF-8, so it would not survive a round trip through text)
    ref = _generate(
        http, http.post("/v1/sessions").json()["id"], prompt="To be, or", max_tokens=6, temperature=0
    )
    assert ref["text"] == first.choices[0].text
    history = list(b"To be, or") + [t["id"] for t in ref["tokens"]] + list(b" not")
    one = http.post("/v1/sessions", json={"prompt": history}).json()["id"]
    continued = _generate(http, one, max_tokens=6, temperature=0)
    assert continued["text"] == second.choices[0].text

    # the X-Session-Id header works too, streaming
    third = _greedy(oa, "!", 4, stream=True, extra_headers={"X-Session-Id": sid})
    text = "".join(c.choices[0].text for c in third if c.choices)
    after = _session(http, sid)
    assert after["version"] == 3 and after["n_tokens"] == 1 + 9 + 6 + 4 + 6 + 1 + 4
    # (`one` consumed `continued`'s tokens when it generated them: only the "!" is new)
    assert _generate(http, one, prompt=list(b"!"), max_tokens=4, temperature=0)["text"] == text


def test_token_id_prompts_logprobs_and_seed(oa):
    a = oa.completions.create(model="tiny", prompt=[72, 105], max_tokens=5, seed=7, logprobs=1)
    b = oa.completions.create(model="tiny", prompt="Hi", max_tokens=5, seed=7, logprobs=0)
    assert a.choices[0].text == b.choices[0].text  # same tokens, same seed: same sample
    lp = a.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 5 and "".join(lp.tokens) == a.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_a_prompt_in_an_array_of_one_is_that_prompt(oa):
    """LangChain's `OpenAI(...).invoke(text)` sends `prompt: [text]`: the same completion."""
    plain = oa.completions.create(model="tiny", prompt="Hi", max_tokens=5, seed=3)
    listed = oa.completions.create(model="tiny", prompt=["Hi"], max_tokens=5, seed=3)
    ids = oa.completions.create(model="tiny", prompt=[[72, 105]], max_tokens=5, seed=3)
    assert plain.choices[0].text == listed.choices[0].text == ids.choices[0].text


BATCH = ["Hi", "Ho", "Hum"]


def test_a_batch_of_prompts_is_one_choice_each_in_its_own_session(oa, http, server):
    alone = [_greedy(oa, p, 5) for p in BATCH]
    batch = _greedy(oa, BATCH, 5)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    refs = [c.session for c in batch.choices]  # type: ignore[attr-defined]
    assert len({r["id"] for r in refs}) == 3
    assert batch.session_id == refs[0]["id"]  # type: ignore[attr-defined]
    for r, p in zip(refs, BATCH, strict=True):
        assert r["version"] == 1 and _session(http, r["id"])["n_tokens"] == r["n_tokens"] == 1 + len(p) + 5
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (7, 15)
    # token-id prompts: the same batch
    ids = _greedy(oa, [list(p.encode()) for p in BATCH], 5)
    assert [c.text for c in ids.choices] == [c.text for c in batch.choices]

    # streamed: every chunk names its choice; each choice closes with its finish reason and session
    chunks = list(_greedy(oa, BATCH, 5, stream=True, stream_options={"include_usage": True}))
    *events, usage = chunks
    texts = {i: "".join(c.choices[0].text for c in events if c.choices[0].index == i) for i in range(3)}
    assert texts == {i: c.text for i, c in enumerate(batch.choices)}
    closing = {c.choices[0].index: c.choices[0] for c in events if c.choices[0].finish_reason}
    assert sorted(closing) == [0, 1, 2] and all(c.finish_reason == "length" for c in closing.values())
    assert len({c.session["id"] for c in closing.values()}) == 3  # type: ignore[attr-defined]
    assert usage.usage is not None and usage.usage.completion_tokens == 15

    # a batch cannot continue one session, nor be larger than the server's batch
    sid = refs[0]["id"]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        oa.completions.create(model="tiny", prompt=BATCH, max_tokens=5, extra_body={"session_id": sid})
    assert "one continuation" in str(e.value) and _session(http, sid)["version"] == 1
    with pytest.raises(openai.UnprocessableEntityError) as e:
        oa.completions.create(model="tiny", prompt=["x"] * 33, max_tokens=1)
    assert "max_batch_size" in str(e.value)


def test_errors_surface_as_sdk_exceptions(oa, http):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        oa.completions.create(model="tiny", prompt="x", n=17)  # past the most choices (16)
    assert e.value.status_code == 422 and e.value.type == "invalid_request" and "n" in str(e.value)
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="gpt-4", prompt="x")
    assert e.value.type == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="tiny", prompt="x", extra_body={"session_id": "0" * 32})
    assert e.value.type == "session_not_found"
    with pytest.raises(openai.UnprocessableEntityError, match="presence_penalty"):
        oa.completions.create(model="tiny", prompt="x", presence_penalty=2.5)  # OpenAI's range: -2..2
    # the house error body, unchanged
    r = http.post("/v1/completions", json={"prompt": "x", "n": 17})
    assert r.status_code == 422 and set(r.json()["error"]) == {"type", "message"}
    # nothing was created or changed by a refused request
    sid = http.post("/v1/sessions").json()["id"]
    r = http.post("/v1/completions", json={"prompt": [999999], "session_id": sid})
    assert r.status_code == 422 and _session(http, sid)["version"] == 0
