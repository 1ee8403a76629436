"""The Responses and Conversations APIs through the official `openai` SDK, against live
servers of both shipped families and a real Redis: a response continued by
previous_response_id gives what resending the whole conversation gives, prefilling only the
new input; branches are forks; store:false leaves nothing; a deleted ancestor leaves its
descendants continuable; another key sees nothing; background responses complete, cancel,
replay from starting_after, and are failed when their replica dies."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from tests.conftest import ServerProcess

KEYS = ("responses-key-a", "responses-key-b")
GREEDY = {"temperature": 0, "max_output_tokens": 24}


@pytest.fixture(scope="module", params=["shakespeare", "shakespeare-rlt"])
def server(request, redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    with ServerProcess(
        request.param, tmp_path_factory.mktemp("server"), redis_url, cpu_threads=1, max_tokens=200,
        api_keys=",".join(KEYS), response_lease_seconds=1.5,
    ) as srv:  # fmt: skip
        yield srv


def client(server: ServerProcess, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oa(server) -> openai.OpenAI:
    return client(server)


@pytest.fixture(scope="module")
def cold(server, redis_url, tmp_path_factory) -> Iterator[openai.OpenAI]:
    """The reference for "the whole conversation resent": a server of the same model with
    prefix reuse off and keys of its own in Redis, so that it can only prefill the whole
    text from an empty state; it cannot fork the chain's stored states (`resent` checks)."""
    with ServerProcess(
        server.model_dir, tmp_path_factory.mktemp("cold"), redis_url, cpu_threads=1, max_tokens=200,
        api_keys=",".join(KEYS), prefix_reuse=False,
    ) as srv:  # fmt: skip
        yield client(srv)


def resent(cold: openai.OpenAI, **request: object) -> openai.types.responses.Response:
    """A whole conversation resent to the cold server: prefilled from nothing."""
    whole = cold.responses.create(store=False, **GREEDY, **request)  # type: ignore[call-overload]
    assert whole.usage.input_tokens_details.cached_tokens == 0
    return whole


def keys_of(server: ServerProcess) -> set[bytes]:
    """The server's keys in Redis, less the tombstones that deletes leave: a deleted
    session's lock holds the deleter's token for at most a minute, so that a retried delete
    recognises its own first run (app/store/lua/delete.lua); its session is gone."""
    r = redis.Redis.from_url(server.redis_url)
    prefix = server.settings["key_prefix"].encode()
    keys = set(r.scan_iter(match=prefix + b"*"))

    def tombstone(key: bytes) -> bool:
        session = key.replace(prefix + b"lock:", prefix + b"session:", 1)
        return key.startswith(prefix + b"lock:") and 0 < r.pttl(key) <= 60_000 and session not in keys

    return {k for k in keys if not tombstone(k)}


