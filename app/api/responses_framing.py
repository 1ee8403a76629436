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

from app.engine import TokenEvent
from app.sessions import Begun
from app.store import new_object_id

from . import errors
from .openai_framing import StopText
from .responses_schemas import ResponseCreate


@dataclass
class Framer:
    """What every body of one response repeats, and its token log-probs' shape."""

    id: str
    body: ResponseCreate
    model: str
    token_text: Callable[[int], str] | None  # with logprobs: the text of a token id
    top: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    item_id: str = field(default_factory=lambda: new_object_id("msg"))

    def response(self, status: str, output: list[dict] | None = None, **extra: Any) -> dict:
        b = self.body
        conversation = (
            b.conversation if isinstance(b.conversation, str) or b.conversation is None else b.conversation.id
        )
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output or [], "usage": None, "error": None,
            "incomplete_details": None, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {}, "parallel_tool_calls": bool(b.parallel_tool_calls),
            "previous_response_id": b.previous_response_id,
            "conversation": {"id": conversation} if conversation else None,
            "temperature": b.temperature, "top_p": b.top_p, "top_logprobs": b.top_logprobs,
            "tool_choice": b.tool_choice if isinstance(b.tool_choice, str) else "auto", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": b.truncation or "disabled",
            "background": bool(b.background), "store": b.store is not False, "user": b.user, "reasoning": None,
            **extra,
        }  # fmt: skip

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

    def logprobs(self, events: Sequence[TokenEvent]) -> list[dict]:
        assert self.token_text is not None
        text = self.token_text

        def entry(t: str, lp: float) -> dict:
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        return [
            {**entry(ev.text, ev.logprob), "top_logprobs": [entry(text(i), lp) for i, lp in ev.top]}
            for ev in events
        ]


def usage(begun: Begun) -> dict:
    out = len(begun.run.tokens)
    return {
        "input_tokens": begun.input_tokens,
        "input_tokens_details": {"cached_tokens": begun.cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": begun.input_tokens + out,
    }


def reply(body: dict) -> str:
    """A Response object's reply text."""
    return "".join(p["text"] for item in body["output"] for p in item["content"])


async def events(
    begun: Begun,
    framer: Framer,
    stop: StopText,
    *,
    catch: bool,
    end: Callable[[dict], Awaitable[object]] | None = None,
) -> AsyncIterator[dict]:
    """A generation's events, the last one carrying the final Response object. `end(body)`
    keeps it before the last event goes out. With `catch`, a failure is the
    `response.failed` event (a stream's status is sent already); else it is raised."""
    f = framer
    first = "queued" if f.body.background else "in_progress"
    yield {"type": "response.created", "response": f.response(first)}
    yield {"type": "response.in_progress", "response": f.response("in_progress")}
    yield {"type": "response.output_item.added", "output_index": 0, "item": f.item("in_progress", [])}
    at = {"item_id": f.item_id, "output_index": 0, "content_index": 0}
    yield {"type": "response.content_part.added", **at, "part": f.part("", None)}
    try:
        async for ev in begun.run.stream():
            text = stop.feed(ev)
            lp = f.logprobs([ev]) if f.token_text is not None else None
            if text or lp:
                yield {"type": "response.output_text.delta", **at, "delta": text, "logprobs": lp or []}
        if rest := stop.finish():
            yield {"type": "response.output_text.delta", **at, "delta": rest, "logprobs": []}
    except Exception as exc:
        if not catch:
            raise
        etype, message = errors.classify(exc)
        yield {
            "type": "response.failed",
            "response": f.response("failed", error={"code": etype.value, "message": message}),
        }
        return
    text = stop.text if stop.cut is None else stop.text[: stop.cut]
    all_lp = f.logprobs(begun.run.tokens) if f.token_text is not None else None
    incomplete = begun.run.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    item = f.item(status, [f.part(text, all_lp)])
    yield {"type": "response.output_text.done", **at, "text": text, "logprobs": all_lp or []}
    yield {"type": "response.content_part.done", **at, "part": f.part(text, all_lp)}
    yield {"type": "response.output_item.done", "output_index": 0, "item": item}
    details = {"reason": "max_output_tokens"} if incomplete else None
    body = f.response(status, [item], usage=usage(begun), incomplete_details=details)
    if end is not None:
        await end(body)
    yield {"type": f"response.{status}", "response": body}
