"""Server crash: SIGKILL the server while 20 streaming generations are in flight, restart it.

Every session must sit at its last committed version (the last `done` its client saw),
hold an intact state blob (container, shapes, checksum, fingerprint), and continue from
exactly that state after the restart. For every family: Transformer-XL and RLT on the
server the fault tests share (`durable_up`), a tiny LLaMA GGUF file, Mamba and Mamba-2 on
one of their own (`durable_of`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

import model
from tests.conftest import ServerProcess
from tests.stored_pages import loose_pages

from .harness import (
    MORE_FAMILIES,
    DurableRedis,
    StreamOutcome,
    durable_server,
    honour_retry_after,
    local_logprobs,
    make_model,
    store_for,
    stored,
    stream_generate,
)

N_SESSIONS = 20
PROBE = list(b" probe!")


@pytest.fixture(scope="module", params=MORE_FAMILIES)
def durable_of(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DurableRedis, ServerProcess, model.LanguageModel]]:
    """A tiny model of each family beyond Transformer-XL and RLT in turn, served on a durable
    Redis of its own, and the model loaded here to check stored states against."""
    path = make_model(str(request.param), tiny_model_dir, tmp_path_factory)
    with durable_server(path, tmp_path_factory.mktemp("durable")) as (red, srv):
        yield red, srv, model.load(path, device="cpu")


def test_sigkill_during_streaming_generations(durable_up, lm):
    sigkill_mid_traffic(*durable_up, lm)


def test_sigkill_during_streaming_generations_llm_and_ssm(durable_of):
    sigkill_mid_traffic(*durable_of)


def sigkill_mid_traffic(red: DurableRedis, srv: ServerProcess, lm: model.LanguageModel) -> None:
    """20 sessions each commit two short generations, then stream long ones until the kill;
    after it, each must be at its last acknowledged commit, hold exactly the state of the
    tokens acknowledged (replayed here from the streamed ids), and continue from it."""
    keys = store_for(srv)
    r = redis.Redis.from_url(red.url)
    try:
        with srv.client() as c:
            sids, consumed = [], {}  # consumed: the tokens of each session's acknowledged commits
            for i in range(N_SESSIONS):
                prompt = f"session {i}:"
                resp = c.post("/v1/sessions", json={"prompt": prompt})
                assert resp.status_code == 201, resp.text
                sids.append(resp.json()["id"])
                bos = [] if lm.tokenizer.bos_id is None else [lm.tokenizer.bos_id]
                consumed[sids[-1]] = bos + lm.tokenizer.encode(prompt)
                assert resp.json()["n_tokens"] == len(consumed[sids[-1]])
        acked: dict[str, tuple[int, int]] = {sid: (0, 0) for sid in sids}
        outcomes: list[StreamOutcome] = []
        in_long = [threading.Event() for _ in sids]
        lock = threading.Lock()

        def client_loop(i: int, sid: str) -> None:
            # two short generations that commit, then long ones that are cut by the kill
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                for k in range(10):
                    long = k >= 2
                    # a long one runs until the kill, whatever the model samples
                    body = (
                        {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}
                        if long
                        else {"max_tokens": 3 + k, "seed": k}
                    )
                    out = stream_generate(c, sid, body, on_token=in_long[i] if long else None)
                    in_long[i].clear()  # (a long one may end early, at EOS)
                    with lock:
                        outcomes.append(out)
                        if out.kind == "done":
                            acked[sid] = (out.version, out.n_tokens)
                            consumed[sid] = consumed[sid] + out.ids
                    if out.kind == "transport":
                        return

        threads = [threading.Thread(target=client_loop, args=(i, s)) for i, s in enumerate(sids)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in in_long):
            assert time.monotonic() < deadline, "the generations never all got going"
            time.sleep(0.01)
        srv.kill()  # SIGKILL by PID, 20 streams mid-flight
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)

        done = [o for o in outcomes if o.kind == "done"]
        assert len(done) >= 2 * N_SESSIONS  # the short ones committed
        assert {o.kind for o in outcomes} <= {"done", "transport"}, outcomes
        assert sum(o.kind == "transport" for o in outcomes) == N_SESSIONS  # one cut stream each

        # Redis holds each session at its last acknowledged commit, blobs intact
        before = {}
        for sid in sids:
            s = stored(r, keys, sid, lm)
            v, n = acked[sid]
            # a commit whose `done` was lost with the server may be one ahead, never more
            assert s.version in (v, v + 1), (sid, s.version, v)
            if s.version == v:
                # and its state is the acknowledged tokens', not merely their number
                assert s.n_tokens == n == len(consumed[sid])
                _, replayed = lm.consume(consumed[sid], lm.new_state(1))
                assert local_logprobs(lm, s.state, PROBE) == pytest.approx(
                    local_logprobs(lm, replayed, PROBE), abs=1e-4
                ), sid
            before[sid] = s
        # and no page that is neither counted nor expiring (the kill left no write half done)
        assert not loose_pages(r, keys)

        srv.start()
        with srv.client() as c:
            for sid, s in before.items():
                # the restarted server continues from exactly the stored state
                resp = c.post(f"/v1/sessions/{sid}/score", json={"prompt": PROBE})
                assert resp.status_code == 200, resp.text
                got = [t["logprob"] for t in resp.json()["tokens"]]
                assert got == pytest.approx(local_logprobs(lm, s.state, PROBE), abs=1e-4)
                # and moves on: the killed stream's lock lapses with its lease, and a client
                # that waits the Retry-After of its 409 gets through on its one retry
                resp = honour_retry_after(
                    lambda sid=sid: c.post(
                        f"/v1/sessions/{sid}/generate",
                        json={"stream": False, "max_tokens": 4, "temperature": 0},
                    ),
                    lease_s=float(srv.settings["lock_lease_seconds"]),
                )
                assert resp.status_code == 200, resp.text
                d = resp.json()
                assert d["session"]["version"] == s.version + 1
                assert d["session"]["n_tokens"] == s.n_tokens + d["usage"]["completion_tokens"]
                after = stored(r, keys, sid, lm)
                assert (after.version, after.n_tokens) == (s.version + 1, d["session"]["n_tokens"])
    finally:
        r.close()
