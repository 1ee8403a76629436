"""OpenAI-compatible chat: `POST /v1/chat/completions`.

The messages become text through the served checkpoint's chat template (data in the
checkpoint, rendered in Jinja's sandbox: model/chat_template.py); a checkpoint without one
answers 400 `no_chat_template`, and its `/v1/completions` still works. The text then runs
as a completion does (framing.py): `session_id` or `X-Session-Id` continues a
session, and then only the new messages are sent; without one, a new session is made.

Generation stops at the template's turn stop (as well as at the body's `stop`), and a stop
string is left out of the message, OpenAI's way, though the session's state has consumed
it. A template that renders every assistant message followed by exactly its turn stop
(the shipped play-script one does) so renders, for a client that resends the whole
conversation, the tokens the previous turn's state consumed followed by the new ones
(docs/OPENAI.md "Chat templates").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from sse_starlette import EventSourceResponse

from app.engine import Logprobs, TokenEvent
from app.sessions import SessionService
from model import tool_calls
from model.chat_template import ChatTemplate

from ..http.deps import OwnerDep, SessionIdHeader, SessionsDep, SettingsDep, chat_template, prompt_ids
from ..http.errors import ErrorType
from . import framing as oai
from .schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionResult,
    ChatDelta,
    ChatFunctionCallOut,
    ChatFunctionDelta,
    ChatLogprobs,
    ChatMessage,
    ChatReply,
    ChatTokenLogprob,
    ChatToolCallDelta,
    ChatToolCallOut,
    ChatTopLogprob,
    CompletionUsage,
    JsonSchemaResponseFormat,
)
from .structured import HeldText, Shape, call_id, tools_of

router = APIRouter(prefix="/v1", tags=["openai"])


async def _rendered(
    body: ChatCompletion,
    shape: Shape,
    template: ChatTemplate,
    sessions: SessionService,
    sid: str | None,
    owner: str,
) -> str:
    """The body's messages (and the tools offered) as the template renders them: in a
    continued session whose state holds a conversation, only what follows it (a session that
    holds nothing but BOS, as `recur chat` makes one, opens its conversation)."""
    messages, variables = tool_calls.conversation(
        template, [_message(m) for m in body.messages], shape.offered
    )
    kwargs = {**(body.chat_template_kwargs or {}), **variables}
    opened = sid is not None and (await sessions.get(sid, owner)).n_tokens > len(sessions.with_bos([]))
    return template.render_continuation(messages, kwargs) if opened else template.render(messages, kwargs)


def shape(body: ChatCompletion) -> Shape:
    """The reply's shape the body asks: its tools, tool_choice and response_format."""
    choice = body.tool_choice or "auto"
    fmt = body.response_format
    schema, strict = None, True
    if fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    elif isinstance(fmt, JsonSchemaResponseFormat):
        schema = fmt.json_schema.schema_ or {"type": "object"}
        strict = bool(fmt.json_schema.strict)
    tools = tools_of(
        [
            (t.function.name, t.function.description, t.function.parameters, t.function.strict)
            for t in body.tools or []
        ]
    )
    return Shape(
        tools,
        choice if isinstance(choice, str) else choice.function.name,
        body.parallel_tool_calls is not False,
        schema,
        strict,
    )


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResult,
    summary="OpenAI-compatible chat completion, in a new or a continued session",
    responses=oai.route_responses(ChatCompletionChunk, "chat.completion.chunk", ErrorType.no_chat_template),
)
async def create_chat_completion(
    body: ChatCompletion,
    request: Request,
    response: Response,
    template: Annotated[ChatTemplate, Depends(chat_template)],
    sessions: SessionsDep,
    settings: SettingsDep,
    owner: OwnerDep,
    x_session_id: SessionIdHeader = None,
) -> ChatCompletionResult | EventSourceResponse:
    started = time.perf_counter()
    engine = sessions.engine
    sid = oai.continued(body, engine, x_session_id)
    reply_shape = shape(body)
    ids = prompt_ids(
        engine, settings.max_prompt_tokens, await _rendered(body, reply_shape, template, sessions, sid, owner)
    )
    logprobs = body.logprobs or bool(body.top_logprobs)  # alternatives come with the token's own
    # the turn stop always ends the assistant's turn, as an end-of-turn token would
    stop = list(dict.fromkeys([*template.stop, *oai.stop_strings(body.stop)]))
    generation = oai.generation(
        body,
        settings,
        body.max_completion_tokens or body.max_tokens,
        engine,
        stop=stop,
        logprobs=Logprobs(top=body.top_logprobs or 0) if logprobs else Logprobs(),
        started=started,
    )
    generation.grammar = await reply_shape.matcher(engine)
    choices = await oai.start(
        sessions,
        settings,
        owner,
        sid,
        [ids],
        generation,
        n=body.n or 1,
        include_stop=body.include_stop_str_in_output,
        user=body.user,
    )
    token_text = engine.tokenizer.token_text if logprobs else None
    framer = _Chunks(oai.head("chatcmpl", engine.name, engine.fingerprint, choices), token_text, reply_shape)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return oai.stream(choices, framer, include_usage, settings.stream_send_timeout)
    await oai.complete(choices, request)
    response.headers.update(oai.session_header(choices))
    entries = [_choice(c, reply_shape, framer.logprobs) for c in choices.items]
    return ChatCompletionResult(
        **framer.head, choices=entries, usage=choices.usage(), session=entries[0].session
    )


