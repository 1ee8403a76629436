"""app/api/openai/structured.py without a server: what a body's tools and formats make of a
reply's shape, and a streamed reply's text held back from `<tool_call>` on."""

from __future__ import annotations

import pytest

from app.api.http.errors import ApiError
from app.api.openai.structured import HeldText, Shape
from model.tool_calls import Tool, ToolCall

ADD = Tool("add", "a + b", {"type": "object", "properties": {"a": {"type": "integer"}}})


def _stream(shape: Shape, pieces: list[str]) -> tuple[str, str, list[ToolCall]]:
    held = HeldText(shape)
    sent = "".join(held.feed(p) for p in pieces)
    rest, calls = held.finish()
    return sent, rest, calls


def test_text_streams_as_it_comes_and_a_call_is_held_whole():
    auto = Shape([ADD])
    # text that only looks like the start of a call goes out once the next piece tells
    assert _stream(auto, ["a <", "b and ", "<tool"]) == ("a <b and ", "<tool", [])
    sent, rest, calls = _stream(
        auto, ["Sure. <tool_", 'call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>']
    )
    assert (sent, rest, calls) == ("Sure. ", "", [ToolCall("add", '{"a": 1}')])
    # without tools offered (none), nothing is held and nothing is read as a call
    assert _stream(Shape([ADD], "none"), ["<tool_call>[]"]) == ("<tool_call>[]", "", [])


def test_a_shape_makes_the_grammar_it_asks_for():
    assert Shape().grammar() is None  # plain text: unconstrained
    assert Shape([ADD], "none").grammar() is None
    assert Shape(schema={"type": "object"}).grammar() is not None
    assert Shape([ADD], "required").grammar() is not None and Shape([ADD]).grammar() is not None
    one = Shape([ADD, Tool("sub")], parallel=False)
    text = '<tool_call>[{"name": "add", "arguments": {}}, {"name": "sub", "arguments": {}}]</tool_call>'
    assert [c.name for c in one.read(text)[1]] == ["add"]  # parallel_tool_calls false: the first


@pytest.mark.parametrize("tools, choice", [([], "required"), ([ADD], "sub"), ([ADD, ADD], "auto")])
def test_a_shape_that_cannot_be_had_is_refused(tools, choice):
    with pytest.raises(ApiError) as e:
        Shape(tools, choice)
    assert e.value.type.value == "invalid_schema"
