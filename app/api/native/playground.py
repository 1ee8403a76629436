"""`GET /`: the playground, one static HTML page (no build step, nothing fetched from
elsewhere) that shows what the caller's sessions hold (list, transcript, versions, state
files) and streams generations, all through the public session API.

It must never grow a route of its own for the page: whatever the page shows, any API
client can read the same way."""

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
