"""The Responses API's shapes: a body's Response object at each status, and a generation's
event sequence (`response.created` ... `response.completed`), which the route streams,
drains, or hands to a background worker (app/sessions/background.py) to keep.

Events are plain dicts as the API sends them; `sequence_number` is set by whoever sends
them (the route counts, the worker keeps). It never builds an error body and never knows
the model family.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from app.engine import TokenEvent
from app.sessions import Begun
from app.store import new_object_id
from model.tool_calls import ToolCall

from ..http import errors
from .framing import StopText
from .responses_schemas import Output, ResponseCreate, ResponseObject, ResponseStatus, TextOut
from .structured import HeldText, Shape, call_id

_OUTPUT = TypeAdapter(Output)  # (a reply's items, built as the events carry them)


@dataclass
class ResponseFramer:
    """What every body of one response repeats, and its token log-probs' shape."""

    id: str
    body: ResponseCreate
    model: str
    token_text: Callable[[int], str] | None  # with logprobs: the text of a token id
    shape: Shape = field(default_factory=Shape)
    top: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    item_id: str = field(default_factory=lambda: new_object_id("msg"))

    def response(
        self, status: ResponseStatus, output: list[dict] | None = None, **extra: Any
    ) -> ResponseObject:
        """The Response object at `status` (`extra`: its usage, error, incomplete_details)."""
        b = self.body
        conversation = (
            b.conversation if isinstance(b.conversation, str) or b.conversation is None else b.conversation.id
        )
        fields: dict[str, Any] = {"usage": None, "error": None, "incomplete_details": None, **extra}
        return ResponseObject(
            id=self.id, object="response", created_at=self.created_at, status=status, model=self.model,
            output=_OUTPUT.validate_python(output or []), instructions=b.instructions,
            max_output_tokens=b.max_output_tokens, metadata=b.metadata or {}, parallel_tool_calls=bool(b.parallel_tool_calls),
            previous_response_id=b.previous_response_id,
            conversation={"id": conversation} if conversation else None,
            temperature=b.temperature, top_p=b.top_p, top_logprobs=b.top_logprobs,
            tool_choice=_dump(b.tool_choice) or "auto", tools=[_dump(t) for t in b.tools or []],
            text=TextOut(format=_dump(b.text.format) if b.text and b.text.format else {"type": "text"}),
            truncation=b.truncation or "disabled", background=bool(b.background), store=b.store is not False,
            user=b.user, reasoning=None, **fields,
        )  # fmt: skip

    def wire(self, status: ResponseStatus, output: list[dict] | None = None, **extra: Any) -> dict:
        """The Response object at `status`, as it goes out (`dump_response`)."""
        return dump_response(self.response(status, output, **extra))

    def part(self, text: str, logprobs: list[dict] | None) -> dict:
        out: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.token_text is not None:
            out["logprobs"] = logprobs or []
        return out

    def item(self, status: str, parts: list[dict]) -> dict:
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": parts,
        }

    def call(self, status: str, name: str, arguments: str, ids: tuple[str, str]) -> dict:
        return {"type": "function_call", "id": ids[0], "call_id": ids[1], "name": name,
                "arguments": arguments, "status": status}  # fmt: skip

    def logprobs(self, events: Sequence[TokenEvent]) -> list[dict]:
        assert self.token_text is not None
        text = self.token_text

        def entry(t: str, lp: float) -> dict:
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        return [
            {**entry(ev.text, ev.logprob), "top_logprobs": [entry(text(i), lp) for i, lp in ev.top]}
            for ev in events
        ]


def dump_response(response: ResponseObject) -> dict:
    """A Response object as it leaves the framer, once: into an event, a record, a queue.
    Only the fields it was built with (an output part's `logprobs` only where asked for)."""
    return response.model_dump(mode="json", exclude_unset=True)


