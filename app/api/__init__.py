"""The HTTP layer: `create_app` assembles the routers, error handlers and lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI

import model
from app.config import Settings
from app.engine import Engine
from app.store import SessionStore

from . import errors, health, sessions
from .body_limit import BodyLimit


def model_name(name_or_dir: str) -> str:
    """The name sessions record: a shipped name as given, a checkpoint directory's basename."""
    return Path(name_or_dir).name or str(name_or_dir)


def create_app(settings: Settings, lm: model.LanguageModel | None = None) -> FastAPI:
    """The ASGI app. `lm` may be preloaded (the CLI does, to fail before starting anything)."""
    if not settings.redis_url:
        raise ValueError("create_app needs settings.redis_url (recur serve starts an embedded Redis)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = SessionStore(
            settings.redis_url or "",
            key_prefix=settings.key_prefix,
            lock_lease_seconds=settings.lock_lease_seconds,
            timeout=settings.redis_timeout,
            fault_pause_before_commit=settings.fault_pause_before_commit,
        )
        app.state.store = store
        loaded = (
            lm
            if lm is not None
            else await asyncio.to_thread(
                model.load, settings.model, device=settings.device, precision=settings.precision
            )
        )
        engine = Engine(
            loaded,
            name=model_name(settings.model),
            state_dtype=settings.state_dtype,
            max_batch_size=settings.max_batch_size,
            cpu_threads=settings.cpu_threads,
        )
        engine.start()
        app.state.engine = engine
        try:
            yield
        finally:
            app.state.engine = None
            await asyncio.to_thread(engine.stop)
            await store.close()

    app = FastAPI(
        title="recur",
        version="0.1.0",
        summary="Streaming inference for recurrent-memory language models, with sessions in Redis",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = None
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(health.router)
    app.include_router(sessions.router)
    return app
