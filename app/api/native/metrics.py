"""`GET /metrics`: the Prometheus exposition of app/metrics.py, access per `metrics_access`."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..http.deps import SettingsDep, check_key, presented_key
from ..http.errors import ApiError, ErrorType

router = APIRouter(tags=["operations"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def prometheus_metrics(request: Request, settings: SettingsDep) -> Response:
    from app import metrics  # (a module of the same name as this one, one level up)

    if settings.metrics_access == "off":
        raise ApiError(ErrorType.not_found, "GET /metrics: Not Found (metrics_access is off)")
    keys: list[bytes] = request.app.state.api_keys
    if settings.metrics_access == "api_key" and keys and check_key(keys, presented_key(request)) is None:
        raise ApiError(
            ErrorType.unauthorized,
            "GET /metrics needs a valid API key (metrics_access=api_key): send `Authorization: Bearer KEY`",
            headers={"WWW-Authenticate": 'Bearer realm="recur"'},
        )
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)
