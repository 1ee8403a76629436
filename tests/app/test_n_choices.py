"""`n` > 1 on both OpenAI routes, over real HTTP against a real server and Redis: n
choices from one prompt, the first in the prompt's session and the others in forks of it
taken before any starts; choice j of a prompt samples with seed s + j; a batch of prompts
gives prompt i's choices at i*n .. i*n+n-1 (OpenAI's order); and a request that cannot
start leaves no session behind."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest

import model
from tests.app.sse_client import generating
from tests.conftest import TINY, ServerProcess
from tests.sensitive import write_sensitive

BATCH = 8  # the server's max_batch_size: n times the prompts may not pass it
TOKENS = 8
SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": TOKENS, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Good morrow, cousin."}]


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    """A tiny byte-level model with the shipped play-script chat template."""
    path = tmp_path_factory.mktemp("n-model") / "tiny"
    write_sensitive(path, seed=0, chat_template=model.checkpoint.chat_template("shakespeare"), **TINY)
    settings = {"cpu_threads": 1, "max_tokens": 50, "max_batch_size": BATCH}
    with ServerProcess(path, tmp_path_factory.mktemp("server"), redis_url, **settings) as srv:
        yield srv


def _post(http: httpx.Client, path: str, **body: object) -> dict:
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(http: httpx.Client, path: str, **body: object) -> tuple[dict[int, str], dict[int, dict], dict]:
    """A streamed response's text per choice index, each choice's session (from its
    closing chunk), and the usage chunk."""
    texts: dict[int, str] = {}
    refs: dict[int, dict] = {}
    usage: dict = {}
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        for data in map(json.loads, lines[:-1]):
            usage = data.get("usage") or usage
            for c in data["choices"]:
                piece = c["text"] if "text" in c else c["delta"].get("content") or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if "session" in c:
                    refs[c["index"]] = c["session"]
    return texts, refs, usage


def _consumed(http: httpx.Client, sid: str) -> list[int]:
    """Every token the session's state consumed, in order (its transcript)."""
    t = http.get(f"/v1/sessions/{sid}/transcript").json()
    assert t["complete"]
    return [i for seg in t["segments"] for i in seg["ids"]]


def _ids(http: httpx.Client, text: str) -> list[int]:
    """The ids a new session consumes for `text` (BOS first)."""
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": True}).json()["tokens"]


def _lifetime(http: httpx.Client, sid: str) -> float:
    s = http.get(f"/v1/sessions/{sid}").json()
    return (datetime.fromisoformat(s["expires_at"]) - datetime.fromisoformat(s["created_at"])).total_seconds()


def _every_session(http: httpx.Client) -> set[str]:
    ids: set[str] = set()
    cursor: str | None = "0"
    while cursor is not None:
        r = http.get("/v1/sessions", params={"limit": 1000, "cursor": cursor, "ephemeral": True})
        assert r.status_code == 200, r.text
        ids |= {s["id"] for s in r.json()["sessions"]}
        cursor = r.json()["next_cursor"]
    return ids


def _check_sessions(
    http: httpx.Client, prompt_ids: list[int], sessions: list[dict], generated: int | None
) -> None:
    """Each choice has a session of its own, a stateless one (short-lived), whose transcript
    holds the prompt and then that choice's tokens."""
    assert len({s["id"] for s in sessions}) == len(sessions)
    tails = []
    for s in sessions:
        consumed = _consumed(http, s["id"])
        assert consumed[: len(prompt_ids)] == prompt_ids and len(consumed) == s["n_tokens"]
        if generated is not None:
            assert len(consumed) == len(prompt_ids) + generated
        tails.append(tuple(consumed[len(prompt_ids) :]))
        assert _lifetime(http, s["id"]) < 1000  # the stateless TTL (900 s), not a day
    assert len(set(tails)) == len(tails)  # the seeds s + j: the samples differ


@pytest.mark.parametrize("stream", [False, True])
def test_completions_n_sampled_with_a_seed(http, stream):
    prompt = "Now is the winter"
    body = {"prompt": prompt, "n": 3, **SAMPLED}
    c = _post(http, "/v1/completions", **body)
    assert [ch["index"] for ch in c["choices"]] == [0, 1, 2]
    sessions = [ch["session"] for ch in c["choices"]]
    assert c["session_id"] == sessions[0]["id"]
    prompt_ids = _ids(http, prompt)
    n_prompt = len(prompt_ids) - 1
    assert c["usage"].pop("prompt_tokens_details")["cached_tokens"] >= 0  # (whatever reuse found)
    assert c["usage"] == {
        "prompt_tokens": 3 * n_prompt,
        "completion_tokens": 3 * TOKENS,
        "total_tokens": 3 * (n_prompt + TOKENS),
    }
    _check_sessions(http, prompt_ids, sessions, TOKENS)
    texts = [ch["text"] for ch in c["choices"]]
    if stream:  # the same request streamed: the same texts (the seeds make it reproducible)
        streamed, refs, usage = _streamed(http, "/v1/completions", **body)
        assert [streamed[i] for i in range(3)] == texts and _plain(usage) == _plain(c["usage"])
        _check_sessions(http, prompt_ids, [refs[i] for i in range(3)], TOKENS)
    else:  # choice j is what one choice with seed s + j gives
        for j, text in enumerate(texts):
            one = _post(http, "/v1/completions", **{**body, "n": 1, "seed": SAMPLED["seed"] + j})
            assert one["choices"][0]["text"] == text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n_sampled_with_a_seed(http, stream):
    body = {"messages": MESSAGES, "n": 3, "logprobs": True, **SAMPLED}
    c = _post(http, "/v1/chat/completions", **body)
    assert [ch["index"] for ch in c["choices"]] == [0, 1, 2]
    rendered = model.chat_template.play_script().render(MESSAGES)
    prompt_ids = _ids(http, rendered)
    sessions = [ch["session"] for ch in c["choices"]]
    _check_sessions(http, prompt_ids, sessions, None)
    for j, (ch, s) in enumerate(zip(c["choices"], sessions, strict=True)):
        # each session's last commit: this choice's tokens, sampled with seed s + j
        last = http.get(f"/v1/sessions/{s['id']}/transcript").json()["segments"][-1]
        assert last["kind"] == "generate" and last["seed"] == SAMPLED["seed"] + j
        sampled = [lp for lp, acted in zip(last["logprobs"], last["sampled"], strict=True) if acted]
        assert sampled == pytest.approx([t["logprob"] for t in ch["logprobs"]["content"]], abs=1e-5)
        assert len(_consumed(http, s["id"])) == len(prompt_ids) + len(sampled)
    assert c["usage"]["completion_tokens"] == sum(len(ch["logprobs"]["content"]) for ch in c["choices"])
    texts = [ch["message"]["content"] for ch in c["choices"]]
    if stream:
        streamed, refs, usage = _streamed(http, "/v1/chat/completions", **body)
        assert [streamed[i] for i in range(3)] == texts and _plain(usage) == _plain(c["usage"])
        assert [refs[i]["n_tokens"] for i in range(3)] == [s["n_tokens"] for s in sessions]
    else:
        again = _post(http, "/v1/chat/completions", **body)
        assert [ch["message"]["content"] for ch in again["choices"]] == texts


