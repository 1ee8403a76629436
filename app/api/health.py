"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .errors import ApiError, ErrorType, responses
from .schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is alive")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Ready,
    summary="The model is loaded and Redis answers",
    responses=responses(ErrorType.redis_unavailable, ErrorType.not_ready),
)
async def readyz(request: Request) -> Ready:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise ApiError(ErrorType.not_ready, "the model is not loaded yet")
    await request.app.state.store.ping()
    return Ready(status="ready", model=engine.name, fingerprint=engine.fingerprint)
