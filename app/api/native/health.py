"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..http.deps import get_services
from ..http.errors import ErrorType, error_docs
from ..schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is alive")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Ready,
    summary="The model is loaded, its engine is not stalled, and Redis answers",
    responses=error_docs(ErrorType.redis_unavailable, ErrorType.not_ready, ErrorType.engine_stalled),
)
async def readyz(request: Request) -> Ready:
    services = get_services(request)  # 503 until the model is loaded
    sessions, store = services.sessions, services.store
    sessions.engine.watchdog.check()  # 503 while a step has run past its deadline
    await store.ping()
    full = store.connection.memory_full  # the storage guard's last reading
    return Ready(
        status="ready", model=sessions.engine.name, fingerprint=sessions.engine.fingerprint, storage_full=full
    )
