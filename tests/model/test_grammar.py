"""model/grammar.py and model/tool_calls.py without a server: whatever a sampler draws
under a grammar's mask (here: uniformly random logits, the worst a model can do) parses and
validates, for a JSON schema and for tool calls; a reply's calls read back; errors are
`GrammarError` / `ToolError`. The byte tokenizer keeps it cheap; tests/app/test_tools.py
runs the same against SmolLM2's tokenizer through the server."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import BaseModel, Field

from model.chat_template import ChatTemplate
from model.grammar import Grammar, GrammarError, Grammars, Matcher, fill, mask_logits
from model.tokenizer import ByteTokenizer
from model.tool_calls import (
    Tool,
    ToolCall,
    ToolError,
    calls_text,
    conversation,
    grammar,
    parse,
)

TOK = ByteTokenizer()
GRAMMARS = Grammars(TOK)


class Point(BaseModel):
    label: str = Field(max_length=6)
    x: int = Field(ge=-50, le=50)
    ok: bool


WEATHER = Tool(
    "get_weather", "the weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                   "required": ["city"], "additionalProperties": False}, strict=True,
)  # fmt: skip
ADD = Tool(
    "add",
    "a + b",
    # (closed: an open object lets random logits add keys with endless strings)
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 999}},
        "required": ["a"],
        "additionalProperties": False,
    },
)


def _sample(matcher: Matcher, seed: int, limit: int = 400) -> str:
    """Draw tokens at random among those the grammar allows, two rows a step (the other row
    unconstrained), until EOS."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(limit):
        logits = mask_logits(
            torch.randn(2, TOK.vocab_size, generator=g), [1], fill([matcher], TOK.vocab_size)
        )
        assert torch.isfinite(logits[0]).all()  # the unconstrained row is untouched
        allowed = torch.isfinite(logits[1]).nonzero()[:, 0]
        t = int(allowed[torch.randint(len(allowed), (), generator=g)])
        if t == TOK.eos_id:
            assert matcher.done
            return TOK.decode(ids)
        assert matcher.consume(t), matcher.error
        ids.append(t)
    raise AssertionError(f"no EOS in {limit} tokens: {TOK.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(20))
def test_a_json_schema_answer_always_validates(seed):
    m = GRAMMARS.matcher(Grammar.json_schema({**Point.model_json_schema(), "additionalProperties": False}))
    Point.model_validate_json(_sample(m, seed))


@pytest.mark.parametrize("seed", range(10))
def test_a_required_tool_call_always_parses(seed):
    m = GRAMMARS.matcher(grammar([WEATHER, ADD], required=True, parallel=seed % 2 == 0))
    content, calls = parse(_sample(m, seed), ["get_weather", "add"])
    assert content == "" and calls and (seed % 2 == 0 or len(calls) == 1)
    for c in calls:
        args = json.loads(c.arguments)
        assert set(args) == ({"city"} if c.name == "get_weather" else {"a"})


def test_auto_lets_text_or_a_call_through():
    m = GRAMMARS.matcher(grammar([WEATHER], required=False))
    for text in (
        b"Hello there",
        b'<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>',
    ):
        fork = m.fork()
        assert all(fork.consume(b) for b in text), text
    refused = m.fork()
    assert all(refused.consume(b) for b in b"<tool_c")
    assert not refused.consume(ord("x"))  # once "<tool_call>" is begun, only a call


def test_calls_read_back_and_render_as_the_model_writes_them():
    text = 'Sure. <tool_call>[{"name": "add", "arguments": {"a": 2}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    content, calls = parse(text, ["add", "get_weather"])
    assert content == "Sure." and [c.name for c in calls] == ["add", "get_weather"]
    assert calls_text(calls) == text[len("Sure. ") :]
    assert parse('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')[1] == [
        ToolCall("add", '{"a": 1}')
    ]
    assert parse("<tool_call>[not json", ["add"]) == ("<tool_call>[not json", [])  # plain text
    assert parse('<tool_call>[{"name": "rm", "arguments": {}}]</tool_call>', ["add"])[1] == []  # not offered


def test_a_template_without_tools_gets_them_in_its_system_prompt():
    plain = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
    messages, variables = conversation(
        plain,
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "content": "2", "tool_call_id": "c"}],
        [ADD],
    )  # fmt: skip
    assert variables == {} and messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>'
    assert messages[3] == {"role": "tool", "content": "<tool_response>2</tool_response>"}
    refusing = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no') }}{% endif %}{% endfor %}"
    )
    assert conversation(refusing, [{"role": "tool", "content": "2"}], [])[0][0]["role"] == "user"
    knowing = ChatTemplate("{{ tools | length }}{% for m in messages %}{{ m.role }}{% endfor %}")
    messages, variables = conversation(knowing, [{"role": "user", "content": "hi"}], [ADD])
    assert variables["tools"][0]["function"]["name"] == "add" and messages == [
        {"role": "user", "content": "hi"}
    ]


def test_errors_are_typed():
    with pytest.raises(GrammarError, match="JSON schema"):
        GRAMMARS.matcher(Grammar.json_schema({"type": "nope"}))
    with pytest.raises(GrammarError):
        GRAMMARS.matcher(
            grammar([Tool("f", "", {"type": "object", "properties": {"a": {"type": 3}}})], required=True)
        )
    with pytest.raises(ToolError):
        grammar([], required=True)
    # a client's history may hold arguments that are not JSON: they render as they are
    assert (
        calls_text([ToolCall("f", "{oops")]) == '<tool_call>[{"name": "f", "arguments": {oops}]</tool_call>'
    )
