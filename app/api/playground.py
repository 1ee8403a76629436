"""`GET /`: the playground, one static HTML page (no build step, nothing fetched from
elsewhere) that drives the session API from a browser and streams with EventSource."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["playground"])

_PAGE = resources.files("app").joinpath("static/playground.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, summary="The playground page", include_in_schema=False)
async def playground() -> HTMLResponse:
    # a strict CSP: the page may only talk to this server, and loads nothing from anywhere else
    csp = (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return HTMLResponse(_PAGE, headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache"})
