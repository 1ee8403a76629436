"""Durable prefix reuse on `POST /v1/chat/completions`, for both shipped families (which
carry the play-script template), over real HTTP against the real Redis: a stateless client
that resends the whole conversation each turn (the assistant's messages as the route
returned them) forks the previous turn's state on every turn after the first, with the
same greedy tokens and log-probs as a full re-prefill under a key that has no prefixes;
another key never hits the first key's prefixes; index entries expire with their sessions.

The replies are greedy, so they are fixed by the weights: the prompts below give replies in
valid UTF-8 (a byte-level model may sample bytes that are not, and such a reply, sent back
as U+FFFD, no longer renders what the state consumed: docs/OPENAI.md "Chat templates"). Each test
asserts that too, so a change of weights that breaks it fails loudly instead of missing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from tests.conftest import ServerProcess

SCENE = [
    {"role": "system", "content": "Enter Romeo and Juliet."},
    {"role": "user", "content": "But soft! What light through yonder window breaks?"},
]
LINES = ["Speak again, bright angel!", "With love's light wings did I o'erperch these walls.", "Good night."]
FULL = [f"key-full-{i}" for i in range(len(LINES) + 1)]  # one fresh key per turn: no prefixes of its own
KEYS = ["key-chat", "key-sdk", "key-ttl", *FULL]
SHORT_TTL = 3


def _serve(name: str, redis_url: str, workdir, ttl: int) -> ServerProcess:
    return ServerProcess(
        name,
        workdir,
        redis_url,
        cpu_threads=1,
        max_tokens=64,
        api_keys=",".join(KEYS),
        stateless_session_ttl=ttl,
    ).start()


@pytest.fixture(scope="module", params=["shakespeare", "shakespeare-rlt"])
def server(request, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = _serve(request.param, redis_url, tmp_path_factory.mktemp("chat-reuse"), 600)
    yield srv
    srv.stop()


def client(server: ServerProcess, key: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {key}"})


def chat(c: httpx.Client, messages: list[dict]) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 32, "logprobs": True}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert "\ufffd" not in reply["choices"][0]["message"]["content"], (
        "a reply that is not UTF-8: pick other lines"
    )
    return reply


def consumed(c: httpx.Client, sid: str) -> list[int]:
    t = c.get(f"/v1/sessions/{sid}/transcript").json()
    assert t["complete"]
    return [i for g in t["segments"] for i in g["ids"]]


def counters(server: ServerProcess) -> dict[str, float]:
    return {
        name: server.metric(f"recur_prefix_reuse_{name}_total", key=KEYS[0])
        for name in ("hits", "misses", "tokens_saved")
    }


def delta(server: ServerProcess, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counters(server).items()}


def test_a_resent_chat_forks_every_turn_and_matches_a_full_prefill(server):
    messages = list(SCENE)
    previous: str | None = None
    with client(server, "key-chat") as a:
        for turn, line in enumerate([*LINES, None]):
            before = counters(server)
            got = chat(a, messages)
            if previous is None:
                assert delta(server, before) == {"hits": 0, "misses": 1, "tokens_saved": 0}
            else:  # the whole of the previous turn's state was the prefix: only the new messages prefilled
                assert delta(server, before) == {
                    "hits": 1,
                    "misses": 0,
                    "tokens_saved": len(consumed(a, previous)),
                }
                assert a.get(f"/v1/sessions/{previous}").json()["version"] == 1  # forked, never modified
            before = counters(server)
            with client(server, FULL[turn]) as full:  # the same request, re-prefilled whole
                want = chat(full, messages)
            assert delta(server, before) == {
                "hits": 0,
                "misses": 1,
                "tokens_saved": 0,
            }  # never the other key's
            g, w = got["choices"][0]["logprobs"]["content"], want["choices"][0]["logprobs"]["content"]
            assert [t["token"] for t in g] == [t["token"] for t in w] and len(g) > 0
            assert [t["logprob"] for t in g] == pytest.approx([t["logprob"] for t in w], abs=1e-4)
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
            previous = got["session_id"]
            if line is not None:  # the whole conversation goes back, the reply as returned
                messages += [got["choices"][0]["message"], {"role": "user", "content": line}]


def test_the_openai_sdk_streams_a_stateless_chat_that_hits_reuse(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="key-sdk", max_retries=0, timeout=120)
    messages: list = list(SCENE)
    before = counters(server)
    for line in LINES[:2]:
        chunks = oa.chat.completions.create(
            model=server.model_dir, messages=messages, temperature=0, max_tokens=32, stream=True
        )
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert reply and "\ufffd" not in reply
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": line}]
    last = oa.chat.completions.create(model=server.model_dir, messages=messages, temperature=0, max_tokens=32)
    assert last.choices[0].message.content
    d = delta(server, before)
    assert d["hits"] == 2 and d["misses"] == 1 and d["tokens_saved"] > 0


def test_index_entries_expire_with_their_sessions(redis_url, tmp_path_factory, server):
    """On a server whose stateless sessions live SHORT_TTL seconds: the next turn hits while
    they live; once they have expired, their index entries have too, and the next turn misses."""
    name = server.model_dir
    short = _serve(name, redis_url, tmp_path_factory.mktemp("chat-ttl"), SHORT_TTL)
    r = redis.Redis.from_url(redis_url)
    try:
        with client(short, "key-ttl") as a:
            first = chat(a, SCENE)
            messages = [*SCENE, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
            messages.append({"role": "user", "content": LINES[0]})
            before = counters(short)
            chat(a, messages)  # at once: within the TTL
            assert delta(short, before)["hits"] == 1
            entries = list(r.scan_iter(f"{short.settings['key_prefix']}prefix:*"))
            assert entries
            time.sleep(SHORT_TTL + 1.5)
            assert r.exists(*entries) == 0
            assert a.get(f"/v1/sessions/{first['session_id']}").status_code == 404
            before = counters(short)
            chat(a, messages)
            assert delta(short, before) == {"hits": 0, "misses": 1, "tokens_saved": 0}
    finally:
        short.stop()
