"""Dependencies the routers inject with `Depends`: settings, store, engine, If-Match."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Depends, Header, Request

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


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[SessionStore, Depends(get_store)]
EngineDep = Annotated[Engine, Depends(get_engine)]
IfMatchDep = Annotated[int | None, Depends(if_match)]
