"""OpenAI's Responses API: `/v1/responses` on durable sessions.

The route parses, refuses what recur does not implement (400 `unsupported`, naming the
field), renders the conversation through the checkpoint's chat template, and frames the
generation (responses_framing.py); the transaction (which state it continues, what it
prefills, what is kept) is app/sessions/responses.py's, a background response's worker
and its replay app/sessions/background.py's. docs/OPENAI.md "Responses" has the
compatibility table.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.engine import Logprobs
from app.sessions import Background, Begun, Generation, Render, Replay, Responses, Turn
from app.store import new_object_id, response_id
from model import tool_calls
from model.chat_template import ChatTemplate, ChatTemplateError

from ..http.deps import (
    OwnerDep,
    ServicesDep,
    SessionsDep,
    SettingsDep,
    chat_template,
    in_vocabulary,
    reply_bound,
    sampling_params,
    served_model,
)
from ..http.disconnect import until_disconnect
from ..http.errors import ApiError, ErrorType, classify, error_docs
from ..http.sse import SHUTTING_DOWN, json_of, respond, sse_json, stream_response, until_stopped
from ..schemas import ErrorBody
from . import framing as oai
from . import responses_framing as rf
from .responses_schemas import (
    LOGPROBS,
    Deleted,
    FunctionCallIn,
    FunctionCallOutputIn,
    FunctionTool,
    InputItem,
    InputMessage,
    ItemList,
    ResponseCreate,
    ResponseObject,
    StreamEvent,
)
from .structured import Shape, tools_of

router = APIRouter(prefix="/v1", tags=["responses"])
log = logging.getLogger("recur.api")
ERRORS = (*oai.ERRORS, ErrorType.object_not_found, ErrorType.unsupported, ErrorType.no_chat_template)
EVENTS = stream_response(
    "stream=true: the Responses event sequence, each `event: TYPE` with `data: {event}`",
    {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": json_of(StreamEvent)},
    },
)


def get_responses(services: ServicesDep) -> Responses:
    return services.responses


def get_background(services: ServicesDep) -> Background:
    return services.background


ResponsesDep = Annotated[Responses, Depends(get_responses)]
BackgroundDep = Annotated[Background, Depends(get_background)]
TemplateDep = Annotated[ChatTemplate, Depends(chat_template)]


def unsupported(body: ResponseCreate) -> None:
    """400 naming the field, for what recur does not implement."""
    hosted = [str(t.get("type")) for t in body.tools or [] if isinstance(t, dict)]
    refused = [
        ("tools", "function" in hosted, "a function tool has a name (letters, digits, _ . -; at most 64) and may "
         "have a description, parameters (a JSON schema) and strict, nothing else"),
        ("tools", bool(hosted), f"only function tools are served, not {', '.join(hosted)}"),
        ("reasoning", any(v is not None for v in (body.reasoning or {}).values()), "reasoning is not supported"),
        ("prompt", body.prompt is not None, "stored prompts are not supported"),
        ("include", any(i != LOGPROBS for i in body.include or []), f"only {LOGPROBS!r} can be included"),
        ("conversation", body.conversation is not None and body.previous_response_id is not None,
         "a response continues a conversation or a previous response, not both"),
        ("background", bool(body.background) and body.store is False, "a background response must be stored"),
        ("store", body.store is False and body.conversation is not None, "a conversation's responses are stored"),
    ]  # fmt: skip
    for name, bad, why in refused:
        if bad:
            raise ApiError(ErrorType.unsupported, f"{name}: {why}")


def shape(body: ResponseCreate) -> Shape:
    """The reply's shape the body asks: its function tools, tool_choice and text.format."""
    fmt = body.text.format if body.text else None
    schema = None
    if fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.schema_ or {"type": "object"}
    choice = body.tool_choice or "auto"
    tools = tools_of(
        [
            (t.name, t.description, t.parameters, t.strict)
            for t in body.tools or []
            if isinstance(t, FunctionTool)
        ]
    )
    return Shape(
        tools,
        choice if isinstance(choice, str) else choice.name,
        body.parallel_tool_calls is not False,
        schema,
        bool(fmt and fmt.strict),
    )


def input_items(body_input: str | list[InputItem]) -> list[dict]:
    """The input as stored items, each with an id and its content as text parts."""
    messages = [InputMessage(role="user", content=body_input)] if isinstance(body_input, str) else body_input
    return [item(m) for m in messages]


