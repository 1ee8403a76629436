"""Function tools in a chat model's own format: how a conversation's tools, tool calls and
tool results reach the chat template, how a reply's tool calls are read back, and the grammar
that makes a reply a tool call (model/grammar.py).

A chat template that knows tools (HF's convention: it reads a `tools` variable, and
messages with `tool_calls` and the `tool` role) is given them as they are. One that does not
(SmolLM2's, which only writes roles and contents) gets them in the system prompt its model
was taught function calling with (SmolLM2's model card: the tools as JSON in `<tools>`, the
calls as a JSON list in `<tool_call>`), its assistant's calls written as that text and its
tool results as messages of the `tool` role, in `<tool_response>` tags (Hermes' format:
without them SmolLM2-135M calls the tool again rather than answer from its result).

Either way a reply calls tools by writing

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

(one call, or a list of them; a single object is read as well, as Hermes-style templates
write one per tag). `parse` splits a reply into its text and its calls; `grammar` is the Lark
grammar of such a reply, its arguments valid against each tool's parameters, for a request
that requires a call (or names one). Under `auto`, `grammar` lets the reply be free text,
or, once it opens `<tool_call>`, a well-formed call.

This module knows nothing of HTTP: the calls' ids and OpenAI's shapes are the API's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .chat_template import ChatTemplate, ChatTemplateError
from .grammar import JSON_OPTIONS, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"

# SmolLM2's function-calling prompt (its model card), the tools where `{tools}` is
SYSTEM_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, point it out and refuse to answer.
If the given question lacks the parameters required by the function, also point it out.

You have access to the following tools:
<tools>{tools}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no function call is needed, please make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


class ToolError(ValueError):
    """Tools that cannot be made into a grammar as given."""


@dataclass(frozen=True)
class Tool:
    """A function a reply may call: its name, what it does, and its parameters' JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None
    strict: bool = False

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        out["parameters"] = dict(self.parameters) if self.parameters is not None else {"type": "object"}
        return out


