"""A minimal Server-Sent Events reader for httpx streaming responses (test helper)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


def events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """Yield (event, parsed JSON data) for each event; comments (pings) are skipped."""
    name, data = "message", []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield name, json.loads("\n".join(data))
            name, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


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
