"""The exact-policy replay contract over HTTP, for both families: a session generated with
mixed sampling settings through the real server (real Redis, fp32 on the CPU), with
prompt-only commits, a rollback, a fork and a stream kept on hang-up in between, replays
from its transcript (`GET /v1/sessions/{id}/transcript`, fetched by `recur replay`'s
client) to importance ratios of 1 within 1e-5, one per sampled token; changed weights
move them. RLT runs on the tiny model in the default suite, the shipped one in the slow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import model
from app.cli import main
from app.replay_client import fetch_transcript, server_precision
from model.checkpoint import resolve
from model.replay import replay_transcript, transcript_rollout
from tests.app.test_disconnect import raw_events, settled
from tests.conftest import ServerProcess, tiny_model_of

KEY = "key-replay"
SETTINGS = {
    "api_keys": KEY,
    "precision": "fp32",
    "cpu_threads": 1,
    "max_tokens": 200,
    "max_prompt_tokens": 400,
}
# every request a different sampler: greedy, temperature, top-k, top-p, both, a stop string,
# penalties, min_p, logit_bias, min_tokens with stop ids; seeded, so the tokens (and how
# close fp32 comes to ratio 1) are the same on every run
TURNS: list[dict] = [
    {"prompt": "\n", "max_tokens": 60, "temperature": 0},
    {"prompt": " O", "max_tokens": 40, "temperature": 0.8, "top_k": 20, "seed": 1},
    {"score": " Thou art"},
    {"prompt": "", "max_tokens": 40, "temperature": 1.2, "top_p": 0.9, "seed": 2},
    {"prompt": " no", "max_tokens": 20, "temperature": 1.0, "seed": 5},  # undone by the rollback
    {"rollback": 4},
    {
        "prompt": ",",
        "max_tokens": 100,
        "temperature": 1.0,
        "top_k": 5,
        "top_p": 0.7,
        "seed": 3,
        "stop": ["!"],
    },
    {"prompt": " and", "max_tokens": 100, "temperature": 0.7, "seed": 6},
    # the controls whose distribution depends on the request's own prompt and output
    {
        "prompt": " thee",
        "max_tokens": 60,
        "temperature": 0.9,
        "repetition_penalty": 1.3,
        "min_p": 0.05,
        "seed": 11,
    },
    {
        "max_tokens": 50,
        "temperature": 1.1,
        "presence_penalty": 0.8,
        "frequency_penalty": 0.6,
        "top_k": 30,
        "seed": 12,
    },
    {
        "prompt": "!",
        "max_tokens": 40,
        "logit_bias": {"101": 4.0, "32": -3.0},
        "min_tokens": 10,
        "stop_token_ids": [10, 33],
        "seed": 13,
    },
    {"prompt": " O", "max_tokens": 30, "temperature": 0, "repetition_penalty": 1.8, "frequency_penalty": 0.5},
    {"keep": 4, "temperature": 0.9, "top_p": 0.95, "presence_penalty": 0.5, "seed": 4},
]


def checkpoint(name: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A shipped model's name, or the directory of the tiny RLT (`tiny-rlt`)."""
    return str(tiny_model_of("rlt", tiny_model_dir, tmp_path_factory)) if name == "tiny-rlt" else name


@pytest.fixture(
    scope="module",
    # RLT on the tiny model in the default suite; the shipped RLT (minutes of replay on
    # 2 cores) in the slow one
    params=["shakespeare", "tiny-rlt", pytest.param("shakespeare-rlt", marks=pytest.mark.slow)],
)
def served(
    request: pytest.FixtureRequest,
    redis_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, ServerProcess]]:
    """(the model as `recur replay` and `model.load` take it, its server)"""
    name = checkpoint(request.param, tiny_model_dir, tmp_path_factory)
    srv = ServerProcess(resolve(name), tmp_path_factory.mktemp(request.param), redis_url, **SETTINGS)
    srv.start()
    try:
        yield name, srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(served: tuple[str, ServerProcess]) -> Iterator[httpx.Client]:
    with served[1].client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, r.text
    return r.json()


def drive(c: httpx.Client, sid: str, turns: list[dict]) -> dict[int, int]:
    """Run `turns` on the session; returns {version: tokens sampled} of the commits its
    current state descends from (a rollback drops the later ones)."""
    sampled: dict[int, int] = {}
    for turn in turns:
        if "score" in turn:
            ok(c.post(f"/v1/sessions/{sid}/score", json={"prompt": turn["score"], "commit": True}))
        elif "rollback" in turn:
            done = ok(c.post(f"/v1/sessions/{sid}/rollback", json={"version": turn["rollback"]}))
            sampled = {v: n for v, n in sampled.items() if v <= turn["rollback"]}
            assert done["version"] > turn["rollback"]
        elif "keep" in turn:
            before = ok(c.get(f"/v1/sessions/{sid}"))
            body = {k: v for k, v in turn.items() if k != "keep"}
            raw_events(c, sid, {"max_tokens": 200, "on_disconnect": "commit", **body}, take=turn["keep"])
            kept = settled(c, sid)
            assert kept["version"] == before["version"] + 1
            sampled[kept["version"]] = kept["n_tokens"] - before["n_tokens"]
        else:
            done = ok(c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, **turn}))
            sampled[done["session"]["version"]] = len(done["tokens"])
    return sampled


@pytest.fixture(scope="module")
def session(http: httpx.Client) -> tuple[str, dict[int, int]]:
    """A session driven through every turn: (its id, {version: tokens sampled})."""
    sid = ok(http.post("/v1/sessions", json={"prompt": "ROMEO:"}), 201)["id"]
    return sid, drive(http, sid, TURNS)


