"""OpenAI-compatible routes: `POST /v1/completions` and `GET /v1/models`.

A completion runs in a recur session: the body field `session_id` or the `X-Session-Id`
header continues one (its recurrent state is the context, so the prompt only needs the
new text); without either, a new session is created. Either way the session's id comes
back in the `X-Session-Id` header and the body, and the generation is committed to it
exactly as `POST /v1/sessions/{id}/generate` would (the same transaction: app/sessions.py).

Deviations from OpenAI, all forced by sessions: `n` and `best_of` are 1, a stop string is
kept in `text` (the state has consumed it), and `logprobs` are the sampled tokens' own
(no `top_logprobs`). Errors keep recur's body, `{"error": {"type", "message"}}`, which the
openai SDK raises as its usual exceptions; mid-stream, an error is a data chunk
`{"error": ...}`, which the SDK raises too.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from app import logs
from app.engine import Engine, FinishReason, TokenEvent
from app.sessions import Run

from .deps import EngineDep, OwnerDep, SessionsDep, SettingsDep, prompt_ids, sampling_params, served_model
from .errors import ApiError, ErrorType, responses
from .schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResult,
    CompletionUsage,
    ModelCard,
    ModelList,
    SessionRef,
)
from .sse import guarded, respond, sse_json, until_disconnect

router = APIRouter(prefix="/v1", tags=["openai"])
log = logging.getLogger("recur.openai")

# OpenAI knows no "eos": the model ending its text is a stop
_FINISH: dict[FinishReason, Literal["stop", "length"]] = {"eos": "stop", "stop": "stop", "length": "length"}
_STARTED = time.time()


@router.get("/models", response_model=ModelList, summary="The served model (OpenAI format)")
async def list_models(engine: EngineDep) -> ModelList:
    lm = engine.lm
    card = ModelCard(
        id=engine.name,
        created=int(_STARTED),
        family=lm.family,
        vocab_size=engine.vocab_size,
        context_window=lm.context_window,
        precision=lm.precision,
    )
    return ModelList(data=[card])


def _logprobs(events: list[TokenEvent], offset: int) -> CompletionLogprobs:
    offsets = []
    for ev in events:
        offsets.append(offset)
        offset += len(ev.text)
    return CompletionLogprobs(
        tokens=[ev.text for ev in events], token_logprobs=[ev.logprob for ev in events], text_offset=offsets
    )


def _usage(run: Run) -> CompletionUsage:
    n = len(run.tokens)
    return CompletionUsage(
        prompt_tokens=run.prompt_tokens, completion_tokens=n, total_tokens=run.prompt_tokens + n
    )


def _ref(run: Run) -> SessionRef:
    assert run.meta is not None
    return SessionRef(id=run.meta.id, version=run.meta.version, n_tokens=run.meta.n_tokens)


@router.post(
    "/completions",
    response_model=CompletionResult,
    response_model_exclude_none=False,
    summary="OpenAI-compatible text completion, in a new or a continued session",
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "stream=true: `data: {completion chunk}` events, then `data: [DONE]`",
        },
        **responses(
            ErrorType.invalid_request,
            ErrorType.unauthorized,
            ErrorType.model_not_found,
            ErrorType.session_not_found,
            ErrorType.session_busy,
            ErrorType.model_mismatch,
            ErrorType.prompt_too_long,
            ErrorType.queue_full,
            ErrorType.quota_exceeded,
            ErrorType.storage_full,
            ErrorType.redis_unavailable,
        ),
    },
)
async def create_completion(
    body: Completion,
    request: Request,
    response: Response,
    sessions: SessionsDep,
    settings: SettingsDep,
    owner: OwnerDep,
    x_session_id: Annotated[
        str | None, Header(alias="X-Session-Id", description="the session to continue (or body session_id)")
    ] = None,
) -> CompletionResult | EventSourceResponse:
    started = time.perf_counter()
    engine = sessions.engine
    _check(body, engine, x_session_id)
    ids = prompt_ids(engine, settings.max_prompt_tokens, _one_prompt(body.prompt))
    params = sampling_params(
        1.0 if body.temperature is None else body.temperature, body.top_k or 0, body.top_p or 1.0
    )
    sid = body.session_id or x_session_id
    if sid is None:  # a fresh session: BOS now, the prompt with the generation
        sid = (await sessions.create([], settings.session_ttl, owner)).id
    else:
        logs.session_id.set(logs.clip(sid))
    run = await sessions.generate(
        sid,
        ids,
        params=params,
        seed=body.seed,
        max_tokens=min(body.max_tokens or settings.max_tokens, settings.max_tokens),
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        expected=None,
        owner=owner,
        started=started,
    )
    if body.user is not None:  # OpenAI's end-user id: recorded for the operator, never used
        log.info("completion for user %r", body.user, extra={"openai_user": body.user})
    head: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": engine.name,
        "system_fingerprint": engine.fingerprint,
        "session_id": sid,
    }
    headers = {"X-Session-Id": sid}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(run, head, body.logprobs is not None, include_usage)
        return respond(run, _then_done(guarded(run, chunks, error_event=None)), headers=headers)
    await run.complete(until_disconnect(request))
    response.headers.update(headers)
    choice = CompletionChoice(
        text=run.text,
        logprobs=_logprobs(run.tokens, 0) if body.logprobs is not None else None,
        finish_reason=_FINISH[run.finish_reason],
    )
    return CompletionResult(**head, choices=[choice], usage=_usage(run), session=_ref(run))


def _one_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a body: a string or ids, or an array holding one of them."""
    if isinstance(prompt, str):
        return prompt
    ids = [x for x in prompt if isinstance(x, int)]
    if len(ids) == len(prompt):
        return ids
    one = prompt[0]
    if len(prompt) != 1 or isinstance(one, int):
        raise ApiError(
            ErrorType.invalid_request,
            f"prompt: an array of {len(prompt)} prompts is a batch, which this server does not run yet; "
            "send one prompt per request",
        )
    return one


def _check(body: Completion, engine: Engine, x_session_id: str | None) -> None:
    served_model(body.model, engine)
    if body.session_id and x_session_id and body.session_id != x_session_id:
        raise ApiError(
            ErrorType.invalid_request, "session_id and the X-Session-Id header name different sessions"
        )


async def _chunks(run: Run, head: dict[str, Any], logprobs: bool, include_usage: bool):
    def chunk(
        choices: list[CompletionChoice],
        usage: CompletionUsage | None = None,
        session: SessionRef | None = None,
    ) -> ServerSentEvent:
        body = CompletionResult(**head, choices=choices, usage=usage, session=session)
        data = body.model_dump(mode="json")  # usage: null in every chunk but the last, as OpenAI's
        if session is None:
            del data["session"]
        return ServerSentEvent(data=sse_json(data))

    offset = 0
    async for ev in run.stream():
        lp = _logprobs([ev], offset) if logprobs else None
        offset += len(ev.text)
        yield chunk([CompletionChoice(text=ev.text, logprobs=lp, finish_reason=None)])
    # committed: the finish reason, with the session as it now is
    yield chunk([CompletionChoice(text="", finish_reason=_FINISH[run.finish_reason])], session=_ref(run))
    if include_usage:
        yield chunk([], usage=_usage(run))


async def _then_done(frames):
    """OpenAI's stream ends with `data: [DONE]`, after an error chunk too (the SDK raises
    the error chunk, `{"error": ...}`, as its usual exception)."""
    async for frame in frames:
        yield frame
    yield ServerSentEvent(data="[DONE]")
