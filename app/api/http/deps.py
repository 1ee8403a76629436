"""Dependencies the routers inject with `Depends` (settings, the sessions service, the
engine, the chat template, If-Match, and the caller's tenant by API key), and the checks every route that
runs the model makes of its body (`prompt_ids`, `sampling_params`)."""

from __future__ import annotations

import hmac
import re
from typing import Annotated

from fastapi import Depends, Header, Request

from app import logs
from app.assembly import Services
from app.config import Settings
from app.engine import Engine
from app.sessions import SessionService
from app.store import owner_of
from app.tenants import CLIENT
from model.chat_template import ChatTemplate
from model.sampling import SamplingParams

from ..schemas import SamplingFields
from .errors import ApiError, ErrorType

# If-Match: `*`, or one session version as its ETag ("3"), weak ETag (W/"3") or bare (3).
# The OpenAPI document carries this pattern, and the server checks the same one.
IF_MATCH = r'^(\*|[0-9]{1,18}|(W/)?"[0-9]{1,18}")$'
# X-Session-Id: a session id as the store makes them (app/store/keys.py: 32 hex digits, and
# a fork's, a dot and 16 more)
SESSION_ID_PATTERN = r"^[0-9a-f]{32}(\.[0-9a-f]{16})?$"


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_services(request: Request) -> Services:
    services: Services | None = request.app.state.services
    if services is None:
        raise ApiError(ErrorType.not_ready, "the model is not loaded yet")
    return services


def get_sessions(services: Annotated[Services, Depends(get_services)]) -> SessionService:
    return services.sessions


def get_engine(sessions: Annotated[SessionService, Depends(get_sessions)]) -> Engine:
    return sessions.engine


def prompt_ids(engine: Engine, max_prompt_tokens: int, prompt: str | list[int]) -> list[int]:
    """The prompt as token ids of the served model, or 413/422."""
    ids = engine.tokenize(prompt)
    if len(ids) > max_prompt_tokens:
        raise ApiError(
            ErrorType.prompt_too_long,
            f"prompt has {len(ids)} tokens; this server accepts at most {max_prompt_tokens}",
        )
    return in_vocabulary(engine, ids)


def in_vocabulary(engine: Engine, ids: list[int]) -> list[int]:
    """`ids`, or 422 when one is outside the served model's vocabulary."""
    size = engine.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= size):  # (in C: a long conversation's ids, every turn)
        bad = next(i for i in ids if not 0 <= i < size)
        raise ApiError(
            ErrorType.invalid_request, f"token id {bad} is outside the model's vocabulary [0, {size})"
        )
    return ids


def served_model(asked: str | None, engine: Engine) -> None:
    """404 model_not_found when a body names another model than the one served."""
    if asked is not None and asked != engine.name:
        raise ApiError(
            ErrorType.model_not_found, f"model {asked!r} is not served here; this server runs {engine.name!r}"
        )