def test_chain_equals_whole_conversation_and_reuses_state(oa, cold):
    model = oa.models.list().data[0].id
    first = oa.responses.create(
        model=model, input="Good morrow, fair lady.", instructions="A garden.", **GREEDY
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    second = oa.responses.create(
        model=model, input="What news?", previous_response_id=first.id, instructions="A garden.", **GREEDY,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's state was reused
    assert second.usage.input_tokens > second.usage.input_tokens_details.cached_tokens
    whole = resent(
        cold, model=model, instructions="A garden.", include=["message.output_text.logprobs"],
        input=[
            {"role": "user", "content": "Good morrow, fair lady."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What news?"},
        ],
    )  # fmt: skip
    assert whole.output_text == second.output_text
    assert whole.usage.input_tokens == second.usage.input_tokens
    a = second.output[0].content[0].logprobs
    b = whole.output[0].content[0].logprobs
    assert len(a) == len(b) and all(abs(x.logprob - y.logprob) <= 1e-4 for x, y in zip(a, b, strict=True))
    # branching: two continuations of one response are two forks, neither conflicts
    x = oa.responses.create(
        model=model, input="What news?", previous_response_id=first.id, instructions="A garden.", **GREEDY
    )
    assert x.output_text == second.output_text and x.id != second.id
    # streamed: the event sequence, numbered, ending with the same text
    events = list(oa.responses.create(model=model, input="What news?", previous_response_id=first.id,
                                      instructions="A garden.", stream=True, **GREEDY))  # fmt: skip
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == second.output_text
    assert oa.responses.retrieve(events[-1].response.id).output_text == second.output_text


LOGPROBS = ["message.output_text.logprobs"]


def same_reply(a: openai.types.responses.Response, b: openai.types.responses.Response) -> None:
    """Two replies alike: text, input tokens, and each token's log-prob within 1e-4."""
    assert a.output_text == b.output_text and a.usage.input_tokens == b.usage.input_tokens
    x, y = a.output[0].content[0].logprobs, b.output[0].content[0].logprobs
    assert len(x) == len(y) and all(abs(p.logprob - q.logprob) <= 1e-4 for p, q in zip(x, y, strict=True))


def test_each_turn_renders_alone_and_equals_the_whole_conversation(server, oa, cold):
    """A chain's later turns render and tokenize only their own input (the record says how its
    reply closes after its state, and keeps no digest of a whole rendering it never made); each
    turn equals the whole conversation resent to the cold server. A turn under other
    instructions renders the whole conversation, walked through the chain's turns, a deleted
    response's included; once every response is deleted, the chain's turns are gone."""
    r = redis.Redis.from_url(server.redis_url)
    prefix = server.settings["key_prefix"]
    history: list[dict[str, str]] = []
    made: list[str] = []
    previous = None
    for text in ("Good morrow.", "What news?", "Whence comest thou?", "Farewell."):
        resp = oa.responses.create(
            input=text, previous_response_id=previous, instructions="A garden.", include=LOGPROBS, **GREEDY
        )
        history.append({"role": "user", "content": text})
        same_reply(resp, resent(cold, instructions="A garden.", input=history, include=LOGPROBS))
        history.append({"role": "assistant", "content": resp.output_text})
        if previous is not None:
            assert resp.usage.input_tokens_details.cached_tokens > 0  # (the state continued)
            assert resp.id.startswith(made[0]) and len(resp.id) == len(made[0]) + 16  # (in its chain)
        made.append(resp.id)
        previous = resp.id
    tag = made[0]
    record = f"{prefix}response:{{{tag}}}{made[-1][len(tag) :]}".encode()
    digest, closing = r.hmget(record, "digest", "closing")
    assert digest == b"" and closing not in (None, b"")  # (rendered alone: no whole rendering digested)
    oa.responses.delete(made[1])
    resp = oa.responses.create(
        input="Stay.", previous_response_id=previous, instructions="A tomb.", include=LOGPROBS, **GREEDY
    )
    history.append({"role": "user", "content": "Stay."})
    same_reply(resp, resent(cold, instructions="A tomb.", input=history, include=LOGPROBS))
    for rid in (made[0], *made[2:], resp.id):
        oa.responses.delete(rid)
    assert not r.exists(f"{prefix}chain:{{{tag}}}"), "a chain's turns outlived its responses"


def test_a_response_stored_before_chains_continues(server, oa, cold):
    """A response stored before responses kept their turns in their chain (its record holds
    the whole conversation it ends, `context`; no turn of its own, no `closing`) continues:
    rendered whole, the walk ending at its `context`; so does a later response whose walk
    reaches it. Each equals the whole conversation resent."""
    r = redis.Redis.from_url(server.redis_url)
    prefix = server.settings["key_prefix"]
    first = oa.responses.create(input="Who is it?", **GREEDY)
    second = oa.responses.create(input="Speak up.", previous_response_id=first.id, **GREEDY)
    record, chain = f"{prefix}response:{{{first.id}}}", f"{prefix}chain:{{{first.id}}}"
    context = [{"role": "user", "content": "Who is it?"}, {"role": "assistant", "content": first.output_text}]
    r.hset(record, "context", json.dumps(context))  # (as it was stored before chains)
    r.hdel(record, "parent", "frame", "closing", "digest")
    r.hdel(chain, f"s:{first.id}", f"p:{first.id}", f"n:{first.id}")
    history = [*context, {"role": "user", "content": "Again?"}]
    again = oa.responses.create(input="Again?", previous_response_id=first.id, include=LOGPROBS, **GREEDY)
    same_reply(again, resent(cold, input=history, include=LOGPROBS))
    assert again.usage.input_tokens_details.cached_tokens > 0  # (its state continued, checked whole)
    history = [*context, {"role": "user", "content": "Speak up."}, {"role": "assistant", "content": second.output_text},
               {"role": "user", "content": "Louder."}]  # fmt: skip
    louder = oa.responses.create(
        input="Louder.", previous_response_id=second.id, instructions="A din.", include=LOGPROBS, **GREEDY
    )
    same_reply(louder, resent(cold, input=history, instructions="A din.", include=LOGPROBS))


def test_a_conversation_turn_reads_only_its_new_items(server, oa, cold):
    """A conversation's response turns read and render only the items since its state (items
    the Conversations API added between turns included), each equal to the whole resent."""
    conv = oa.conversations.create(items=[{"role": "system", "content": "A hall."}])
    whole: list[dict[str, str]] = [{"role": "system", "content": "A hall."}]
    for n, text in enumerate(("Who knocks?", "Enter, then.", "What would you?")):
        if n == 2:  # (added by the Conversations API: the state prefills it, and renders the next turn whole)
            oa.conversations.items.create(conv.id, items=[{"role": "user", "content": "A pause."}])
            whole.append({"role": "user", "content": "A pause."})
        resp = oa.responses.create(input=text, conversation=conv.id, include=LOGPROBS, **GREEDY)
        whole.append({"role": "user", "content": text})
        same_reply(resp, resent(cold, input=whole, include=LOGPROBS))
        whole.append({"role": "assistant", "content": resp.output_text})
        if n:
            assert resp.usage.input_tokens_details.cached_tokens > 0
    # its last response continued by previous_response_id, under other instructions: the whole
    # conversation is the conversation's items before that response's input, then its turn
    more = oa.responses.create(
        input="Louder.", previous_response_id=resp.id, instructions="A yard.", include=LOGPROBS, **GREEDY
    )
    whole.append({"role": "user", "content": "Louder."})
    same_reply(more, resent(cold, input=whole, instructions="A yard.", include=LOGPROBS))
    oa.conversations.delete(conv.id)


def test_retrieve_input_items_delete_keeps_descendants(oa):
    first = oa.responses.create(input=[{"role": "user", "content": "Speak."}], **GREEDY)
    second = oa.responses.create(input="Again.", previous_response_id=first.id, **GREEDY)
    assert oa.responses.retrieve(first.id).output_text == first.output_text
    items = list(oa.responses.input_items.list(second.id, order="asc"))
    assert [(i.role, i.content[0].text) for i in items] == [("user", "Again.")]
    oa.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(first.id)
    third = oa.responses.create(input="Once more.", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens > 0  # the descendant holds its own state
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(input="x", previous_response_id=first.id, **GREEDY)


def test_store_false_leaves_nothing(server, oa):
    before = keys_of(server)
    r = oa.responses.create(input="Nothing kept.", store=False, **GREEDY)
    assert keys_of(server) - before == set()
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(input="x", previous_response_id=r.id, **GREEDY)


def test_another_key_sees_nothing(server, oa):
    r = oa.responses.create(input="Mine.", **GREEDY)
    conv = oa.conversations.create(items=[{"role": "user", "content": "Mine too."}])
    other = client(server, KEYS[1])
    for call in (
        lambda: other.responses.retrieve(r.id),
        lambda: other.responses.delete(r.id),
        lambda: other.responses.input_items.list(r.id),
        lambda: other.responses.cancel(r.id),
        lambda: other.responses.create(input="x", previous_response_id=r.id),
        lambda: other.conversations.retrieve(conv.id),
        lambda: other.conversations.items.list(conv.id),
        lambda: other.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
        lambda: other.conversations.delete(conv.id),
        lambda: other.responses.create(input="x", conversation=conv.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert oa.responses.retrieve(r.id).id == r.id


def test_conversations(oa, cold):
    conv = oa.conversations.create(items=[{"role": "system", "content": "A street."}], metadata={"k": "v"})
    assert oa.conversations.retrieve(conv.id).metadata == {"k": "v"}
    oa.conversations.items.create(conv.id, items=[{"role": "user", "content": "Who goes there?"}])
    r = oa.responses.create(input="Speak!", conversation=conv.id, **GREEDY)
    assert r.usage.input_tokens_details.cached_tokens > 0  # the items were prefilled already
    items = list(oa.conversations.items.list(conv.id, order="asc"))
    assert [i.role for i in items] == ["system", "user", "user", "assistant"]
    assert items[-1].content[0].text == r.output_text
    whole = resent(cold, input=[{"role": i.role, "content": i.content[0].text} for i in items[:3]])
    assert whole.output_text == r.output_text
    oa.conversations.items.delete(items[1].id, conversation_id=conv.id)  # the state cannot un-consume it
    again = oa.responses.create(input="Speak!", conversation=conv.id, **GREEDY)
    left = [items[0], items[2], items[3]]  # so the items are prefilled anew (from a prefix, at most)
    assert again.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    anew = resent(
        cold,
        input=[
            *({"role": i.role, "content": i.content[0].text} for i in left),
            {"role": "user", "content": "Speak!"},
        ],
    )
    assert anew.output_text == again.output_text
    oa.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        oa.conversations.retrieve(conv.id)


def test_unsupported_fields_are_400_naming_them(oa):
    conv = oa.conversations.create()
    for extra, field in (
        (
            {"tools": [{"type": "web_search"}]},
            "tools",
        ),  # (function tools are served: tests/app/test_tools.py)
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"conversation": conv.id, "previous_response_id": "resp_x"}, "conversation"),
    ):
        with pytest.raises(openai.BadRequestError, match=field):
            oa.responses.create(input="x", **extra)
    # greedy: sampled at the client's defaults, a 2-token answer is the turn stop ("\n\n") about
    # once in 150 (measured: 4 of 600 on the two models), and completes
    assert oa.responses.create(input="x", tools=[], max_output_tokens=2, temperature=0).status == "incomplete"


def test_background_completes_replays_and_cancels(server, oa):
    r = oa.responses.create(input="Tell a long tale.", background=True, temperature=0, max_output_tokens=120)
    assert r.status in ("queued", "in_progress")
    seen = []
    with oa.responses.retrieve(r.id, stream=True) as stream:
        for ev in stream:
            seen.append(ev)
            if len(seen) == 5:
                break  # the client goes away; the response runs on
    rest = list(oa.responses.retrieve(r.id, stream=True, starting_after=seen[-1].sequence_number))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # every event, exactly once
    assert rest[-1].type in ("response.completed", "response.incomplete")
    done = oa.responses.retrieve(r.id)
    assert done.output_text == "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert (
        done.output_text
        == oa.responses.create(input="Tell a long tale.", temperature=0, max_output_tokens=120).output_text
    )
    # cancel: it stops and keeps nothing more
    c = oa.responses.create(input="Another long tale.", background=True, temperature=0, max_output_tokens=200)
    cancelled = oa.responses.cancel(c.id)
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert isinstance(cancelled.output, list) and isinstance(cancelled.tools, list)
    time.sleep(0.5)
    assert oa.responses.retrieve(c.id).status in ("cancelled", "completed", "incomplete")


def test_background_of_a_dead_replica_is_failed(server, redis_url, tmp_path_factory):
    """A replica killed mid-response: another replica's sweep fails it within 1.5 leases."""
    doomed = ServerProcess(server.model_dir, tmp_path_factory.mktemp("doomed"), redis_url, cpu_threads=1,
                           max_tokens=1000, api_keys=",".join(KEYS), response_lease_seconds=1.5,
                           key_prefix=server.settings["key_prefix"]).start()  # fmt: skip
    try:
        r = client(doomed).responses.create(
            input="A very long tale.", background=True, max_output_tokens=1000
        )
        doomed.kill()
    finally:
        doomed.stop()
    oa = client(server)
    deadline = time.monotonic() + 60
    while oa.responses.retrieve(r.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
    got = oa.responses.retrieve(r.id)
    assert got.status == "failed" and got.error is not None and got.error.code == "server_error"
    assert isinstance(got.output, list)  # (the sweep set the status; the body is as Python wrote it)
    events = list(oa.responses.retrieve(r.id, stream=True))
    assert events[-1].type == "response.failed"
    # the sweep's event carries no response: the replay adds the stored one, failed
    assert events[-1].response.id == r.id and events[-1].response.status == "failed"
    assert events[-1].response.error is not None and isinstance(events[-1].response.output, list)


def test_chain_continues_on_another_replica_and_after_restart(server, cold, redis_url, tmp_path_factory):
    first = client(server).responses.create(input="Good morrow.", **GREEDY)
    other = ServerProcess(server.model_dir, tmp_path_factory.mktemp("other"), redis_url, cpu_threads=1,
                          max_tokens=200, api_keys=",".join(KEYS), key_prefix=server.settings["key_prefix"])  # fmt: skip
    hit = {"name": "recur_response_reuse_total", "key": KEYS[0], "result": "hit"}
    with other:
        second = client(other).responses.create(input="And to you.", previous_response_id=first.id, **GREEDY)
        assert second.usage.input_tokens_details.cached_tokens > 0
        assert other.metric(**hit) == 1  # the reuse happened on the replica that served it
    with other:  # restarted: nothing in its memory
        third = client(other).responses.create(input="Farewell.", previous_response_id=second.id, **GREEDY)
        assert third.usage.input_tokens_details.cached_tokens > 0
        assert other.metric(**hit) == 1
    whole = resent(
        cold, input=[{"role": "user", "content": "Good morrow."}, {"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "And to you."}, {"role": "assistant", "content": second.output_text},
                     {"role": "user", "content": "Farewell."}])  # fmt: skip
    assert whole.output_text == third.output_text


def test_a_stream_that_fails_midway_is_kept_as_failed(server, oa):
    """The session a streamed response writes vanishes under it (its keys deleted mid-stream):
    the commit fails, the stream ends with response.failed, and that is what retrieve finds."""
    r = redis.Redis.from_url(server.redis_url)
    before = keys_of(server)
    sessions = (server.settings["key_prefix"] + "session:").encode()
    seen = []
    with oa.responses.create(input="Tell a long tale.", stream=True, temperature=0, max_output_tokens=190,
                             extra_body={"min_tokens": 190}) as stream:  # fmt: skip
        for ev in stream:
            seen.append(ev)
            if ev.type == "response.output_text.delta" and len([e for e in seen if "delta" in e.type]) == 1:
                made = [k for k in keys_of(server) - before if k.startswith(sessions)]
                assert made and r.delete(*made) == len(made)
    assert seen[-1].type == "response.failed"
    got = oa.responses.retrieve(seen[0].response.id)
    assert got.status == "failed" and got.error is not None and got.output == []
    with pytest.raises(openai.BadRequestError):  # a failed response cannot be continued
        oa.responses.create(input="Go on.", previous_response_id=got.id, **GREEDY)


def test_two_responses_at_once_on_one_conversation_the_second_is_409(oa):
    """A conversation is one session, continued in place: while one response writes it, another
    is 409 session_busy and changes nothing; once the first ends, the next one runs."""
    conv = oa.conversations.create(items=[{"role": "user", "content": "Hark."}])
    with oa.responses.create(conversation=conv.id, input="Speak.", stream=True, temperature=0,
                             max_output_tokens=190, extra_body={"min_tokens": 190}) as first:  # fmt: skip
        with pytest.raises(openai.ConflictError) as refused:  # the first holds the lock once it answers
            oa.responses.create(conversation=conv.id, input="Me too.", **GREEDY)
        with pytest.raises(openai.ConflictError) as items_refused:
            oa.conversations.items.create(conv.id, items=[{"role": "user", "content": "And I."}])
        events = list(first)
    assert refused.value.body["type"] == items_refused.value.body["type"] == "session_busy"
    assert events[-1].type == "response.incomplete"  # (max_output_tokens reached: min_tokens)
    assert [i.role for i in oa.conversations.items.list(conv.id, order="asc")] == [
        "user",
        "user",
        "assistant",
    ]
    after = oa.responses.create(conversation=conv.id, input="Now me.", **GREEDY)
    assert after.status in ("completed", "incomplete") and after.usage.input_tokens_details.cached_tokens > 0


@pytest.fixture(scope="module")
def default_lease(server, redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    """The default lease (no response_lease_seconds), and a key with room for one session."""
    work = tmp_path_factory.mktemp("default-lease")
    (work / "keys").write_text(f"{KEYS[0]}\ntight-key sessions=1\n")
    with ServerProcess(server.model_dir, work, redis_url, cpu_threads=1, max_tokens=200,
                       api_keys_file=str(work / "keys")) as srv:  # fmt: skip
        yield srv


def test_the_default_lease_is_renewed_and_dropped(default_lease):
    """At the default response_lease_seconds (10): a running worker's lease ends within one lease
    of Redis's clock, the response is never failed while it runs, and its lease leaves the
    register when it ends."""
    srv, lease = default_lease, 10.0
    r = redis.Redis.from_url(srv.redis_url)
    register = srv.settings["key_prefix"] + "responses:leases"
    oa = client(srv)
    resp = oa.responses.create(input="A long tale.", background=True, temperature=0, max_output_tokens=190,
                               extra_body={"min_tokens": 190})  # fmt: skip
    ends = []
    while (status := oa.responses.retrieve(resp.id).status) in ("queued", "in_progress"):
        score, (secs, micros) = r.zscore(register, resp.id), r.time()
        if score is not None:
            ends.append(score - (secs + micros / 1e6))
        time.sleep(0.05)
    assert status == "incomplete", status  # (max_output_tokens reached: min_tokens)
    assert ends and all(0 < left <= lease for left in ends), ends
    assert r.zscore(register, resp.id) is None


def test_a_background_response_whose_final_save_fails_is_failed_at_once(default_lease):
    """Its key has room for the response's session but not for its record as well: keeping the
    record is refused as the worker ends, and the response is failed then, not left in
    progress (its lease leaves the register, so no sweep would ever fail it)."""
    r = redis.Redis.from_url(default_lease.redis_url)
    oa = client(default_lease, "tight-key")
    resp = oa.responses.create(input="Hark.", background=True, **GREEDY)
    deadline = time.monotonic() + 60
    while oa.responses.retrieve(resp.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    got = oa.responses.retrieve(resp.id)
    assert got.status == "failed" and got.error is not None, got
    assert list(oa.responses.retrieve(resp.id, stream=True))[-1].type == "response.failed"
    assert r.zscore(default_lease.settings["key_prefix"] + "responses:leases", resp.id) is None


def test_usage_splits_what_the_key_holds_by_kind(server, oa):
    """A stored response and a conversation count against the key's limits with its
    sessions, and /v1/usage says which is which (its totals are the kinds' sums)."""

    def usage() -> dict:
        got = httpx.get(server.url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
        assert got.status_code == 200, got.text
        u = got.json()
        held = u["held"]
        assert u["sessions"] == sum(h["count"] for h in held.values())
        assert u["state_bytes"] == sum(h["bytes"] for h in held.values())
        return held

    before = usage()
    r = oa.responses.create(input="Count me.", **GREEDY)
    conv = oa.conversations.create(items=[{"role": "user", "content": "And me."}])
    after = usage()
    assert after["responses"]["count"] == before["responses"]["count"] + 1
    assert after["responses"]["bytes"] > before["responses"]["bytes"]
    assert after["conversations"]["count"] == before["conversations"]["count"] + 1
    # (the response's state, and the conversation's: the session its items prefilled)
    assert after["sessions"]["count"] == before["sessions"]["count"] + 2
    assert after["sessions"]["bytes"] > before["sessions"]["bytes"]
    oa.responses.delete(r.id)
    oa.conversations.delete(conv.id)
    gone = usage()
    assert gone["responses"]["count"] == before["responses"]["count"]
    assert gone["conversations"]["count"] == before["conversations"]["count"]
    assert gone["sessions"]["count"] == before["sessions"]["count"]  # (each let go of its session)