def test_a_session_replays_over_http_to_ratio_one(served, session):
    name, srv = served
    sid, n_sampled = session[0], sum(session[1].values())
    transcript = fetch_transcript(srv.url, sid, KEY)
    rollout = transcript_rollout(transcript)
    lm = model.load(name, device="cpu", precision="fp32")
    assert len(rollout.ids) == transcript["n_tokens"] > 2 * lm.segment_len  # chunks cross boundaries
    assert {s["kind"] for s in transcript["segments"]} >= {"create", "generate", "score", "rollback", "keep"}
    used = [s["sampling"] for s in transcript["segments"] if s["sampling"]]
    assert {(u["repetition_penalty"], u["min_tokens"], len(u["logit_bias"])) for u in used} >= {
        (1.3, 0, 0),
        (1.0, 10, 2),
    }
    result = replay_transcript(lm, rollout)
    assert len(result.ratios) == n_sampled > 150
    worst = max(abs(r - 1) for r in result.ratios)
    assert worst <= 1e-5, worst


def test_recur_replay_fetches_the_session_and_replays_in_the_servers_precision(served, session, capsys):
    name, srv = served
    sid, n_sampled = session[0], sum(session[1].values())
    args = ["replay", name, "--url", srv.url, "--session", sid, "--api-key", KEY]
    assert server_precision(srv.url, KEY) == "fp32"
    assert main([*args, "--precision", "auto"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["precision"] == "fp32" and report["n_actions"] == n_sampled
    assert report["max_abs_ratio_minus_1"] <= 1e-5 and abs(report["mean_ratio"] - 1) <= 1e-5
    assert len(report["worst"]) == 10 and f"replayed {n_sampled} sampled tokens" in out.err
    # --since-version scores only the later commits; the states still come from the start
    version = max(session[1])
    assert main([*args, "--since-version", str(version - 1)]) == 0
    last = json.loads(capsys.readouterr().out)
    assert last["n_actions"] == session[1][version] >= TURNS[-1]["keep"]
    assert last["max_abs_ratio_minus_1"] <= 1e-5


def test_a_fork_replays_with_its_parents_history(served, http, session):
    name, srv = served
    parent, n_parent = session[0], sum(session[1].values())
    fork = ok(http.post(f"/v1/sessions/{parent}/fork"), 201)["id"]
    more = drive(
        http, fork, [{"prompt": " so", "max_tokens": 25, "temperature": 1.1, "top_k": 30, "seed": 9}]
    )
    result = replay_transcript(
        model.load(name, device="cpu"), transcript_rollout(fetch_transcript(srv.url, fork, KEY))
    )
    assert len(result.ratios) == n_parent + sum(more.values())
    assert max(abs(r - 1) for r in result.ratios) <= 1e-5


def test_changed_weights_move_the_ratios(served, session, tmp_path: Path, capsys):
    name, srv = served
    lm = model.load(name, device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        weight = next(p for n, p in lm.named_parameters() if p.dim() == 2 and "emb" not in n)
        weight.add_(torch.randn_like(weight) * 0.05)  # one weight matrix of the updated policy
    model.save(lm, tmp_path / "updated")
    assert (
        main(
            ["replay", str(tmp_path / "updated"), "--url", srv.url, "--session", session[0], "--api-key", KEY]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["n_actions"] == sum(session[1].values()) and report["max_abs_ratio_minus_1"] > 1e-3


@pytest.mark.parametrize("model_name", ["tiny-rlt", pytest.param("shakespeare-rlt", marks=pytest.mark.slow)])
def test_auto_precision_follows_a_bf16_server(
    model_name, redis_url, tiny_model_dir, tmp_path_factory, tmp_path: Path, capsys
):
    """A server in bf16 (autocast, on the CPU here) says so on GET /v1/models; replay in fp32
    sees its rounding, and `--precision auto` replays in bf16."""
    name = checkpoint(model_name, tiny_model_dir, tmp_path_factory)
    srv = ServerProcess(resolve(name), tmp_path, redis_url, **{**SETTINGS, "precision": "bf16"}).start()
    try:
        assert server_precision(srv.url, KEY) == "bf16"
        with srv.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
            sid = ok(c.post("/v1/sessions", json={"prompt": "ROMEO:"}), 201)["id"]
            n = sum(drive(c, sid, [{"max_tokens": 60, "temperature": 1.0, "seed": 7}]).values())
        args = ["replay", name, "--url", srv.url, "--session", sid, "--api-key", KEY]
        reports = {}
        for precision in ("fp32", "auto"):
            assert main([*args, "--precision", precision]) == 0
            reports[precision] = json.loads(capsys.readouterr().out)
    finally:
        srv.stop()
    assert reports["auto"]["precision"] == "bf16" and reports["auto"]["n_actions"] == n
    fp32 = reports["fp32"]
    assert fp32["precision"] == "fp32" and fp32["max_abs_ratio_minus_1"] > 1e-4  # bf16's rounding
    assert abs(fp32["mean_ratio"] - 1) < 0.05  # noise around 1, not another policy


def test_replay_says_what_went_wrong_with_the_server(served, session):
    name, srv = served
    base = ["replay", name, "--url", srv.url, "--session"]
    with pytest.raises(SystemExit, match="recur replay: GET .* answered 401"):
        main([*base, session[0], "--api-key", "wrong"])
    with pytest.raises(SystemExit, match="recur replay: GET .* answered 404"):
        main([*base, "no-such-session", "--api-key", KEY])
    with pytest.raises(SystemExit, match="recur replay: cannot reach"):
        main(["replay", name, "--url", "http://127.0.0.1:1", "--session", session[0]])