def sampling_params(body: SamplingFields, engine: Engine, max_tokens: int) -> SamplingParams:
    """A body's sampling controls as the sampler takes them, or 422 naming the field for a
    token id outside the vocabulary. A control the body leaves out (or null) takes the
    served checkpoint's recommendation (`model.generation_config`: SmolLM2's card says
    temperature 0.2, top-p 0.9), else its neutral value: the clients' own defaults send no
    temperature, and they must get what the model was tuned for. A min_tokens
    past `max_tokens` (the request's, as capped by the server) is `max_tokens`: the same
    generation, and no schema can say that one field bounds another."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    for field, ids in (("logit_bias", list(bias)), ("stop_token_ids", body.stop_token_ids or [])):
        bad = next((i for i in ids if not 0 <= i < engine.vocab_size), None)
        if bad is not None:
            raise ApiError(
                ErrorType.invalid_request,
                f"{field}: token id {bad} is outside the model's vocabulary [0, {engine.vocab_size})",
            )
    rec = engine.lm.generation_config
    try:
        return SamplingParams(
            temperature=_or(body.temperature, _or(rec.temperature, 1.0)),
            top_k=int(_or(body.top_k, _or(rec.top_k, 0))),
            top_p=_or(body.top_p, _or(rec.top_p, 1.0)),
            min_p=_or(body.min_p, _or(rec.min_p, 0.0)),
            repetition_penalty=_or(body.repetition_penalty, _or(rec.repetition_penalty, 1.0)),
            presence_penalty=_or(body.presence_penalty, 0.0),
            frequency_penalty=_or(body.frequency_penalty, 0.0),
            logit_bias=tuple(bias.items()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_tokens=min(body.min_tokens or 0, max_tokens),
        )
    except ValueError as exc:  # the schema's bounds make this rare; SamplingParams names the field
        raise ApiError(ErrorType.invalid_request, str(exc)) from None


def _or(value: float | None, otherwise: float) -> float:
    return otherwise if value is None else value


def reply_bound(asked: int | None, settings: Settings, engine: Engine) -> int:
    """The most tokens a reply may have: what its request asks, else the served checkpoint's
    recommendation (an assistant's answer fits it and ends in reasonable time), else the
    server's max_tokens setting; never past that setting."""
    recommended = engine.lm.generation_config.max_tokens
    default = settings.max_tokens if recommended is None else recommended
    return min(default if asked is None else asked, settings.max_tokens)


def if_match(
    value: Annotated[
        str | None,
        Header(
            alias="If-Match",
            description='make the request conditional on the session version: its ETag `"3"`, `W/"3"`, '
            "`3`, or `*` (any); a stale version gets 412",
            json_schema_extra={"pattern": IF_MATCH},
        ),
    ] = None,
) -> int | None:
    if value is None:
        return None
    if not re.fullmatch(IF_MATCH, value):
        raise ApiError(
            ErrorType.invalid_request,
            f'If-Match must be a session version such as "3" (or W/"3", 3, *), not {logs.clip(value, 40)!r}',
        )
    digits = value.removeprefix("W/").strip('"')
    return None if digits == "*" else int(digits)


def check_key(keys: list[bytes], presented: str | None) -> str | None:
    """The presented key if it is one of `keys` (compared in constant time), else None."""
    if not presented:
        return None
    given = presented.encode()
    match = False
    for key in keys:  # every key is compared, so the time taken says nothing about which matched
        match |= hmac.compare_digest(key, given)
    return presented if match else None


def presented_key(request: Request) -> str | None:
    """`Authorization: Bearer KEY`, or `?access_token=KEY` (RFC 6750 2.3: for EventSource,
    which cannot send headers)."""
    auth = request.headers.get("authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    return request.query_params.get("access_token")


async def authenticate(request: Request) -> str:
    """The caller's tenant: `""` when the server has no keys (open), else the key's owner
    hash. 401 without a valid key."""
    keys: list[bytes] = request.app.state.api_keys
    if not keys:
        return ""
    key = check_key(keys, presented_key(request))
    if key is None:
        raise ApiError(
            ErrorType.unauthorized,
            "a valid API key is required: send `Authorization: Bearer KEY`",
            headers={"WWW-Authenticate": 'Bearer realm="recur"'},
        )
    return owner_of(key)


async def check_rate(request: Request, owner: Annotated[str, Depends(authenticate)]) -> None:
    """The tenant's request rate, shared by all replicas: 429 quota_exceeded past it, with
    Retry-After. (Its token rate: `Tenants.starting`, once a route knows its max_tokens.)"""
    await get_services(request).tenants.check_rate(owner)


async def bind_client(request: Request, owner: Annotated[str, Depends(authenticate)]) -> None:
    """Name the client this request serves, for the engine's fairness and the stream limit:
    its key's owner, or without keys (every client one tenant) its address. (async, as
    `bind_session`: the value sticks for the rest of the request.)"""
    CLIENT.set(owner or "address:" + (request.client.host if request.client else "unknown"))


async def bind_session(request: Request) -> None:
    """Put the path's session id into the log context of this request. (async: run in the
    request's own context, so the value sticks for the rest of the request.)"""
    sid = request.path_params.get("session_id")
    if sid is not None:
        logs.session_id.set(logs.clip(sid))


def chat_template(services: ServicesDep) -> ChatTemplate:
    """The served checkpoint's chat template (read at startup), or 400."""
    template = services.chat_template
    if template is None:
        raise ApiError(
            ErrorType.no_chat_template,
            "the served model has no chat template, so it cannot chat: use /v1/completions, or serve a "
            "checkpoint with one (chat_template.jinja, or tokenizer_config.json's chat_template)",
        )
    return template


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServicesDep = Annotated[Services, Depends(get_services)]
SessionsDep = Annotated[SessionService, Depends(get_sessions)]
EngineDep = Annotated[Engine, Depends(get_engine)]
IfMatchDep = Annotated[int | None, Depends(if_match)]
SessionIdHeader = Annotated[
    str | None,
    Header(
        alias="X-Session-Id",
        pattern=SESSION_ID_PATTERN,
        description="the session to continue (or the body's session_id); absent: a new session",
    ),
]
OwnerDep = Annotated[str, Depends(authenticate)]