def item(m: InputItem) -> dict:
    if isinstance(m, FunctionCallIn):
        return {
            "type": "function_call", "id": m.id or new_object_id("fc"), "call_id": m.call_id, "name": m.name,
            "arguments": m.arguments, "status": "completed",
        }  # fmt: skip
    if isinstance(m, FunctionCallOutputIn):
        output = m.output if isinstance(m.output, str) else "\n".join(p.text for p in m.output)
        return {"type": "function_call_output", "id": m.id or new_object_id("fco"), "call_id": m.call_id,
                "output": output, "status": "completed"}  # fmt: skip
    kind = "output_text" if m.role == "assistant" else "input_text"
    parts = (
        [{"type": kind, "text": m.content}]
        if isinstance(m.content, str)
        else [{"type": p.type, "text": p.text} for p in m.content]
    )
    return {
        "type": "message",
        "id": m.id or new_object_id("msg"),
        "status": "completed",
        "role": m.role,
        "content": parts,
    }


@dataclass(frozen=True)
class Renderer:
    """The caller's half of the transaction: messages -> the template's text -> token ids
    (`app.sessions.starts.Render`), whole or a later turn alone; `new` holds a turn's new
    tokens to the prompt limit."""

    template: ChatTemplate
    settings: Any
    engine: Any
    instructions: str | None = None
    shape: Shape | None = None  # the tools offered, shown as the template shows them

    def __call__(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        first = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = self.shape.offered if self.shape is not None else []
        shown, variables = tool_calls.conversation(self.template, [*first, *messages], tools)
        text = self.template.render(shown, variables, add_generation_prompt=generation_prompt)
        return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        return in_vocabulary(self.engine, self.engine.tokenize(text)) if text else []

    def _later(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """Messages of a later turn as the template reads them, and its variables; None if
        the template does not render turn by turn as it renders the whole (`composes`).
        (A template that shows tools itself reads them in a variable; one that does not
        shows them in the first system message, which a later turn does not render.)"""
        offered = self.shape.offered if self.shape is not None else []
        tools = offered if tool_calls.knows_tools(self.template) else []
        shown, variables = tool_calls.conversation(self.template, messages, tools)
        return (shown, variables) if self.template.composes(variables) else None

    @functools.cached_property
    def frame(self) -> str:
        if self._later([]) is None:
            return ""  # (never alone)
        tools = [t.as_json() for t in self.shape.offered] if self.shape is not None else []
        what = [self.template.source, self.template.stop, self.instructions or "", tools]
        return hashlib.blake2b(json.dumps(what, default=str).encode(), digest_size=16).hexdigest()

    def continuation(self, messages: list[dict[str, Any]]) -> list[int] | None:
        later = self._later(messages)
        return None if later is None else self._ids(self.template.render_continuation(*later))

    def closing(self, reply: dict[str, Any], ids: list[int]) -> list[int] | None:
        later = self._later([reply])
        found = None if later is None else self.template.reply(later[0][0], later[1])
        if later is None or found is None:
            return None
        opening, text = found
        head = self._ids(opening)
        written = self._ids(opening + text)
        if written[: len(head) + len(ids)] != head + ids:
            return None  # (the state consumed other tokens than the template writes)
        closing = written[len(head) + len(ids) :]
        for role in ("user", "tool", "system"):  # (what a next turn may open with)
            try:
                after = self.template.render_continuation([{"role": role, "content": "x"}], later[1])
            except ChatTemplateError:
                continue  # (a role the template refuses)
            if self._ids(opening + text + after) != written + self._ids(after):
                return None
        return closing

    def new(self, ids: list[int]) -> list[int]:
        limit = self.settings.max_prompt_tokens
        if len(ids) > limit:
            raise ApiError(
                ErrorType.prompt_too_long,
                f"this turn has {len(ids)} new tokens to prefill (the stored state continues the rest of the "
                f"conversation, where it can); this server accepts at most {limit} in one request",
            )
        return ids


def renderer(
    template: ChatTemplate,
    settings: Any,
    engine: Any,
    instructions: str | None = None,
    shape: Shape | None = None,
) -> Render:
    return Renderer(template, settings, engine, instructions, shape)


@router.post(
    "/responses",
    response_model=ResponseObject,
    summary="OpenAI Responses API: a response, continuing a previous one or a conversation",
    responses={200: EVENTS, **error_docs(*ERRORS)},
)
async def create_response(
    body: ResponseCreate,
    request: Request,
    sessions: SessionsDep,
    settings: SettingsDep,
    owner: OwnerDep,
    template: TemplateDep,
    responses: ResponsesDep,
    background: BackgroundDep,
) -> Any:
    started = time.perf_counter()
    engine = sessions.engine
    served_model(body.model, engine)
    unsupported(body)
    reply_shape = shape(body)
    conversation = (
        body.conversation
        if isinstance(body.conversation, str) or body.conversation is None
        else body.conversation.id
    )
    turn = Turn(
        owner,
        input_items(body.input),
        body.previous_response_id,
        conversation,
        body.store is not False,
        bool(body.background),
    )
    logprobs = LOGPROBS in (body.include or [])
    gen = await _generation(body, settings, engine, template, reply_shape, logprobs, started)
    framer = rf.ResponseFramer(
        response_id(body.previous_response_id),  # (in its chain: one hash slot, app/store/keys.py)
        body,
        engine.name,
        engine.tokenizer.token_text if logprobs else None,
        reply_shape,
    )
    queued = framer.response("queued")  # (a background response's answer)
    if turn.background:
        await background.queue(framer.id, owner, rf.dump_response(queued))
    try:
        begun = await responses.begin(
            framer.id, turn, renderer(template, settings, engine, body.instructions, reply_shape), gen
        )
    except BaseException:
        if turn.background:
            await background.store.delete("response", framer.id, owner)
        raise
    stop = oai.StopText(gen.stop, False, gen.params.min_tokens)
    if turn.background:
        events = rf.events(begun, framer, stop, catch=True)
        background.detach(
            framer.id, owner, begun.own_session, events,
            lambda last, nbytes: _ended(responses, begun, last, nbytes), lambda: responses.close(begun),
        )  # fmt: skip
        return queued
    if body.stream:
        return _streamed(responses, begun, framer, stop, settings.stream_send_timeout)
    return await _complete(responses, begun, rf.events(begun, framer, stop, catch=False), request)


async def _generation(
    body: ResponseCreate,
    settings: Any,
    engine: Any,
    template: ChatTemplate,
    reply_shape: Shape,
    logprobs: bool,
    started: float,
) -> Generation:
    """What the response samples, and how: the body's controls, the template's turn stop,
    and the reply's grammar (compiled in a worker thread)."""
    capped = reply_bound(body.max_output_tokens, settings, engine)
    gen = Generation(
        sampling_params(body, engine, capped),
        capped,
        body.seed,
        list(template.stop),
        logprobs=Logprobs(top=body.top_logprobs or 0) if logprobs else Logprobs(),
        started=started,
    )
    gen.grammar = await reply_shape.matcher(engine)
    return gen  # fmt: skip


def _streamed(
    responses: Responses, begun: Begun, framer: rf.ResponseFramer, stop: oai.StopText, send_timeout: float
) -> EventSourceResponse:
    """The response's events, streamed; a server told to stop first ends them (`_stopped`)."""
    events = rf.events(begun, framer, stop, catch=True, end=lambda b: _finish(responses, begun, b))
    frames = _sse(until_stopped(events, lambda: _stopped(responses, begun, framer)))
    return respond(_Closing(responses, begun), frames, send_timeout=send_timeout)


async def _finish(
    responses: Responses, begun: Begun, body: dict, worker: bool = False, events: int = 0
) -> None:
    await responses.finish(begun, body, rf.reply(body), body["output"], worker=worker, events=events)


async def _stopped(responses: Responses, begun: Begun, framer: rf.ResponseFramer) -> dict:
    """The server is told to stop (Ctrl-C, SIGTERM) mid-stream: the response fails, as a
    failure once streaming has begun does (kept as `failed` if stored; nothing of its state),
    and its `response.failed` event, with code `not_ready`, ends the stream."""
    failed = framer.wire("failed", error={"code": ErrorType.not_ready.value, "message": SHUTTING_DOWN})
    try:
        await _finish(responses, begun, failed)
    except Exception as exc:  # (the event still goes out: the client learns why it ends)
        log.warning("could not keep response %s as failed on shutdown: %s", begun.id, exc)
    return {"type": "response.failed", "response": failed}


async def _ended(responses: Responses, begun: Begun, last: dict, events: int) -> None:
    """A background response's last event is out: keep the body it carries (and count its
    `events` bytes)."""
    try:
        await _finish(responses, begun, last["response"], worker=True, events=events)
    finally:
        await responses.close(begun)


class _Closing:
    """What a streamed response closes when it ends (sse.respond): the response's run,
    and the session it made unless kept."""

    def __init__(self, responses: Responses, begun: Begun):
        self.responses, self.begun = responses, begun

    async def close(self) -> None:
        await self.responses.close(self.begun)


async def _complete(
    responses: Responses, begun: Begun, events: AsyncIterator[dict], request: Request
) -> dict:
    """Drain the events to the final body, kept; a client that hangs up abandons it."""

    async def drain() -> dict:
        last: dict = {}
        async for ev in events:
            last = ev
        return dict(last["response"])

    hangup = asyncio.ensure_future(until_disconnect(request))
    work = asyncio.ensure_future(drain())
    try:
        await asyncio.wait({work, hangup}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ApiError(ErrorType.client_disconnected, "the client disconnected; nothing was kept")
        body = work.result()
        await _finish(responses, begun, body)
    finally:
        work.cancel()
        hangup.cancel()
        await responses.close(begun)
    return body


async def _sse(events: AsyncIterator[dict], first: int = 0) -> AsyncIterator[ServerSentEvent]:
    seq = first
    async for ev in events:
        ev.setdefault("sequence_number", seq)
        seq = ev["sequence_number"] + 1
        yield ServerSentEvent(data=sse_json(ev), event=ev["type"])


@router.get(
    "/responses/{response_id}",
    response_model=ResponseObject,
    summary="A stored response; with stream=true, a background response's events after starting_after",
    responses={200: EVENTS, **error_docs(ErrorType.object_not_found, ErrorType.unsupported)},
)
async def get_response(
    response_id: str,
    owner: OwnerDep,
    responses: ResponsesDep,
    background: BackgroundDep,
    settings: SettingsDep,
    stream: bool = False,
    starting_after: Annotated[int, Query(ge=-1)] = -1,
    include: Annotated[list[str] | None, Query(max_length=16)] = None,
) -> Any:
    body = await responses.get(owner, response_id)
    if not stream:
        return body
    if not body.get("background"):
        raise ApiError(
            ErrorType.unsupported, "stream: only a background response's events are kept for replay"
        )
    replay = background.replay(response_id, owner, starting_after)  # (429 past the client's limit)
    frames = until_stopped(_replayed(replay), lambda: _replay_stopped(replay))
    return respond(replay, frames, send_timeout=settings.stream_send_timeout)


async def _replayed(replay: Replay) -> AsyncIterator[ServerSentEvent | bytes]:
    """A replay's events as they were kept, a page in one write (a write per event cost
    the loop 15x another key's completion beside a flood). If reading them fails once
    begun, OpenAI's `error` event (its code the error's type) ends the stream; the
    replay's place among its client's is given back however it ends."""
    try:
        async for page in replay.pages():
            yield b"".join(ServerSentEvent(data=raw, event=kind).encode() for kind, raw in page)
    except Exception as exc:
        etype, message = classify(exc)
        ev = {"type": "error", "code": etype.value, "message": message, "sequence_number": replay.next}
        yield ServerSentEvent(data=sse_json(ev), event="error")
    finally:
        await replay.close()


async def _replay_stopped(replay: Replay) -> ServerSentEvent:
    """The server is told to stop mid-replay: OpenAI's `error` event (code `not_ready`) ends
    it; the response goes on or fails on its own, and a replay from another replica
    (`starting_after` the last event received) finds out which."""
    ev = {
        "type": "error",
        "code": ErrorType.not_ready.value,
        "message": SHUTTING_DOWN,
        "sequence_number": replay.next,
    }
    return ServerSentEvent(data=sse_json(ev), event="error")


@router.delete(
    "/responses/{response_id}",
    response_model=Deleted,
    summary="Delete a response and its state (its descendants keep theirs)",
    responses=error_docs(ErrorType.object_not_found),
)
async def delete_response(response_id: str, owner: OwnerDep, responses: ResponsesDep) -> dict:
    await responses.delete(owner, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post(
    "/responses/{response_id}/cancel",
    response_model=ResponseObject,
    summary="Cancel a background response: it stops, and commits nothing more",
    responses=error_docs(ErrorType.object_not_found, ErrorType.unsupported),
)
async def cancel_response(response_id: str, owner: OwnerDep, background: BackgroundDep) -> dict:
    status, body = await background.cancel(response_id, owner)
    if status == "foreground" or body is None:
        raise ApiError(ErrorType.unsupported, "only a background response can be cancelled")
    return body


@router.get(
    "/responses/{response_id}/input_items",
    response_model=ItemList,
    summary="The input items a response was given (its own, not its ancestors')",
    responses=error_docs(ErrorType.object_not_found),
)
async def list_input_items(
    response_id: str,
    owner: OwnerDep,
    responses: ResponsesDep,
    query: PageDep,
) -> dict:
    return page(await responses.input_items(owner, response_id), query)


@dataclass(frozen=True)
class PageQuery:
    """Which page of a list a request asks for (OpenAI's cursor): `limit` items after the
    item `after`, in `order` of creation."""

    limit: int
    order: str
    after: str | None


def page_query(
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    after: Annotated[str | None, Query(max_length=128)] = None,
    include: Annotated[list[str] | None, Query(max_length=16)] = None,  # (accepted; nothing to add)
) -> PageQuery:
    """The query of every list route of the Responses API and the Conversations API."""
    return PageQuery(limit, order, after)


PageDep = Annotated[PageQuery, Depends(page_query)]


def page(items: list[dict], query: PageQuery) -> dict:
    """A cursor page of `items` (oldest first) as the SDK reads it: `after` an item id."""
    ordered = items if query.order == "asc" else items[::-1]
    ids = [i["id"] for i in ordered]
    start = ids.index(query.after) + 1 if query.after in ids else 0
    data = ordered[start : start + query.limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + query.limit < len(ordered),
    }


__all__ = ["ErrorBody", "router", "page", "PageDep", "PageQuery", "renderer", "item"]
