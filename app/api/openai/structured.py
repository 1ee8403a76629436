"""What a body asks of its reply's shape, for both chat routes (chat completions and
Responses): the function tools it offers and how it may call them (`tool_choice`,
`parallel_tool_calls`), and the format of its text (`response_format`, `text.format`).

`Shape` turns them into the tools the chat template shows (model/tool_calls.py), the
grammar the reply is sampled under (model/grammar.py: compiled here, in a worker thread,
never on the event loop or the engine thread), and the reading of the reply's text back
into text and calls; and it streams a reply's text while holding back what may open a call.
Request errors (a named tool that is not offered, a schema that does not compile) are raised
as `ApiError`s or model errors that http/errors.py maps to 400 `invalid_schema`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.engine import Engine
from model.grammar import Grammar, Matcher
from model.tool_calls import OPEN as CALL_OPENS
from model.tool_calls import Tool, ToolCall, grammar, might_open, parse

from ..http.errors import ApiError, ErrorType


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Shape:
    """A reply's shape: the tools offered (shown to the model), how it may call them
    (`choice`: auto, required, none or a tool's name), and its text's JSON schema, if any
    (`json_object`: {"type": "object"})."""

    tools: list[Tool] = field(default_factory=list)
    choice: str = "auto"
    parallel: bool = True
    schema: Mapping[str, Any] | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ApiError(ErrorType.invalid_schema, "tools: two tools have the same name")
        if self.choice not in ("auto", "none", "required") and self.choice not in names:
            raise ApiError(ErrorType.invalid_schema, f"tool_choice: {self.choice!r} names no tool in tools")
        if self.choice == "required" and not self.tools:
            raise ApiError(ErrorType.invalid_schema, "tool_choice: required needs tools")

    @property
    def offered(self) -> list[Tool]:
        """The tools the model is shown (none under tool_choice none)."""
        return [] if self.choice == "none" else self.tools

    @property
    def calls(self) -> bool:
        """Whether the reply may call (and so is read for calls)."""
        return bool(self.offered)

    def grammar(self) -> Grammar | None:
        """The grammar the reply is sampled under, if any: a call under required or a named
        choice, a call or (JSON) text under auto, the text's schema without tools."""
        if self.calls:
            tools = [t for t in self.tools if self.choice in ("auto", "required", t.name)]
            required = self.choice != "auto"
            parallel = self.parallel and self.choice in ("auto", "required")
            return grammar(tools, required=required, parallel=parallel, text_schema=self.schema)
        if self.schema is not None:
            return Grammar.json_schema(self.schema, strict=self.strict)
        return None

    async def matcher(self, engine: Engine) -> Matcher | None:
        """The grammar compiled for the served tokenizer, in a worker thread."""
        g = self.grammar()
        if g is None:
            return None
        if not engine.grammars.supported:
            raise ApiError(
                ErrorType.invalid_schema,
                "this model's tokenizer cannot be constrained by a grammar: tools and response formats "
                "need a subword or byte tokenizer",
            )
        return await asyncio.to_thread(engine.grammars.matcher, g)

    def read(self, text: str) -> tuple[str, list[ToolCall]]:
        """A reply's text and its calls (only where calls may be made; at most one unless parallel)."""
        if not self.calls:
            return text, []
        content, calls = parse(text, [t.name for t in self.offered])
        return content, calls if self.parallel else calls[:1]


class HeldText:
    """A streamed reply's text, less what may be a call: everything from `<tool_call>` on
    (and an end that may begin it) is held until the reply ends and is read whole."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.text = ""
        self.sent = 0
        self.opened = False

    def feed(self, text: str) -> str:
        self.text += text
        if not self.shape.calls:
            return self._release(len(self.text))
        if self.opened:
            return ""
        at = self.text.find(CALL_OPENS, self.sent)
        if at >= 0:
            self.opened = True
            return self._release(at)
        return self._release(len(self.text) - might_open(self.text[self.sent :]))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text still held (when no call was made) and the calls."""
        _, calls = self.shape.read(self.text)
        if calls:
            return "", calls
        return self._release(len(self.text)), []

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(end, self.sent)
        return out


def tools_of(entries: Sequence[tuple[str, str | None, Mapping[str, Any] | None, bool | None]]) -> list[Tool]:
    """Tools from (name, description, parameters, strict) as a body gives them."""
    out = []
    for name, description, parameters, strict in entries:
        if parameters is not None and not isinstance(parameters.get("type", "object"), str):
            raise ApiError(ErrorType.invalid_schema, f"tools: {name}'s parameters' type is not a string")
        out.append(Tool(name, description or "", parameters, bool(strict)))
    return out
