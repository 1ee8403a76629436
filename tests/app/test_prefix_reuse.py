"""Durable prefix reuse over real HTTP against the real Redis, for every family: a request
that names no session forks its key's longest committed prefix and prefills only the rest,
with the same greedy tokens and log-probs as a full prefill; another key never sees those
prefixes; the matched session is never touched; a stale entry falls back to a prefill."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import SSM_TINY, TINY, ServerProcess
from tests.sensitive import write_sensitive

A, B = "key-reuse-a", "key-reuse-b"
RLT_TINY = dict(
    n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_head=2, d_ff=64,
    window=4, memory_groups=2, max_context=16, tgt_len=8,
)  # fmt: skip
SETTINGS = {
    "max_tokens": 100,
    "max_prompt_tokens": 400,
    "cpu_threads": 1,
    "api_keys": f"{A},{B}",
    "stateless_session_ttl": 600,
}


@pytest.fixture(scope="module", params=["transformer-xl", "rlt", "mamba", "mamba2"])
def server(request, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("models") / request.param
    extra = {"transformer-xl": TINY, "rlt": RLT_TINY, **SSM_TINY}[request.param]
    write_sensitive(path, family=request.param, seed=0, **extra)
    srv = ServerProcess(path, tmp_path_factory.mktemp("reuse-server"), redis_url, **SETTINGS).start()
    yield srv
    srv.stop()


def client(server: ServerProcess, key: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {key}"})


def complete(c: httpx.Client, prompt: list[int], n: int = 8) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def consumed(c: httpx.Client, sid: str) -> list[int]:
    """Every token a session's state consumed, from its transcript."""
    t = c.get(f"/v1/sessions/{sid}/transcript").json()
    assert t["complete"]
    return [i for g in t["segments"] for i in g["ids"]]


def counters(server: ServerProcess) -> dict[str, float]:
    return {
        name: server.metric(f"recur_prefix_reuse_{name}_total") for name in ("hits", "misses", "tokens_saved")
    }


def same(got: dict, want: dict) -> None:
    g, w = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert g["tokens"] == w["tokens"]
    assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-4)


def test_a_resent_conversation_forks_its_prefix_and_matches_a_full_prefill(server):
    text = list(b"First Citizen: Before we proceed any further, hear me speak.")
    with client(server, A) as a, client(server, B) as b:
        turn1 = complete(a, text)
        first = turn1["session_id"]
        history = consumed(a, first)  # BOS, the prompt and the reply, as the state holds them
        bos = len(history) - len(text) - len(turn1["choices"][0]["logprobs"]["tokens"])
        before = counters(server)
        prompt2 = history[bos:] + list(b"\nAll: Speak, speak.")
        turn2 = complete(a, prompt2)
        assert turn2["usage"]["prompt_tokens"] == len(prompt2)
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - bos
        after = counters(server)
        assert after["hits"] == before["hits"] + 1
        assert after["tokens_saved"] - before["tokens_saved"] == len(history)
        # the same request under a key that has no prefixes: a full prefill, the same answer
        full = complete(b, prompt2)
        assert full["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a cold run
        assert counters(server)["misses"] == after["misses"] + 1
        same(turn2, full)
        # the matched session was forked, never modified; the fork lives the stateless TTL
        assert a.get(f"/v1/sessions/{first}").json()["version"] == 1
        s2 = a.get(f"/v1/sessions/{turn2['session_id']}").json()
        assert s2["id"] != first and 0 < _seconds_left(s2) <= 600
        assert consumed(a, turn2["session_id"])[: len(history)] == history
        # another key can neither find nor read the first key's prefixes or sessions
        assert b.get(f"/v1/sessions/{first}").status_code == 404


def test_a_stale_entry_falls_back_to_a_full_prefill(server):
    text = list(b"MENENIUS: What work's, my countrymen, in hand? where go you?")
    with client(server, A) as a, client(server, B) as b:
        turn1 = complete(a, text)
        history = consumed(a, turn1["session_id"])
        assert a.delete(f"/v1/sessions/{turn1['session_id']}").status_code == 204
        before = counters(server)
        prompt2 = history[len(history) - len(text) - 8 :] + list(b" Where?")
        again = complete(a, prompt2)
        after = counters(server)
        assert after["hits"] == before["hits"] and after["misses"] == before["misses"] + 1
        same(again, complete(b, prompt2))


def test_an_index_entry_that_names_other_tokens_is_never_forked(server):
    """An index entry is only a hint: the fork checks that the named state's tokens hash to
    what the request looked up (the state's own `tokens_hash`). Planted here, an entry for one
    text names another session's state: the request falls back to a full prefill, the same
    answer as a key with no prefixes, and counts a miss."""
    with client(server, A) as a, client(server, B) as b:
        other = complete(a, list(b"Second Citizen: One word, good citizens."))["session_id"]
        turn1 = complete(a, list(b"First Citizen: You are all resolved rather to die than to famish?"))
        sid = turn1["session_id"]
        history = consumed(a, sid)
        r = redis.Redis.from_url(server.redis_url)
        entries = [
            k
            for k in r.scan_iter(f"{server.settings['key_prefix']}prefix:*")
            if r.get(k) == f"{sid}:1".encode()
        ]
        assert entries, "the commit indexed no prefix"
        for key in entries:  # every prefix of this session's tokens now names the other session
            r.set(key, f"{other}:1", keepttl=True)
        before = counters(server)
        prompt2 = history[1:] + list(b" Resolved.")
        again = complete(a, prompt2)
        after = counters(server)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert after["hits"] == before["hits"] and after["misses"] == before["misses"] + 1
        same(again, complete(b, prompt2))


def test_reuse_can_be_switched_off(tiny_model_dir: Path, redis_url, tmp_path_factory):
    srv = ServerProcess(
        tiny_model_dir, tmp_path_factory.mktemp("no-reuse"), redis_url, **SETTINGS, prefix_reuse=False
    ).start()
    try:
        with client(srv, A) as a:
            turn1 = complete(a, list(b"To be, or not to be"))
            complete(a, consumed(a, turn1["session_id"])[1:] + list(b"?"))
        assert counters(srv) == {"hits": 0.0, "misses": 0.0, "tokens_saved": 0.0}
    finally:
        srv.stop()


def _seconds_left(session: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(session["expires_at"]).timestamp() - time.time()
