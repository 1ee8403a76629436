"""Assembly: the services built in order, closed in reverse, and handed out as one typed
object (`Services`), whose fields the routers ask for by name (app/api/http/deps.py).

The order: the store (Redis), the model, its chat template (checked now: a broken one fails
the start, not a chat), the engine (started), the sessions service over both, the Responses
and Conversations rooms over the service, and the background responses' sweep (started).
Closing runs the other way: the sweep and the background workers, the engine (its last
commits encoded), then the store. Nothing here serves a request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import model
from app import metrics
from app.config import Settings
from app.engine import Engine, Fairness
from app.sessions import Background, Conversations, HotCache, Responses, SessionService
from app.store import Store, owner_of
from app.tenants import Tenants
from model import LanguageModel
from model.chat_template import ChatTemplate


@dataclass(frozen=True)
class Services:
    """What the routers use, each by its name."""

    settings: Settings
    store: Store
    engine: Engine
    tenants: Tenants
    sessions: SessionService
    responses: Responses
    conversations: Conversations
    background: Background
    chat_template: ChatTemplate | None  # the served checkpoint's, if it has one


def model_name(name_or_dir: str) -> str:
    """The name sessions record: a shipped name as given, a checkpoint directory's basename."""
    return Path(name_or_dir).name or str(name_or_dir)


@contextlib.asynccontextmanager
async def assembled(settings: Settings, lm: LanguageModel | None = None) -> AsyncIterator[Services]:
    """The services, running, for the time of the block. `lm` may be preloaded (the CLI
    does, to fail before starting anything)."""
    store = Store.from_settings(settings)
    try:
        loaded = lm if lm is not None else await asyncio.to_thread(
            model.load, settings.model, device=settings.device, precision=settings.precision,
            options=settings.model_options,
        )  # fmt: skip
        template = await asyncio.to_thread(model.checkpoint.chat_template, settings.model)
        engine = build_engine(settings, loaded, model_name(settings.model))
        engine.start()
        try:
            tenants = build_tenants(settings, store)
            sessions = build_sessions(settings, store, engine, tenants)
            store.connection.watch_memory(settings.storage_guard)
            responses = Responses(sessions, store.responses, settings.response_retention)
            background = build_background(settings, store, responses, tenants)
            background.start()  # the sweep of background responses' lapsed leases
            metrics.bind_engine(engine, sessions.cache)
            try:
                yield Services(
                    settings, store, engine, tenants, sessions, responses,
                    Conversations(sessions, store.responses, settings.response_retention), background, template,
                )  # fmt: skip
            finally:
                await background.close()
        finally:
            await asyncio.to_thread(engine.stop)
    finally:
        await store.close()


def build_engine(settings: Settings, lm: LanguageModel, name: str) -> Engine:
    """The engine as `settings` describe it (not yet started)."""
    lm.set_state_dtype(settings.state_dtype)  # before any state, or compiled step, is made
    return Engine(
        lm,
        name=name,
        max_batch_size=settings.max_batch_size,
        max_queued_requests=settings.max_queued_requests,
        max_queued_tokens=settings.max_queued_tokens,
        cpu_threads=settings.cpu_threads,
        compile=settings.compile,
        malloc_trim_interval=settings.malloc_trim_interval,
        step_deadline=settings.engine_step_deadline,
        prefill_tokens_per_step=settings.prefill_tokens_per_step,
        fairness=Fairness(
            batch_share=settings.key_batch_share,
            queue_share=settings.key_queue_share,
            buffer_tokens=settings.stream_buffer_tokens,
        ),
    )


def build_tenants(settings: Settings, store: Store) -> Tenants:
    """The tenants room (admission, quotas, settlement), as `settings` describe it."""
    return Tenants(
        store.tenants,
        store.connection,
        quota=settings.quota(),
        quotas={owner_of(key): quota for key, quota in settings.load_tenants().items()},
        max_streams=settings.max_streams_per_key,
    )


def build_sessions(settings: Settings, store: Store, engine: Engine, tenants: Tenants) -> SessionService:
    """The sessions service, as `settings` describe it."""
    return SessionService(
        store.sessions,
        tenants,
        engine,
        HotCache(int(settings.hot_cache_mb * 2**20)),
        # the model keeps the precision in its states where it can (`build_engine` told it);
        # else a commit rounds to it
        state_dtype=engine.lm.set_state_dtype(settings.state_dtype),
        delta_persistence=settings.delta_persistence,
        history_versions=settings.history_versions,
        prefix_reuse=settings.prefix_reuse,
        stateless_ttl=settings.stateless_session_ttl,
        # a small multiple of the largest state the served model can produce, unless set
        import_limit=int(settings.max_import_mb * 2**20) or 2 * engine.lm.max_state_bytes(),
        max_imports=settings.max_concurrent_imports,
        import_rate=settings.import_mb_per_second * 2**20,
    )


def build_background(settings: Settings, store: Store, responses: Responses, tenants: Tenants) -> Background:
    """The background responses' workers, replays and sweep."""
    return Background(
        store.responses, responses, tenants, lease=settings.response_lease_seconds,
        retention=settings.response_retention, max_replays=settings.max_replays_per_key,
        replay_rate=settings.replay_mb_per_second * 2**20,
    )  # fmt: skip