def usage(begun: Begun) -> dict:
    out = len(begun.run.tokens)
    return {
        "input_tokens": begun.input_tokens,
        "input_tokens_details": {"cached_tokens": begun.cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": begun.input_tokens + out,
    }


def _dump(value: Any) -> Any:
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


def reply(body: dict) -> dict[str, Any]:
    """A Response object's output as the message a chat template reads (HF's convention):
    its text, and its calls as `tool_calls`."""
    output = body["output"]
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


async def events(
    begun: Begun,
    framer: ResponseFramer,
    stop: StopText,
    *,
    catch: bool,
    end: Callable[[dict], Awaitable[object]] | None = None,
) -> AsyncIterator[dict]:
    """A generation's events, the last one carrying the final Response object. `end(body)`
    keeps it before the last event goes out. With `catch`, a failure is the
    `response.failed` event (a stream's status is sent already), its body kept by `end` as
    well (a stored response that failed mid-stream is retrieved as `failed`); else it is
    raised.

    A reply that may call tools holds back its text from `<tool_call>` on (`HeldText`) and
    opens its message item once it has text; its calls follow as `function_call` items."""
    f = framer
    first: ResponseStatus = "queued" if f.body.background else "in_progress"
    yield {"type": "response.created", "response": f.wire(first)}
    yield {"type": "response.in_progress", "response": f.wire("in_progress")}
    at = {"item_id": f.item_id, "output_index": 0, "content_index": 0}
    opening = [
        {"type": "response.output_item.added", "output_index": 0, "item": f.item("in_progress", [])},
        {"type": "response.content_part.added", **at, "part": f.part("", None)},
    ]
    held = HeldText(f.shape)
    try:
        async for ev in begun.run.stream():
            text = held.feed(stop.feed(ev))
            lp = f.logprobs([ev]) if f.token_text is not None else None
            if text or lp:
                for o in opening:
                    yield o
                opening = []
                yield {"type": "response.output_text.delta", **at, "delta": text, "logprobs": lp or []}
        tail = held.feed(stop.finish())
        rest, calls = held.finish()
        last = [{"type": "response.output_text.delta", **at, "delta": tail + rest, "logprobs": []}]
        for o in [*opening, *last] if tail + rest else opening if not calls else []:
            yield o
        opening = opening if calls and not tail + rest else []
    except Exception as exc:
        if not catch:
            raise
        etype, message = errors.classify(exc)
        failed = f.wire("failed", error={"code": etype.value, "message": message})
        if end is not None:
            await end(failed)
        yield {"type": "response.failed", "response": failed}
        return
    incomplete, output = begun.run.finish_reason == "length", list[dict]()
    status: ResponseStatus = "incomplete" if incomplete else "completed"
    closing = [] if opening else _message_done(f, begun, status, held.text[: held.sent], output)
    for done in [*closing, *_calls_done(f, calls, output)]:
        yield done
    details = {"reason": "max_output_tokens"} if incomplete else None
    body = f.wire(status, output, usage=usage(begun), incomplete_details=details)
    if end is not None:
        await end(body)
    yield {"type": f"response.{status}", "response": body}


def _message_done(f: ResponseFramer, begun: Begun, status: str, text: str, output: list[dict]) -> list[dict]:
    """The events that close the reply's message item (appended to `output`)."""
    at = {"item_id": f.item_id, "output_index": 0, "content_index": 0}
    all_lp = f.logprobs(begun.run.tokens) if f.token_text is not None else None
    item = f.item(status, [f.part(text, all_lp)])
    output.append(item)
    return [
        {"type": "response.output_text.done", **at, "text": text, "logprobs": all_lp or []},
        {"type": "response.content_part.done", **at, "part": f.part(text, all_lp)},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
    ]


def _calls_done(f: ResponseFramer, calls: list[ToolCall], output: list[dict]) -> list[dict]:
    """Each call's events, a `function_call` item after the others (appended to `output`)."""
    events = []
    for k in calls:
        n, ids = len(output), (new_object_id("fc"), call_id())
        place = {"item_id": ids[0], "output_index": n}
        done = f.call("completed", k.name, k.arguments, ids)
        events += [
            {"type": "response.output_item.added", "output_index": n, "item": f.call("in_progress", k.name, "", ids)},
            {"type": "response.function_call_arguments.delta", **place, "delta": k.arguments},
            {"type": "response.function_call_arguments.done", **place, "arguments": k.arguments, "name": k.name},
            {"type": "response.output_item.done", "output_index": n, "item": done},
        ]  # fmt: skip
        output.append(done)
    return events
