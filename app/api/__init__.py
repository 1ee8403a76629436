"""The HTTP layer: `create_app` assembles the routers, error handlers and lifespan.

Three rooms, by surface: `native/` (recur's own routes: sessions, tokens, usage, health,
metrics, the playground), `openai/` (OpenAI's completions, chat completions, Responses and
Conversations APIs, their schemas and framing) and `http/` (the plumbing every route
shares: middleware, errors, dependencies, SSE, the OpenAPI document, disconnects). The
bodies every surface builds on are `schemas.py`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline

import model
from app.assembly import assembled
from app.config import Settings

from .http import errors, openapi
from .http.deps import authenticate, bind_client, bind_session, check_rate
from .http.middleware import BodyLimit, BrowserGuard, RequestContext
from .native import health, metrics, playground, sessions, tokens, usage
from .openai import chat_completions, completions, conversations, responses

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(settings: Settings, lm: model.LanguageModel | None = None) -> FastAPI:
    """The ASGI app. `lm` may be preloaded (the CLI does, to fail before starting anything)."""
    if not settings.redis_url:
        raise ValueError("create_app needs settings.redis_url (recur serve starts an embedded Redis)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with assembled(settings, lm) as services:
            app.state.services = services
            try:
                yield
            finally:
                app.state.services = None  # (routes answer not_ready while it closes)

    return _assemble(settings, lifespan)


def _import_limit(app: FastAPI) -> int:
    """The largest state import the app takes now (before the model is loaded, none)."""
    services = app.state.services
    return services.sessions.import_limit if services is not None else 0


def _assemble(settings: Settings, lifespan: Lifespan) -> FastAPI:
    """The routers, error handlers and middleware around `lifespan`."""
    # /docs and /redoc load Swagger UI and ReDoc from a package's files, served here, so the
    # docs work offline and fetch nothing from a CDN
    app = FastAPIOffline(
        static_url="/docs/static",
        title="recur",
        version="0.1.0",
        summary="Streaming inference for recurrent-memory language models, with sessions in Redis",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.services = None  # (app/assembly.py, once the lifespan has built them)
    app.state.api_keys = [k.encode() for k in settings.load_api_keys()]
    errors.install(app)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        # (sized by the served model, once it is loaded: `SessionService.import_limit`)
        by_path={"/v1/sessions/import": lambda: _import_limit(app)},
    )
    app.add_middleware(BrowserGuard, allowed_hosts=settings.allowed_hosts)
    app.add_middleware(RequestContext)
    # every /v1 route authenticates (when keys are set) and logs with its session id
    v1 = [Depends(authenticate), Depends(bind_client), Depends(bind_session), Depends(check_rate)]
    routers = [
        (health.router, []),
        (metrics.router, []),
        (playground.router, []),
        (sessions.router, v1),
        (completions.router, v1),
        (chat_completions.router, v1),
        (responses.router, v1),
        (conversations.router, v1),
        (usage.router, v1),
        (tokens.router, v1),
    ]
    for router, dependencies in routers:
        app.include_router(router, dependencies=dependencies)
    openapi.install(app, routers)
    return app
