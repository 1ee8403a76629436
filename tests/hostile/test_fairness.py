"""One client cannot crowd out another (issue 25, attack 5).

500 streams that never read, from one key, held the batch (32), the queue (256) and the
Redis pool for as long as their connections stayed open: another key got 15 x 429
queue_full out of 16 requests, and a 503 redis_unavailable.

Now a client (an API key; without keys, an address) runs at most `max_streams_per_key`
generations at once (429 before any work, so a flood never reaches Redis); its requests
fill at most `key_queue_share` of the queue; while a client with less work is active, it
holds at most `key_batch_share` of the batch (its newest rows parked, states kept); and a
stream whose client leaves `stream_buffer_tokens` unread is paused out of the batch.

The engine tests below step the scheduler by hand and assert the scheduling itself, step
by step; how that bounds a victim's latency is measured side by side in
`bench/hostile.py`, never timed in a test.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import pytest

import model
from app.engine import QueueFull, Request, Stored
from model.sampling import SamplingParams
from model.state import Persist
from tests.app.engine_requests import engine_for

from .conftest import ATTACKER, VICTIM, as_key
from .states import full_state

FLOOD, LIGHT = "flood", "light"
BATCH, QUEUE = 8, 16
SETTINGS = dict(
    cpu_threads=1,
    max_batch_size=BATCH,
    max_queued_requests=QUEUE,
    key_batch_share=0.25,  # 2 rows of 8
    key_queue_share=0.75,  # 12 requests of 16
    stream_buffer_tokens=16,
)


@pytest.fixture(scope="module")
def lm_and_start(hostile_models) -> tuple[model.LanguageModel, Stored]:
    lm, state = full_state(hostile_models["txl"])
    return lm, Stored(state.to_bytes(), (), int(state.n_tokens[0]))


def _req(start: Stored, client: str, max_tokens: int) -> Request:
    return Request(
        start, [5], SamplingParams(temperature=0.0), None, max_tokens, [], persist=Persist(), client=client
    )


async def _read(req: Request) -> None:
    """A client that reads its stream as fast as it comes."""
    async for _ in req:
        pass


class Stepper:
    """An engine whose steps the test takes itself (its thread never starts), reporting
    after each who holds the batch."""

    def __init__(self, lm: model.LanguageModel):
        self.engine = engine_for(lm, **SETTINGS)
        self.s = self.engine.scheduler

    async def step(self) -> None:
        self.engine.loader.drain()  # (stored starts are parsed on the loader thread, then delivered)
        self.s.receive(wait=False)
        self.engine._step(self.s.admit())
        self.engine.publish()
        self.engine.encoder.drain()  # (finished states are encoded on the encoder thread)
        for _ in range(3):
            await asyncio.sleep(0)  # the events reach their readers

    def running(self, client: str) -> int:
        return sum(r.req.client == client for r in (*self.s._prefilling, *self.s._decoding))


def test_a_flood_fills_the_batch_alone_and_holds_its_share_beside_another(lm_and_start):
    from app.engine.fairness import LINGER_STEPS

    lm, start = lm_and_start

    async def go() -> None:
        st = Stepper(lm)
        flood = [_req(start, FLOOD, 60) for _ in range(12)]
        for r in flood:
            st.engine.submit(r)
        readers = [asyncio.ensure_future(_read(r)) for r in flood]
        for _ in range(4):
            await st.step()
        assert st.running(FLOOD) == BATCH  # alone, a client may fill the batch
        light = _req(start, LIGHT, 12)
        st.engine.submit(light)
        readers.append(asyncio.ensure_future(_read(light)))
        steps = 0
        while light.result is None:
            await st.step()
            steps += 1
            if light.result is None:
                assert st.running(LIGHT) == 1, steps  # admitted at once, never parked
                assert st.running(FLOOD) <= 2, steps  # the flood holds its share while it runs
        assert steps <= 12 + 3  # its tokens, its prompt, and the step that admitted it
        for _ in range(LINGER_STEPS + 2):  # then, once the light client has been gone a while,
            await st.step()
        assert st.running(FLOOD) == BATCH  # the flood has the batch again
        while not all(r.done() for r in readers):
            await st.step()
        assert all(len(r.result.token_ids) == 60 for r in flood)  # parked rows lost nothing

    asyncio.run(go())


def test_a_flood_fills_at_most_its_share_of_the_queue(lm_and_start):
    lm, start = lm_and_start

    async def go() -> None:
        st = Stepper(lm)
        taken = 0
        for _ in range(QUEUE):
            try:
                st.engine.submit(_req(start, FLOOD, 4))
                taken += 1
            except QueueFull as exc:
                assert "share" in str(exc)
        assert taken == 12
        st.engine.submit(_req(start, LIGHT, 4))  # another client still gets in

    asyncio.run(go())


def test_a_stream_nobody_reads_leaves_the_batch_until_read(lm_and_start):
    lm, start = lm_and_start

    async def go() -> None:
        st = Stepper(lm)
        unread = [_req(start, FLOOD, 200) for _ in range(BATCH)]
        for r in unread:
            st.engine.submit(r)
        for _ in range(30):
            await st.step()
        assert st.running(FLOOD) == 0  # all paused: 16 tokens unread each
        assert all(16 < r.unread <= 18 for r in unread), [r.unread for r in unread]
        light = _req(start, LIGHT, 8)
        st.engine.submit(light)
        reader = asyncio.ensure_future(_read(light))
        for _ in range(3):
            await st.step()
        assert st.running(LIGHT) == 1 and not st.s._decoding[1:]  # it runs alone
        readers = [asyncio.ensure_future(_read(r)) for r in unread]  # the clients read at last
        while not all(r.done() for r in [reader, *readers]):
            await st.step()
        assert all(len(r.result.token_ids) == 200 for r in unread)

    asyncio.run(go())


def _open_stream(url: str, key: str, i: int) -> socket.socket:
    """A streaming completion whose client never reads a byte of the answer."""
    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=10)
    body = json.dumps({"prompt": f"flood {i}", "max_tokens": 1000, "stream": True, "ignore_eos": True})
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    return sock


def test_a_flood_of_streams_that_never_read_leaves_another_key_served(tenants):
    """320 streams from one key that never read (more than the batch and the queue hold
    together): the key runs at most 64 at once, the rest get 429 before any work, and
    another key's generations are all served meanwhile."""
    flood = [_open_stream(tenants.url, ATTACKER, i) for i in range(320)]
    try:
        time.sleep(2)
        with as_key(tenants, VICTIM) as c:
            made = c.post("/v1/sessions", json={"prompt": "x"})
            assert made.status_code == 201, made.text  # (the create goes through the engine's queue too)
            sid = made.json()["id"]
            answers = [
                c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 16})
                for _ in range(8)
            ]
            answers.append(c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 16}))
        assert [r.status_code for r in answers] == [200] * 9, [r.text[:200] for r in answers]
        statuses = []
        for sock in flood:
            sock.settimeout(10)
            statuses.append(int(sock.recv(64).split()[1]))
        assert statuses.count(200) <= 64 and set(statuses) <= {200, 429}, sorted(set(statuses))
    finally:
        for sock in flood:
            sock.close()