def _choice(c: oai.Choice, reply_shape: Shape, token_text: Callable[[int], str] | None) -> ChatChoice:
    """A committed choice, not streamed: its text, or its text and its calls."""
    content, calls = reply_shape.read(c.text.whole(c.run.tokens))
    out = [
        ChatToolCallOut(id=call_id(), function=ChatFunctionCallOut(name=k.name, arguments=k.arguments))
        for k in calls
    ]
    return ChatChoice(
        index=c.index,
        message=ChatReply(content=(content or None) if calls else content, tool_calls=out or None),
        logprobs=_logprobs(c.run.tokens, token_text) if token_text else None,
        finish_reason="tool_calls" if calls else c.finish_reason,
        session=c.ref(),
    )


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as templates read it (HF's): role and content text, the name if any, an
    assistant's tool calls and a tool message's call id."""
    content = (
        m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
    )
    out: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _logprobs(events: Sequence[TokenEvent], token_text: Callable[[int], str]) -> ChatLogprobs:
    """The sampled tokens' log-probs (every token the state consumed, a stop string's too),
    each with its alternatives (as many as `top_logprobs` asked) under the same distribution."""

    def entry(text: str, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **entry(ev.text, ev.logprob).model_dump(),
                top_logprobs=[entry(token_text(i), lp) for i, lp in ev.top],
            )
            for ev in events
        ]
    )


@dataclass
class _Chunks:
    """The stream's shapes: `chat.completion.chunk`s, one choice each. A reply that may call
    tools holds back its text from `<tool_call>` on; once it ends, its calls go out as
    OpenAI streams them: per call a delta with its index, id, type and name, then its
    arguments' text, and the finish reason `tool_calls`."""

    head: dict[str, Any]
    logprobs: Callable[[int], str] | None  # with logprobs: the text of a token id
    shape: Shape = field(default_factory=Shape)
    held: dict[int, HeldText] = field(default_factory=dict)

    def _held(self, choice: oai.Choice) -> HeldText:
        return self.held.setdefault(choice.index, HeldText(self.shape))

    def chunk(self, entries: list[Any], usage: CompletionUsage | None) -> ChatCompletionChunk:
        first = next((e for e in entries if isinstance(e, ChatChunkChoice) and e.index == 0), None)
        return ChatCompletionChunk(
            **self.head, choices=entries, usage=usage, session=first.session if first else None
        )

    def opening(self, choice: oai.Choice) -> ChatChunkChoice:
        return ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))

    def token(self, choice: oai.Choice, event: TokenEvent | None, text: str) -> ChatChunkChoice | None:
        lp = _logprobs([event], self.logprobs) if self.logprobs and event is not None else None
        text = self._held(choice).feed(text)
        if not text and lp is None:  # held back (a stop string or a call may be starting): nothing to say yet
            return None
        return ChatChunkChoice(index=choice.index, delta=ChatDelta(content=text), logprobs=lp)

    def closing(self, choice: oai.Choice) -> list[ChatChunkChoice]:
        rest, calls = self._held(choice).finish()
        out = [ChatChunkChoice(index=choice.index, delta=ChatDelta(content=rest))] if rest else []
        for i, k in enumerate(calls):
            named = ChatToolCallDelta(
                index=i, id=call_id(), type="function", function=ChatFunctionDelta(name=k.name, arguments="")
            )
            args = ChatToolCallDelta(index=i, function=ChatFunctionDelta(arguments=k.arguments))
            out += [
                ChatChunkChoice(index=choice.index, delta=ChatDelta(tool_calls=[d])) for d in (named, args)
            ]
        finish = "tool_calls" if calls else choice.finish_reason
        return [
            *out,
            ChatChunkChoice(
                index=choice.index, delta=ChatDelta(), finish_reason=finish, session=choice.ref()
            ),
        ]
