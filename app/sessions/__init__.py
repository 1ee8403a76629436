"""The sessions service: a session's whole transaction, from its lock to its commit, the
hot cache and the persistence policy. A reader finds the whole life of a request here:

- service.py: the writes, step by step (lock, start, run, reserve, commit, settle), and
  the persistence policy;
- reads.py: what every request shares (the starting state, running one engine request)
  and the requests that only read;
- run.py: a generation in progress, from its first token to its commit;
- choices.py: many generations of one request (OpenAI's `n`), and requests that name no
  session (prefix reuse);
- cache.py: the hot cache;
- responses.py, conversations.py, background.py: the Responses and Conversations APIs'
  transactions (a response is a session version; a conversation is a session) and the
  background responses' workers, leases and sweep.

Tenant accounting (admission, quotas, settlement) is app/tenants.py's, called at a
transaction's start and end; Redis is app/store's; the model is app/engine's. This package
knows neither HTTP nor tensors.
"""

from __future__ import annotations

from app.config import Settings
from app.engine import Engine, Fairness
from app.store import Store, owner_of
from app.tenants import Tenants
from model import LanguageModel

from .background import Background, Replay
from .cache import Held, HotCache
from .choices import Started, needs_whole_prompt, start, stateless
from .conversations import Conversations
from .reads import Listed, Listing, ModelMismatch, SessionReads
from .responses import Begun, NotContinuable, Render, Responses, Turn
from .run import ClientDisconnected, Run
from .service import Generation, SessionService, StateRejected

__all__ = [
    "Background",
    "Replay",
    "Begun",
    "ClientDisconnected",
    "Conversations",
    "NotContinuable",
    "Render",
    "Responses",
    "Turn",
    "Generation",
    "Held",
    "HotCache",
    "Listed",
    "Listing",
    "ModelMismatch",
    "Run",
    "SessionReads",
    "SessionService",
    "Started",
    "StateRejected",
    "build",
    "build_engine",
    "build_stateful",
    "needs_whole_prompt",
    "start",
    "stateless",
]


def build_engine(settings: Settings, lm: LanguageModel, name: str) -> Engine:
    """The engine as `settings` describe it (not yet started)."""
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


def build(settings: Settings, store: Store, engine: Engine) -> SessionService:
    """The service, and the tenants room it calls, as `settings` describe them."""
    tenants = Tenants(
        store.tenants,
        store.connection,
        quota=settings.quota(),
        quotas={owner_of(key): quota for key, quota in settings.load_tenants().items()},
        max_streams=settings.max_streams_per_key,
    )
    return SessionService(
        store.sessions,
        tenants,
        engine,
        HotCache(int(settings.hot_cache_mb * 2**20)),
        # the model keeps the precision in its states where it can; else a commit rounds to it
        state_dtype=engine.lm.keep_states_in(settings.state_dtype),
        delta_persistence=settings.delta_persistence,
        history_versions=settings.history_versions,
        prefix_reuse=settings.prefix_reuse,
        stateless_ttl=settings.stateless_session_ttl,
        # a small multiple of the largest state the served model can produce, unless set
        import_limit=int(settings.max_import_mb * 2**20) or 2 * engine.lm.max_state_bytes(),
        max_imports=settings.max_concurrent_imports,
    )


def build_stateful(
    settings: Settings, store: Store, service: SessionService
) -> tuple[Responses, Conversations, Background]:
    """The Responses and Conversations APIs' rooms over the sessions service."""
    retention = settings.response_retention
    responses = Responses(service, store.responses, retention)
    return (
        responses,
        Conversations(service, store.responses, retention),
        Background(
            store.responses, responses, service.tenants, lease=settings.response_lease_seconds,
            retention=retention, max_replays=settings.max_replays_per_key,
            replay_rate=settings.replay_mb_per_second * 2**20,
        ),  # fmt: skip
    )
