"""Dependencies the routers inject with `Depends`: settings, store, engine, If-Match, and
the caller's tenant (API key authentication)."""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Annotated

from fastapi import Depends, Header, Request

from app import logs
from app.config import Settings
from app.engine import Engine
from app.store import SessionStore

from .errors import ApiError, ErrorType

_ETAG_RE = re.compile(r'\s*(?:W/)?"?(\d{1,18})"?\s*')


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> SessionStore:
    return request.app.state.store


def get_engine(request: Request) -> Engine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise ApiError(ErrorType.not_ready, "the model is not loaded yet")
    return engine


def if_match(
    value: Annotated[
        str | None,
        Header(
            alias="If-Match",
            description='make the request conditional on the session version, e.g. `"3"` (the ETag); `*` = any',
        ),
    ] = None,
) -> int | None:
    if value is None or value.strip() == "*":
        return None
    m = _ETAG_RE.fullmatch(value)
    if not m:
        raise ApiError(
            ErrorType.invalid_request, f'If-Match must be a session version such as "3", not {value!r}'
        )
    return int(m.group(1))


def owner_of(key: str) -> str:
    """The tenant a key stands for, as stored with its sessions: a hash, never the key."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


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


async def bind_session(request: Request) -> None:
    """Put the path's session id into the log context of this request. (async: run in the
    request's own context, so the value sticks for the rest of the request.)"""
    sid = request.path_params.get("session_id")
    if sid is not None:
        logs.session_id.set(logs.clip(sid))


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[SessionStore, Depends(get_store)]
EngineDep = Annotated[Engine, Depends(get_engine)]
IfMatchDep = Annotated[int | None, Depends(if_match)]
OwnerDep = Annotated[str, Depends(authenticate)]
