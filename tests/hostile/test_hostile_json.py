"""Deep JSON gets 4xx, and metric labels stay bounded (issue 25, attacks 7 and 6).

Attack 7: JSON nested ~1,000 deep on any JSON route, or an import header nested 100k
deep, gave 500 `internal_error` (a RecursionError) and the connection was dropped. Now
nesting is bounded on every JSON route and in state headers: a clear 4xx, the usual error
body, and the connection stays usable.

Attack 6: every unknown HTTP method name became a metrics label that was never freed (60k
names grew /metrics to 127 MB). Now a method HTTP does not define is the one label `other`.
"""

from __future__ import annotations

import json
import secrets

import httpx
import pytest
import torch
from safetensors.torch import save as st_save

from .conftest import ATTACKER, as_key, assert_error
from .states import full_state

SID = "0" * 32  # (validation runs before the route looks the session up)


def _json_routes(http: httpx.Client) -> list[tuple[str, str]]:
    """Every operation of the OpenAPI document that takes a JSON body: (method, path)."""
    doc = http.get("/openapi.json").json()
    out = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if "application/json" in op.get("requestBody", {}).get("content", {}):
                out.append((method.upper(), path.replace("{session_id}", SID)))
    assert len(out) >= 8, out
    return out


def _nested(depth: int, shape: str) -> str:
    if shape == "lists":
        return '{"prompt": ' + "[" * depth + "]" * depth + "}"
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("shape", ["lists", "objects"])
@pytest.mark.parametrize("depth", [40, 300, 500, 800, 990, 1_000, 5_000, 100_000])
def test_deep_json_on_every_json_route_is_a_4xx_and_the_connection_lives(http, depth, shape):
    body = _nested(depth, shape)
    for method, path in _json_routes(http):
        r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text[:300])
        assert_error(r, r.status_code)
        # the same connection answers the next request
        assert http.get("/healthz").status_code == 200


def test_a_state_header_nested_deep_is_refused_as_invalid_state(tenants, hostile_models):
    """(On the server whose import limit is raised: by default these blobs are 413 already.)"""
    _, state = full_state(hostile_models["txl"])
    http = as_key(tenants, ATTACKER)
    tensors = {k: state[k].contiguous() for k in state.persistent}
    for depth in (5_000, 100_000):
        header = "[" * depth + "]" * depth
        blob = st_save(tensors, metadata={"recur": header})
        r = http.post(
            "/v1/sessions/import", content=blob, headers={"Content-Type": "application/octet-stream"}
        )
        assert_error(r, 422, "invalid_state")
        assert http.get("/healthz").status_code == 200
    # nested inside an otherwise well-formed header, too
    deep = json.dumps({"format": 1, "x": json.loads("[" * 900 + "]" * 900)})
    r = http.post(
        "/v1/sessions/import",
        content=st_save(tensors, metadata={"recur": deep}),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert_error(r, 422, "invalid_state")
    assert torch.isfinite(tensors["mem"]).all()  # (the tensors themselves were fine)
    http.close()


def test_unknown_methods_share_one_metrics_label(http):
    names = [f"X{secrets.token_hex(6).upper()}" for _ in range(40)]
    for name in names:
        r = http.request(name, "/healthz")
        assert r.status_code in (400, 405, 501), r.status_code
    for name in names:  # on a route that does not exist, too
        http.request(name, f"/nowhere/{name.lower()}")
    exposition = http.get("/metrics").text
    assert not [n for n in names if n in exposition]
    assert 'method="other"' in exposition
    # the route label of a path no route matches is one label too
    assert "nowhere" not in exposition
