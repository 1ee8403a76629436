"""The caller's own quota: what its key holds and may hold (`GET /v1/usage`)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter

from app.store import tenant_of

from ..http.deps import OwnerDep, ServicesDep
from ..http.errors import ErrorType, error_docs
from ..schemas import Limits, TenantUsage

router = APIRouter(prefix="/v1", tags=["quotas"])


@router.get(
    "/usage",
    response_model=TenantUsage,
    summary="What the caller's key holds, and its limits",
    responses=error_docs(ErrorType.redis_unavailable),
)
async def usage(services: ServicesDep, owner: OwnerDep) -> TenantUsage:
    held = await services.tenants.usage(owner)
    limits = Limits(**dataclasses.asdict(services.tenants.quota_of(owner)))
    return TenantUsage(
        tenant=tenant_of(owner), sessions=held.sessions, state_bytes=held.state_bytes, limits=limits
    )
