"""The HTTP layer: `create_app` assembles the routers, error handlers and lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline

import model
from app import metrics as service_metrics
from app import sessions as sessions_service
from app.config import Settings
from app.store import Store

from . import (
    chat_completions,
    completions,
    conversations,
    errors,
    health,
    metrics,
    openapi,
    playground,
    responses,
    sessions,
    tokens,
    usage,
)
from .deps import authenticate, bind_client, bind_session, check_rate
from .middleware import BodyLimit, BrowserGuard, RequestContext

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def model_name(name_or_dir: str) -> str:
    """The name sessions record: a shipped name as given, a checkpoint directory's basename."""
    return Path(name_or_dir).name or str(name_or_dir)


def create_app(settings: Settings, lm: model.LanguageModel | None = None) -> FastAPI:
    """The ASGI app. `lm` may be preloaded (the CLI does, to fail before starting anything)."""
    if not settings.redis_url:
        raise ValueError("create_app needs settings.redis_url (recur serve starts an embedded Redis)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store.from_settings(settings)
        loaded = (
            lm
            if lm is not None
            else await asyncio.to_thread(
                model.load,
                settings.model,
                device=settings.device,
                precision=settings.precision,
                options=settings.model_options,
            )
        )
        # the checkpoint's chat template, checked now: a broken one fails the start, not a chat
        app.state.chat_template = await asyncio.to_thread(model.checkpoint.chat_template, settings.model)
        engine = sessions_service.build_engine(settings, loaded, model_name(settings.model))
        engine.start()
        sessions = sessions_service.build(settings, store, engine)
        store.connection.watch_memory(settings.storage_guard)
        app.state.store = store
        app.state.sessions = sessions
        app.state.stateful = sessions_service.build_stateful(settings, store, sessions)
        app.state.stateful[2].start()  # the sweep of background responses' lapsed leases
        service_metrics.bind_engine(engine, sessions.cache)
        try:
            yield
        finally:
            await app.state.stateful[2].close()
            app.state.sessions = None
            await asyncio.to_thread(engine.stop)
            await store.close()

    return _assemble(settings, lifespan)


def _import_limit(app: FastAPI) -> int:
    """The largest state import the app takes now (before the model is loaded, none)."""
    sessions = app.state.sessions
    return sessions.import_limit if sessions is not None else 0


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
    app.state.sessions = None
    app.state.store = None
    app.state.stateful = None
    app.state.chat_template = None
    app.state.api_keys = [k.encode() for k in settings.load_api_keys()]
    errors.install(app)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        # (sized by the served model, once it is loaded: `sessions.build`)
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
