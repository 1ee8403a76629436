"""Issue 44, items 2-3: function tools and structured output against a live `recur serve
--model smollm2` (the shipped SmolLM2-135M-Instruct), through real clients: the OpenAI Agents
SDK (a tool round trip on its Responses model), LangChain's `bind_tools` and
`with_structured_output`, and the openai SDK (`chat.completions.parse` with a pydantic
model, tool_choice none/required/named, parallel_tool_calls, streamed tool-call deltas,
function_call items across previous_response_id and conversations). A constrained answer
always parses and validates against its schema. One server for the module.

SmolLM2-135M seldom chooses a tool by itself (`auto`): where a call is the point, the tests
ask for one (`required`, or the tool by name), which a grammar then makes well-formed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.app.servers import serve
from tests.conftest import ServerProcess

# the slow suite (CI runs it): a SmolLM2 server and some 60 generations take minutes of
# make test's 10; tests/model/test_grammar.py and tests/app/test_structured.py stay in it
pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    """A city, in a schema whose every answer ends within a few dozen tokens."""

    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)
    capital: bool


CITY_SCHEMA = {**City.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    yield from serve(MODEL, redis_url, tmp_path_factory, max_tokens=200, max_batch_size=10)


@pytest.fixture(scope="module")
def oa(server) -> openai.OpenAI:
    return server.openai()


# -- chat completions -------------------------------------------------------------------------
def test_tool_choice_named_and_none(oa):
    tools = [WEATHER, ADD]
    named = oa.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls or []  # one call: parallel_tool_calls false
    assert call.function.name == "add"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}  # its parameters, as the grammar made them
    none = oa.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, tool_choice="none", max_tokens=20
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    assert none.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(oa):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, ADD], "tool_choice": "required"}
    choice = oa.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls"
    whole = choice.message.tool_calls or []
    for call in whole:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "add") and isinstance(
            json.loads(call.function.arguments), dict
        )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oa.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            if d.id is not None:  # only the first delta of a call has its id, type and name
                assert d.type == "function" and d.function.name and call["id"] == d.id
            call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole
    ]


def test_response_format_json_schema_and_json_object(oa):
    parsed = oa.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}], response_format=City
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City)
    obj = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=12,
    )  # fmt: skip
    assert (obj.choices[0].message.content or "").startswith("{")  # (cut short at 12 tokens, or whole)


def _city_answers(oa: openai.OpenAI, seeds: int) -> list[str]:
    """`seeds` sampled answers (temperature 1, seeds 0..) under the City schema, n at a time
    (the constrained rows share their batch)."""
    answers = []
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY_SCHEMA}}
    for first in range(0, seeds, 10):
        c = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a city."}], response_format=fmt,  # type: ignore[arg-type]
            temperature=1.0, seed=first, n=min(10, seeds - first), max_tokens=120,
        )  # fmt: skip
        for choice in c.choices:
            assert choice.finish_reason == "stop", (
                choice.message.content
            )  # it ended: the grammar was complete
            answers.append(choice.message.content or "")
    return answers


def test_every_json_schema_answer_validates(oa):
    for text in _city_answers(oa, 5):
        City.model_validate_json(text)


@pytest.mark.slow
def test_every_json_schema_answer_validates_over_50_seeds(oa):
    answers = _city_answers(oa, 50)
    assert len(answers) == 50
    for text in answers:
        City.model_validate_json(text)


def test_bad_tools_and_schemas_are_clear_errors(server):
    bad = [
        {"tool_choice": "required"},  # no tools
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [{"type": "function", "function": {"name": "has space"}}]},
        {"tools": [{"type": "retrieval"}]},
        {"tools": [WEATHER, WEATHER]},
        {"response_format": {"type": "json_schema"}},  # (422)
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 3}}}}}],
            "tool_choice": "required",
        },
    ]  # fmt: skip
    for extra in bad:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        # 400 invalid_schema: a reply's shape that cannot be had; 422: a body not of the documented shape
        assert (r.status_code, r.json()["error"]["type"]) in (
            (400, "invalid_schema"),
            (422, "invalid_request"),
        ), (
            extra,
            r.text,
        )
        assert r.json()["error"]["message"], extra
    rb = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    for extra in [
        {"tool_choice": "required"},
        {"tools": [{"type": "web_search"}]},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
    ]:
        r = httpx.post(server.url + "/v1/responses", json={**rb, **extra}, timeout=60)
        assert r.status_code in (400, 422) and r.json()["error"]["message"], (extra, r.text)


# -- the Responses API ------------------------------------------------------------------------
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]


def test_function_calls_across_previous_response_id_and_conversations(oa):
    first = oa.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[RESPONSES_WEATHER], tool_choice="required",  # type: ignore[list-item]
        instructions="You are a helpful assistant.",
    )  # fmt: skip
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    assert first.tools and first.tool_choice == "required"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = oa.responses.create(
        model=MODEL, previous_response_id=first.id, input=[output], tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
        instructions="You are a helpful assistant.", max_output_tokens=30,
    )  # fmt: skip
    assert second.output_text and not [o for o in second.output if o.type == "function_call"]
    # in a conversation: the call and its output are items of it, and the next turn reads them
    conv = oa.conversations.create()
    asked = oa.responses.create(
        model=MODEL, conversation=conv.id, input="What is the weather in Rome?", tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
        tool_choice="required",
    )  # fmt: skip
    (call,) = [o for o in asked.output if o.type == "function_call"]
    oa.responses.create(
        model=MODEL, conversation=conv.id, max_output_tokens=30, tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rainy, 12 C"}],
    )  # fmt: skip
    kinds = [i.type for i in oa.conversations.items.list(conv.id, order="asc").data]
    assert kinds[:3] == ["message", "function_call", "function_call_output"] and kinds[-1] == "message"


def test_streamed_function_call_events_and_text_format(oa):
    events = list(
        oa.responses.create(
            model=MODEL, input="What is the weather in Paris?", tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"}, stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    done = events[-1].response.output[0]
    assert done.type == "function_call" and json.loads(done.arguments) == json.loads(events[4].arguments)
    fmt = {"type": "json_schema", "name": "city", "strict": True, "schema": CITY_SCHEMA}
    r = oa.responses.create(model=MODEL, input="Describe Rome.", text={"format": fmt})  # type: ignore[typeddict-item]
    City.model_validate_json(r.output_text)
    assert r.text.format.type == "json_schema"


def test_the_agents_sdk_completes_a_tool_round_trip(server):
    """An Agent with one function tool on the SDK's default model class (the Responses API):
    a call, its result, a final answer. `tool_choice="required"` makes the first turn call
    (SmolLM2-135M seldom chooses to); the SDK then resets it to auto (its reset_tool_choice
    default), so the model answers from the result."""
    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="Assistant", instructions="You are a helpful assistant.", tools=[get_weather],
            model=OpenAIResponsesModel(model=MODEL, openai_client=client),
            model_settings=ModelSettings(tool_choice="required"),
        )  # fmt: skip
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert seen == ["Paris"]
    kinds = [type(i).__name__ for i in result.new_items]  # type: ignore[attr-defined]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert "sunny" in str(result.final_output).lower()  # type: ignore[attr-defined]


# -- LangChain --------------------------------------------------------------------------------
@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny, 21 C in {city}"


class Answer(BaseModel):
    """An answer and how sure of it one is."""

    answer: str = Field(max_length=40)
    confidence: Literal["low", "medium", "high"]


def test_langchain_bind_tools_and_with_structured_output(server):
    chat = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", max_retries=0)  # type: ignore[arg-type]
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    asked = bound.invoke([question])
    (call,) = asked.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and call["args"]["city"]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = chat.bind_tools([get_weather]).invoke([question, asked, result])
    assert isinstance(final.content, str) and final.content
    structured = chat.with_structured_output(Answer).invoke("What is the capital of France?")
    assert isinstance(structured, Answer)
