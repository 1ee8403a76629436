"""Server-Sent Events for the tests, read with the client's own parser (`app.chat`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from app.chat import sse_events


def events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """Yield (event, parsed JSON data) for each event; comments (pings) are skipped."""
    return sse_events(response.iter_lines())


@contextlib.contextmanager
def generating(client: httpx.Client, sid: str, **body: object) -> Iterator[Iterator[tuple[str, dict]]]:
    """A long greedy streaming generate, held open: yields its remaining events once the
    first token has come (the request then holds the session); leaving closes the stream."""
    body = {"max_tokens": 1000, "temperature": 0, **body}
    with client.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        it = events(r)
        assert next(it)[0] == "token"
        yield it


def generate(client: httpx.Client, sid: str, **body: object) -> tuple[list[dict], str, dict]:
    """Run a streaming generate to the end: (token events, final event name, its data)."""
    with client.stream("POST", f"/v1/sessions/{sid}/generate", json={"stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        tokens = []
        for name, data in events(r):
            if name == "token":
                tokens.append(data)
            else:
                return tokens, name, data
    raise AssertionError("stream ended without a done or error event")
