"""Real OpenAI clients against a live `recur serve` of the shipped model: the official
`openai` SDK and LangChain's `langchain-openai` (its `OpenAI` and `ChatOpenAI` classes, with
`invoke`, `stream` and `batch`), used as their own documentation shows, with nothing but
`base_url` pointed at recur. What the routes mean in detail is tested in
test_completions.py and test_chat_completions.py; here, that the clients work."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAI

from model.chat_template import play_script
from tests.app.servers import serve
from tests.conftest import ServerProcess

MODEL = "shakespeare"


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    yield from serve(MODEL, redis_url, tmp_path_factory, max_tokens=200)


# -- the openai SDK -------------------------------------------------------------------------
def test_sdk_completions_streamed_or_not_with_logprobs_and_stop(oa):
    body = {"model": MODEL, "prompt": "Romeo.\n", "max_tokens": 60, "seed": 4, "stop": ["\n"]}
    c = oa.completions.create(**body, logprobs=2)  # type: ignore[call-overload]
    (choice,) = c.choices
    assert choice.finish_reason == "stop" and "\n" not in choice.text  # the stop is left out, OpenAI's way
    lp = choice.logprobs  # every sampled token's, the stop's too: the session consumed it
    assert lp is not None and "".join(lp.tokens) == choice.text + "\n"
    assert len(lp.token_logprobs) == c.usage.completion_tokens
    assert lp.top_logprobs is not None and all(len(alts) <= 2 for alts in lp.top_logprobs)
    stream = oa.completions.create(**body, stream=True)  # type: ignore[call-overload]
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == choice.text
    kept = oa.completions.create(**body, extra_body={"include_stop_str_in_output": True})  # type: ignore[call-overload]
    assert kept.choices[0].text == choice.text + "\n"
    # echo puts the prompt first, with or without log-probs
    assert oa.completions.create(**body, echo=True).choices[0].text == "Romeo.\n" + choice.text  # type: ignore[call-overload]


def test_sdk_chat_streamed_or_not_with_logprobs_and_stop(oa):
    messages = [{"role": "user", "content": "Good morrow."}]
    c = oa.chat.completions.create(
        model=MODEL, messages=messages, seed=3, logprobs=True, top_logprobs=0, stop=["e"]
    )
    (choice,) = c.choices
    assert choice.finish_reason == "stop" and "e" not in choice.message.content  # chat leaves the stop out
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.top_logprobs for t in choice.logprobs.content] == [[]] * c.usage.completion_tokens
    stream = oa.chat.completions.create(model=MODEL, messages=messages, seed=3, stop=["e"], stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == choice.message.content
    # top_logprobs (which implies logprobs): the most probable alternatives, most probable first;
    # greedy, the first is the token
    g = oa.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, top_logprobs=3
    )
    tokens = g.choices[0].logprobs.content  # type: ignore[union-attr]
    assert tokens is not None and len(tokens) == 8
    for t in tokens:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True
        )


def test_sdk_n_2_on_both_routes_streamed_or_not(oa):
    """`n=2`: two choices, each in a session of its own; streamed, the SDK's chunks carry
    each choice's index and add up to the same texts (choice j samples with seed 8 + j)."""
    body = {"model": MODEL, "n": 2, "seed": 8, "max_tokens": 30}
    c = oa.completions.create(prompt="JULIET:\n", **body)  # type: ignore[call-overload]
    chat = oa.chat.completions.create(messages=[{"role": "user", "content": "Good night."}], **body)  # type: ignore[call-overload]
    for result in (c, chat):
        assert [ch.index for ch in result.choices] == [0, 1]
        assert result.choices[0].session["id"] == result.session_id != result.choices[1].session["id"]  # type: ignore[attr-defined]
        assert result.usage.completion_tokens <= 2 * 30
    stream = oa.completions.create(prompt="JULIET:\n", stream=True, **body)  # type: ignore[call-overload]
    texts = ["", ""]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in c.choices]
    stream = oa.chat.completions.create(  # type: ignore[call-overload]
        messages=[{"role": "user", "content": "Good night."}], stream=True, **body
    )
    texts = ["", ""]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [ch.message.content for ch in chat.choices]


def test_sdk_continues_a_session_by_header_or_body(oa, http):
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Who is there?"}], max_tokens=20, seed=0
    )
    sid = raw.headers["x-session-id"]
    n = raw.parse().session["n_tokens"]  # type: ignore[attr-defined]
    more = [{"role": "user", "content": "Speak."}]
    by_header = oa.chat.completions.create(
        model=MODEL, messages=more, max_tokens=5, extra_headers={"X-Session-Id": sid}
    )
    by_body = oa.completions.create(model=MODEL, prompt="\n", max_tokens=5, extra_body={"session_id": sid})
    assert by_header.session_id == by_body.session_id == sid  # type: ignore[attr-defined]
    spoken = len(play_script().render(more).encode())
    assert http.get(f"/v1/sessions/{sid}").json()["n_tokens"] == n + spoken + 5 + 1 + 5


def test_sdk_stateless_chat_resends_the_conversation(oa, http):
    """A chatbot loop as the SDK's docs write it: the whole conversation each turn, the
    reply appended as returned. Each turn's session holds exactly what the next turn resends
    before its new message."""
    messages: list = [{"role": "system", "content": "Enter Romeo and Juliet."}]
    previous: list[int] = []
    for line in ["Good morrow, fair saint.", "What light is this?", "Farewell."]:
        messages.append({"role": "user", "content": line})
        c = oa.chat.completions.create(
            model=MODEL, messages=messages, temperature=0.7, seed=11, max_tokens=80
        )
        reply = c.choices[0].message
        assert reply.role == "assistant" and "\ufffd" not in (reply.content or "")
        messages.append({"role": reply.role, "content": reply.content})
        t = http.get(f"/v1/sessions/{c.session_id}/transcript").json()  # type: ignore[attr-defined]
        consumed = [i for seg in t["segments"] for i in seg["ids"]]
        assert consumed[: len(previous)] == previous  # this turn began with all the last one consumed
        previous = consumed


# -- LangChain --------------------------------------------------------------------------------
def test_langchain_openai_invoke_stream_and_batch(server):
    llm = OpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, max_tokens=12, temperature=0)
    text = llm.invoke("Romeo.\n")  # sends prompt: ["Romeo.\n"]
    assert isinstance(text, str) and len(text.encode()) == 12
    assert "".join(llm.stream("Romeo.\n")) == text
    # a batch is one request with an array of prompts: a choice each, in order
    assert llm.batch(["Juliet.\n", "Romeo.\n"]) == [llm.invoke("Juliet.\n"), text]


def test_langchain_chat_openai_invoke_stream_and_batch(server):
    chat = ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model=MODEL, max_tokens=40, temperature=0
    )
    conversation = [SystemMessage("Enter Romeo."), HumanMessage("But soft, what light?")]
    reply = chat.invoke(conversation)
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] > 0
    chunks = list(chat.stream(conversation))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(str(c.content) for c in chunks) == reply.content
    replies = chat.batch([conversation, [HumanMessage("Who is there?")]])
    assert [r.content for r in replies][0] == reply.content and all(isinstance(r, AIMessage) for r in replies)
    # the conversation goes on with the reply as LangChain keeps it
    follow = chat.invoke([*conversation, reply, HumanMessage("Speak again.")])
    assert isinstance(follow, AIMessage)
