"""The Responses and Conversations APIs through the official `openai` SDK, against live
servers of both shipped families and a real Redis: a response continued by
previous_response_id gives what resending the whole conversation gives, prefilling only the
new input; branches are forks; store:false leaves nothing; a deleted ancestor leaves its
descendants continuable; another key sees nothing; background responses complete, cancel,
replay from starting_after, and are failed when their replica dies."""

from __future__ import annotations

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


def keys_of(server: ServerProcess) -> set[bytes]:
    r = redis.Redis.from_url(server.redis_url)
    return set(r.scan_iter(match=server.settings["key_prefix"] + "*"))


def test_chain_equals_whole_conversation_and_reuses_state(oa):
    model = oa.models.list().data[0].id
    first = oa.responses.create(model=model, input="Good morrow, fair lady.", instructions="A garden.", **GREEDY)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = oa.responses.create(
        model=model, input="What news?", previous_response_id=first.id, instructions="A garden.", **GREEDY,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's state was reused
    assert second.usage.input_tokens > second.usage.input_tokens_details.cached_tokens
    whole = oa.responses.create(
        model=model, instructions="A garden.", **GREEDY, include=["message.output_text.logprobs"], store=False,
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
    x = oa.responses.create(model=model, input="What news?", previous_response_id=first.id, instructions="A garden.", **GREEDY)
    assert x.output_text == second.output_text and x.id != second.id
    # streamed: the event sequence, numbered, ending with the same text
    events = list(oa.responses.create(model=model, input="What news?", previous_response_id=first.id,
                                      instructions="A garden.", stream=True, **GREEDY))  # fmt: skip
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == second.output_text
    assert oa.responses.retrieve(events[-1].response.id).output_text == second.output_text


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


def test_conversations(oa):
    conv = oa.conversations.create(items=[{"role": "system", "content": "A street."}], metadata={"k": "v"})
    assert oa.conversations.retrieve(conv.id).metadata == {"k": "v"}
    oa.conversations.items.create(conv.id, items=[{"role": "user", "content": "Who goes there?"}])
    r = oa.responses.create(input="Speak!", conversation=conv.id, **GREEDY)
    assert r.usage.input_tokens_details.cached_tokens > 0  # the items were prefilled already
    items = list(oa.conversations.items.list(conv.id, order="asc"))
    assert [i.role for i in items] == ["system", "user", "user", "assistant"]
    assert items[-1].content[0].text == r.output_text
    whole = oa.responses.create(
        input=[{"role": i.role, "content": i.content[0].text} for i in items[:3]], store=False, **GREEDY
    )
    assert whole.output_text == r.output_text
    oa.conversations.items.delete(items[1].id, conversation_id=conv.id)  # the state cannot un-consume it
    again = oa.responses.create(input="Speak!", conversation=conv.id, **GREEDY)
    left = [items[0], items[2], items[3]]  # so the items are prefilled anew (from a prefix, at most)
    assert again.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    resent = oa.responses.create(
        input=[*({"role": i.role, "content": i.content[0].text} for i in left), {"role": "user", "content": "Speak!"}],
        store=False, **GREEDY,
    )  # fmt: skip
    assert resent.output_text == again.output_text
    oa.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        oa.conversations.retrieve(conv.id)


def test_unsupported_fields_are_400_naming_them(oa):
    conv = oa.conversations.create()
    for extra, field in (
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"conversation": conv.id, "previous_response_id": "resp_x"}, "conversation"),
    ):
        with pytest.raises(openai.BadRequestError, match=field):
            oa.responses.create(input="x", **extra)
    assert oa.responses.create(input="x", tools=[], max_output_tokens=2).status == "incomplete"


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
    assert done.output_text == oa.responses.create(input="Tell a long tale.", temperature=0, max_output_tokens=120).output_text
    # cancel: it stops and keeps nothing more
    c = oa.responses.create(input="Another long tale.", background=True, temperature=0, max_output_tokens=200)
    assert oa.responses.cancel(c.id).status in ("cancelled", "completed", "incomplete")
    time.sleep(0.5)
    assert oa.responses.retrieve(c.id).status in ("cancelled", "completed", "incomplete")


def test_background_of_a_dead_replica_is_failed(server, redis_url, tmp_path_factory):
    """A replica killed mid-response: another replica's sweep fails it within 1.5 leases."""
    doomed = ServerProcess(server.model_dir, tmp_path_factory.mktemp("doomed"), redis_url, cpu_threads=1,
                           max_tokens=1000, api_keys=",".join(KEYS), response_lease_seconds=1.5,
                           key_prefix=server.settings["key_prefix"]).start()  # fmt: skip
    try:
        r = client(doomed).responses.create(input="A very long tale.", background=True, max_output_tokens=1000)
        doomed.kill()
    finally:
        doomed.stop()
    oa = client(server)
    deadline = time.monotonic() + 60
    while oa.responses.retrieve(r.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert oa.responses.retrieve(r.id).status == "failed"
    events = list(oa.responses.retrieve(r.id, stream=True))
    assert events[-1].type == "response.failed"


def test_chain_continues_on_another_replica_and_after_restart(server, redis_url, tmp_path_factory):
    first = client(server).responses.create(input="Good morrow.", **GREEDY)
    other = ServerProcess(server.model_dir, tmp_path_factory.mktemp("other"), redis_url, cpu_threads=1,
                          max_tokens=200, api_keys=",".join(KEYS), key_prefix=server.settings["key_prefix"])  # fmt: skip
    with other:
        second = client(other).responses.create(input="And to you.", previous_response_id=first.id, **GREEDY)
        assert second.usage.input_tokens_details.cached_tokens > 0
    with other:  # restarted: nothing in its memory
        third = client(other).responses.create(input="Farewell.", previous_response_id=second.id, **GREEDY)
        assert third.usage.input_tokens_details.cached_tokens > 0
    whole = client(server).responses.create(
        input=[{"role": "user", "content": "Good morrow."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And to you."}, {"role": "assistant", "content": second.output_text},
               {"role": "user", "content": "Farewell."}], store=False, **GREEDY)  # fmt: skip
    assert whole.output_text == third.output_text
    assert httpx.get(server.url + "/metrics").text.count("recur_response_reuse_total") >= 1
