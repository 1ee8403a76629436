"""The HTTP layer: `create_app` assembles the routers, error handlers and lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Depends, FastAPI

import model
from app import metrics as service_metrics
from app.config import Settings
from app.engine import Engine
from app.store import SessionStore

from . import completions, errors, health, metrics, playground, sessions
from .body_limit import BodyLimit
from .deps import authenticate, bind_session
from .middleware import RequestContext


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
            max_connections=settings.redis_max_connections,
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
            max_queued_requests=settings.max_queued_requests,
            max_queued_tokens=settings.max_queued_tokens,
            cpu_threads=settings.cpu_threads,
            hot_cache_bytes=int(settings.hot_cache_mb * 2**20),
            delta_persistence=settings.delta_persistence,
            compile=settings.compile,
            malloc_trim_interval=settings.malloc_trim_interval,
        )
        engine.start()
        app.state.engine = engine
        service_metrics.bind_engine(
            running=lambda: engine.scheduler.num_running,
            waiting=lambda: engine.scheduler.num_waiting,
            cache_bytes=lambda: engine.cache.nbytes,
            cache_sessions=lambda: len(engine.cache),
        )
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
    app.state.api_keys = [k.encode() for k in settings.load_api_keys()]
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContext)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(playground.router)
    # every /v1 route authenticates (when keys are set) and logs with its session id
    v1 = [Depends(authenticate), Depends(bind_session)]
    app.include_router(sessions.router, dependencies=v1)
    app.include_router(completions.router, dependencies=v1)
    return app