@dataclass(frozen=True)
class ToolCall:
    """A call a reply made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def calls_text(calls: Sequence[ToolCall]) -> str:
    """Calls as a reply writes them (an assistant message of the conversation, rendered back)."""
    items = [f'{{"name": {json.dumps(c.name)}, "arguments": {_compact(c.arguments)}}}' for c in calls]
    return f"{OPEN}[{', '.join(items)}]{CLOSE}"


def _compact(arguments: str) -> str:
    """Arguments as the grammar writes JSON (", " and ": "), whatever spacing the client
    sent; arguments that are not JSON (a client's own history may hold any text) as they are."""
    try:
        return json.dumps(json.loads(arguments or "{}"), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments


def knows_tools(template: ChatTemplate) -> bool:
    """Whether a template renders tools itself (HF's convention: it reads `tools`)."""
    return re.search(r"\btools\b", template.source) is not None


def conversation(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages (HF's convention: an assistant's `tool_calls` as
    [{"function": {"name", "arguments"}}], a `tool` message's `content` its result) and the
    template variables that render them, with `tools` offered, in the template's own way."""
    if knows_tools(template):
        variables = {"tools": [{"type": "function", "function": t.as_json()} for t in tools]} if tools else {}
        return [_native(m) for m in messages], variables
    tool_role = "tool" if _takes_tool_role(template) else "user"
    out = [_written(m, tool_role) for m in messages]
    if tools:
        prompt = SYSTEM_PROMPT.format(tools=json.dumps([t.as_json() for t in tools], ensure_ascii=False))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _calls(m: Mapping[str, Any]) -> list[ToolCall]:
    return [
        ToolCall(str(c["function"]["name"]), str(c["function"].get("arguments") or "{}"))
        for c in m.get("tool_calls") or []
    ]


def _native(m: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(m)
    if m.get("tool_calls"):  # HF templates read arguments as a mapping (text that is not JSON stays text)
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": _mapping(c.arguments)}}
            for c in _calls(m)
        ]
    return out


def _mapping(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments


@lru_cache(maxsize=8)
def _takes_tool_role(template: ChatTemplate) -> bool:
    """Whether a template that knows no tools still renders a `tool` message (SmolLM2's
    writes any role; the play-script refuses one it has no part for)."""
    try:
        template.render([{"role": "user", "content": "."}, {"role": "tool", "content": "."}])
        return True
    except ChatTemplateError:
        return False


def _written(m: Mapping[str, Any], tool_role: str) -> dict[str, Any]:
    """A message as a template that knows no tools reads it: role and content text; a tool's
    result in Hermes' `<tool_response>` tags (SmolLM2 answers from them, where a bare result
    makes it call again), as `tool_role`'s message (`user` where the template refuses `tool`)."""
    calls = _calls(m)
    content, role = str(m.get("content") or ""), str(m["role"])
    if calls:
        content = f"{content}{calls_text(calls)}"
    if role == "tool":
        content, role = f"{RESULT_OPEN}{content}{RESULT_CLOSE}", tool_role
    out = {"role": role, "content": content}
    if m.get("name"):
        out["name"] = str(m["name"])
    return out


# -- reading a reply ---------------------------------------------------------------------------
def parse(text: str, names: Sequence[str] | None = None) -> tuple[str, list[ToolCall]]:
    """A reply's text before its first `<tool_call>`, and the calls it makes (none when it
    makes no well-formed call, or calls a tool not in `names`: the text is then the reply)."""
    at = text.find(OPEN)
    if at < 0:
        return text, []
    calls: list[ToolCall] = []
    for block in re.finditer(
        re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", text[at:], re.DOTALL
    ):
        found = _read(block.group(1))
        if found is None:
            return text, []
        calls += found
    if names is not None and any(c.name not in names for c in calls):
        return text, []
    return text[:at].strip(), calls


def _read(body: str) -> list[ToolCall] | None:
    try:
        value = json.loads(body.strip() or "[]")
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # (some models write the arguments as a JSON string)
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def might_open(text: str) -> int:
    """How many characters at the end of `text` may begin `<tool_call>` (a stream holds
    them back until the next tokens tell)."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


# -- the grammar of a reply that calls ---------------------------------------------------------
def grammar(
    tools: Sequence[Tool],
    *,
    required: bool,
    parallel: bool = True,
    text_schema: Mapping[str, Any] | None = None,
) -> Grammar:
    """The Lark grammar of a reply that calls `tools` (their arguments valid against their
    parameters; a strict tool's exactly, another's leniently), one call or, `parallel`, a
    list of them; not `required`, the reply may be free text instead (that does not open
    `<tool_call>`), or with `text_schema` JSON valid against it."""
    if not tools:
        raise ToolError("a tool call needs at least one tool")
    rules = []
    for i, t in enumerate(tools):
        schema = {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": {**JSON_OPTIONS, "lenient": not t.strict},
        }
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    calls = 'call ("," " " call)*' if parallel else "call"
    start = "start: tool_calls" if required else "start: tool_calls | text"
    start += f'\ntool_calls: "{OPEN}[" {calls} "]{CLOSE}"'
    if not required and text_schema is not None:
        start += f"\ntext: %json {json.dumps({**text_schema, 'x-guidance': JSON_OPTIONS})}"
    elif not required:
        # free text: anything whose start is not "<" (the model's calls open with "<tool_call>")
        start += "\ntext: TEXT\nTEXT: /[^<](.|\\n)*/"
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))
    return Grammar.lark("\n".join([start, call, *rules]), "the tools' parameters")


def _parameters(t: Tool) -> dict[str, Any]:
    p = dict(t.parameters) if t.parameters else {"type": "object"}
    if p.get("type") is None and "properties" in p:
        p["type"] = "object"
    return p
