"""Two more clients of the Responses API against a live `recur serve` of the shipped model,
used as their documentation shows with only `base_url` pointed at recur: the OpenAI Agents
SDK (an Agent on the Responses model, two turns linked by previous_response_id), and
LangChain's ChatOpenAI with `use_responses_api`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
from langchain_openai import ChatOpenAI

from tests.app.servers import serve
from tests.conftest import ServerProcess

MODEL = "shakespeare"


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    # (room for a greedy reply to reach the turn stop: one cut at max_tokens is `incomplete`)
    yield from serve(MODEL, redis_url, tmp_path_factory, max_tokens=400)


def test_agents_sdk_two_turns_by_previous_response_id(server):
    set_tracing_disabled(True)  # (no traces sent anywhere)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="Juliet",
        instructions="A balcony, by night.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        # greedy: the same reply every run, which ends at the turn stop (sampled, a reply may
        # run to the server's max_tokens: `incomplete`, which the SDK raises as an error)
        model_settings=ModelSettings(temperature=0),
    )

    async def two_turns() -> tuple:
        first = await Runner.run(agent, "Good even, lady.")
        second = await Runner.run(agent, "What light is that?", previous_response_id=first.last_response_id)
        return first, second

    first, second = asyncio.run(two_turns())
    assert isinstance(first.final_output, str) and isinstance(second.final_output, str)
    oa = server.openai()
    stored = oa.responses.retrieve(second.last_response_id)
    assert stored.previous_response_id == first.last_response_id
    assert stored.usage.input_tokens_details.cached_tokens > 0  # the first turn's state was continued
    assert stored.output_text == second.final_output


def test_langchain_responses_api(server):
    chat = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=20,
        use_responses_api=True, max_retries=0,
    )  # fmt: skip
    first = chat.invoke("Good morrow.")
    assert isinstance(first.text, str) and first.response_metadata["id"].startswith("resp_")
    streamed = "".join(chunk.text for chunk in chat.stream("Good morrow."))
    assert streamed == first.text
    follow = chat.invoke("And then?", previous_response_id=first.response_metadata["id"])
    assert follow.usage_metadata["input_token_details"].get("cache_read", 0) > 0
