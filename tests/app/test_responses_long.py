"""A Responses chain or a conversation outlives the prompt limit (issue 41): the limit bounds
what one turn prefills, never the conversation's total. A chain used to re-render the whole
conversation and hold it to `max_prompt_tokens`, so it died at that many tokens in all
(8,192 by default: turn 127 of a real chain), however short its turns, and could never be
continued again. Here the limit is 200 tokens and the chain runs past 600."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from model.chat_template import play_script
from tests.app.servers import serve
from tests.conftest import TINY, ServerProcess
from tests.sensitive import write_sensitive

LIMIT = 200
TURN = {"temperature": 0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("long") / "tiny"
    write_sensitive(path, seed=0, chat_template=play_script(), **TINY)
    yield from serve(path, redis_url, tmp_path_factory, max_prompt_tokens=LIMIT, max_tokens=64)


def test_a_chain_runs_past_the_prompt_limit(server):
    oa = server.openai()
    previous, total = None, 0
    for turn in range(20):
        r = oa.responses.create(input=f"Line {turn}: what news?", previous_response_id=previous, **TURN)
        assert r.status in ("completed", "incomplete")
        if previous is not None:  # the previous response's state was continued
            assert r.usage.input_tokens_details.cached_tokens > 0
            assert r.usage.input_tokens - r.usage.input_tokens_details.cached_tokens < LIMIT
        previous, total = r.id, r.usage.input_tokens + r.usage.output_tokens
    assert total > 3 * LIMIT
    with pytest.raises(openai.APIStatusError) as refused:  # a turn's own input is still bounded
        oa.responses.create(input="x" * (LIMIT + 50), previous_response_id=previous, **TURN)
    assert refused.value.status_code == 413 and "new tokens" in refused.value.body["message"]


def test_a_conversation_runs_past_the_prompt_limit(server):
    oa = server.openai()
    conv = oa.conversations.create(items=[{"role": "system", "content": "A street in Verona."}])
    for turn in range(16):
        oa.conversations.items.create(conv.id, items=[{"role": "user", "content": f"Hark, {turn}!"}])
        r = oa.responses.create(input="Speak.", conversation=conv.id, **TURN)
        assert r.usage.input_tokens_details.cached_tokens > 0
    assert r.usage.input_tokens + r.usage.output_tokens > 3 * LIMIT


@pytest.mark.slow  # (300 turns of each: a minute or two)
def test_300_turn_chains_and_conversations_continue_to_the_end(server):
    """Issue 41: a chain of 300 `previous_response_id` turns, and a conversation of 300,
    continue to the end, every turn from the state the one before committed (its tokens
    cached, only its own prefilled), far past the kept versions of the chain's one session
    (its holders and pruning over 300 commits)."""
    oa = server.openai()
    previous, held = None, 0
    for turn in range(300):
        r = oa.responses.create(input=f"Line {turn}.", previous_response_id=previous, **TURN)
        assert r.status in ("completed", "incomplete"), (turn, r.error)
        if previous is not None:
            assert r.usage.input_tokens_details.cached_tokens >= held - 1, turn
        previous, held = r.id, r.usage.input_tokens + r.usage.output_tokens
    conv = oa.conversations.create(items=[{"role": "system", "content": "A street in Verona."}])
    for turn in range(300):
        r = oa.responses.create(input=f"Line {turn}.", conversation=conv.id, **TURN)
        assert r.status in ("completed", "incomplete"), (turn, r.error)
        if turn:
            assert r.usage.input_tokens_details.cached_tokens > 0, turn
    assert r.usage.input_tokens > 300 * 5