def test_greedy_choices_are_identical(http):
    greedy = {"n": 2, "temperature": 0, "max_tokens": TOKENS}
    c = _post(http, "/v1/completions", prompt="To be, or not", **greedy)
    assert c["choices"][0]["text"] == c["choices"][1]["text"]
    assert c["choices"][0]["session"]["id"] != c["choices"][1]["session"]["id"]
    chat = _post(http, "/v1/chat/completions", messages=MESSAGES, **greedy)
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]


def test_a_batch_of_prompts_gives_each_prompts_choices_in_turn(http):
    """OpenAI's order: prompt i's choices are i*n .. i*n+n-1 (each echoing its own prompt)."""
    prompts = ["Once more unto", "What's in a name"]
    c = _post(http, "/v1/completions", prompt=prompts, n=2, echo=True, **SAMPLED)
    assert [ch["index"] for ch in c["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        mine = c["choices"][2 * i : 2 * i + 2]
        prompt_ids = _ids(http, prompt)
        _check_sessions(http, prompt_ids, [ch["session"] for ch in mine], TOKENS)
        for j, ch in enumerate(mine):
            assert ch["text"].startswith(prompt)
            one = _post(http, "/v1/completions", prompt=prompt, **{**SAMPLED, "seed": SAMPLED["seed"] + j})
            assert ch["text"] == prompt + one["choices"][0]["text"]
    streamed, _, _ = _streamed(http, "/v1/completions", prompt=prompts, n=2, echo=True, **SAMPLED)
    assert [streamed[i] for i in range(4)] == [ch["text"] for ch in c["choices"]]


def test_a_named_session_continues_in_choice_0_and_forks_of_it(http):
    created = http.post("/v1/sessions", json={"prompt": "KING:\n", "ttl_seconds": 5000}).json()
    sid, before = created["id"], created["n_tokens"]
    history = _consumed(http, sid)
    c = _post(http, "/v1/completions", prompt="Speak", session_id=sid, n=3, **SAMPLED)
    sessions = [ch["session"] for ch in c["choices"]]
    assert sessions[0]["id"] == sid == c["session_id"] and sessions[0]["version"] == 1
    assert [s["n_tokens"] for s in sessions] == [before + len("Speak") + TOKENS] * 3
    for s in sessions:  # each began with all the session had consumed
        assert _consumed(http, s["id"])[: len(history)] == history
    for s in sessions[1:]:  # a fork lives as long as the session it forked
        assert abs(_lifetime(http, s["id"]) - 5000) < 60
    # any of them can be continued
    more = _post(http, "/v1/completions", prompt=".", session_id=sessions[2]["id"], max_tokens=2)
    assert more["choices"][0]["session"]["n_tokens"] == sessions[2]["n_tokens"] + 1 + 2


def test_n_past_the_limits_is_422_naming_the_field(http):
    for body in ({"prompt": "x", "n": 17}, {"prompt": "x", "n": 0}, {"prompt": ["a", "b", "c"], "n": 3}):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request" and re.search(r"\bn: ", err["message"]), err
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "n": BATCH + 1})
    assert r.status_code == 422 and re.search(r"\bn: ", r.json()["error"]["message"])
    # n times the prompts up to max_batch_size is fine
    c = _post(http, "/v1/completions", prompt=["a", "b"], n=BATCH // 2, max_tokens=1)
    assert len(c["choices"]) == BATCH


def test_a_request_that_cannot_start_leaves_no_fork_behind(http):
    """The session is busy: its forks were made before choice 0 found the lock taken, and
    are deleted again."""
    sid = http.post("/v1/sessions", json={"prompt": "HAMLET:\n"}).json()["id"]
    before = _every_session(http)
    with generating(http, sid):
        r = http.post("/v1/completions", json={"prompt": "x", "session_id": sid, "n": 4, "max_tokens": 2})
        assert r.status_code == 409 and r.json()["error"]["type"] == "session_busy"
    assert _every_session(http) == before


def _plain(usage: dict) -> dict:
    """Usage without its cached-token details (which prefix reuse makes depend on earlier tests)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
