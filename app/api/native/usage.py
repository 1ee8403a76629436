"""The caller's own quota: what its key holds and may hold (`GET /v1/usage`)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter

from app.store import tenant_of

from ..http.deps import OwnerDep, ServicesDep
from ..http.errors import ErrorType, error_docs
from ..schemas import Held, HeldByKind, Limits, TenantUsage

router = APIRouter(prefix="/v1", tags=["quotas"])


@router.get(
    "/usage",
    response_model=TenantUsage,
    summary="What the caller's key holds, and its limits",
    responses=error_docs(ErrorType.redis_unavailable),
)
async def usage(services: ServicesDep, owner: OwnerDep) -> TenantUsage:
    totals = await services.tenants.usage(owner)
    limits = Limits(**dataclasses.asdict(services.tenants.quota_of(owner)))

    def of(kind: str) -> Held:
        count, nbytes = totals.kinds.get(kind, (0, 0))
        return Held(count=count, bytes=nbytes)

    held = HeldByKind(sessions=of("session"), responses=of("response"), conversations=of("conversation"))
    return TenantUsage(
        tenant=tenant_of(owner),
        sessions=totals.sessions,
        state_bytes=totals.state_bytes,
        held=held,
        limits=limits,
    )
