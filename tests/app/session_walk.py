"""A session's life over the API, the walk every family's server must pass alike (the routes
never know which family they serve): a streamed generation is the generation; the history,
fork, rollback, export and import continue exactly; the OpenAI routes answer. Used by the
families' API tests (tests/app/test_ssm_api.py, tests/app/test_hybrid_api.py), beside the
boundary invariance of tests/app/boundaries.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.app.boundaries import create
from tests.app.sse_client import generate as stream_generate


def ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, r.text
    return r.json()


def greedy(http: httpx.Client, sid: str, n: int = 12) -> dict:
    """`n` greedy tokens generated into session `sid`, with their log-probs (committed)."""
    body = {"stream": False, "max_tokens": n, "temperature": 0, "logprobs": True}
    return ok(http.post(f"/v1/sessions/{sid}/generate", json=body))


def ids(generated: dict) -> list[int]:
    return [t["id"] for t in generated["tokens"]]


def assert_a_streamed_generation_is_the_generation(http: httpx.Client) -> None:
    s = create(http, prompt="ROMEO:")
    twin = ok(http.post(f"/v1/sessions/{s['id']}/fork"), 201)
    tokens, final, data = stream_generate(http, s["id"], max_tokens=15, temperature=0)
    assert final == "done", data
    assert [t["id"] for t in tokens] == ids(greedy(http, twin["id"], 15))


def assert_history_fork_rollback_export_and_import_continue_exactly(http: httpx.Client, prompt: str) -> None:
    """Two greedy turns after `prompt`: both versions kept (a past one exports), a fork of the
    first continues as the second did, a rollback to it too (log-probs within 1e-5), and the
    state exported and imported continues as a fork of the original."""
    s = create(http, prompt=prompt)
    v1 = greedy(http, s["id"])
    v2 = greedy(http, s["id"])
    kept = {v["version"]: v["n_tokens"] for v in ok(http.get(f"/v1/sessions/{s['id']}/versions"))["versions"]}
    assert kept[1] == v1["session"]["n_tokens"] and kept[2] == v2["session"]["n_tokens"]
    assert http.get(f"/v1/sessions/{s['id']}/state", params={"version": 1}).status_code == 200
    fork = ok(http.post(f"/v1/sessions/{s['id']}/fork", json={"version": 1}), 201)
    assert fork["n_tokens"] == v1["session"]["n_tokens"] and ids(greedy(http, fork["id"])) == ids(v2)
    back = ok(http.post(f"/v1/sessions/{s['id']}/rollback", json={"version": 1}))
    assert back["version"] == 3 and back["n_tokens"] == v1["session"]["n_tokens"]
    again = greedy(http, s["id"])
    assert ids(again) == ids(v2)
    assert [t["logprob"] for t in again["tokens"]] == pytest.approx(
        [t["logprob"] for t in v2["tokens"]], abs=1e-5
    )
    # export, import: the state format itself, verified, continuing as a fork of the original
    twin = ok(http.post(f"/v1/sessions/{s['id']}/fork"), 201)
    blob = http.get(f"/v1/sessions/{s['id']}/state").content
    r = http.post("/v1/sessions/import", content=blob, headers={"Content-Type": "application/octet-stream"})
    imported = ok(r, 201)
    assert imported["n_tokens"] == twin["n_tokens"]
    assert ids(greedy(http, imported["id"])) == ids(greedy(http, twin["id"]))


def assert_the_openai_routes_answer(oa: openai.OpenAI) -> str:
    """A greedy completion, streamed and not, alike; a chat completion (the play-script
    template). Returns the served model's card id."""
    card = oa.models.list().data[0]
    done = oa.completions.create(model=card.id, prompt="ROMEO:", max_tokens=10, temperature=0, logprobs=1)
    chunks = list(
        oa.completions.create(model=card.id, prompt="ROMEO:", max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert done.usage is not None and done.usage.completion_tokens == 10
    chat = oa.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": "Good morrow."}], max_tokens=8, temperature=0
    )
    assert (
        chat.choices[0].message.role == "assistant"
        and chat.usage is not None
        and chat.usage.prompt_tokens > 0
    )
    return card.id
