"""A flood of replays from one key leaves another key served (issue 39, item 2): before,
10-50 looping replays of a background response's events took another key's completion from
0.07 s to 4-15 s, with `503 redis_unavailable` and replays cut with a traceback. The flood is
held to its client's limit of replays at once and paced to its bytes a second
(`replay_mb_per_second`), which the test checks from the bytes the flooder received; the
other key's completion is measured side by side in one run, quiet then beside the flood, as
a ratio of medians (printed: 1.6-1.8x on the 2-core machine; 5.8x unpaced)."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

FLOODER, OTHER = "flooding-key", "other-key"
CLIENTS = 16  # looping replays from the flooding key: twice its limit (max_replays_per_key, 8)
EVENTS = 400  # tokens of the replayed response: ~400 events
SAMPLES = 9
RATE = 1.0  # MiB a second the flooding key's replays may send (replay_mb_per_second, its default)


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    with ServerProcess(
        "shakespeare", tmp_path_factory.mktemp("replays"), redis_url, cpu_threads=1, max_tokens=EVENTS,
        api_keys=f"{FLOODER},{OTHER}", replay_mb_per_second=RATE,
    ) as srv:  # fmt: skip
        yield srv


def completion_seconds(oa: openai.OpenAI) -> float:
    started = time.perf_counter()
    oa.responses.create(input="Good morrow.", store=False, temperature=0, max_output_tokens=8)
    return time.perf_counter() - started


def flood(server: ServerProcess, response_id: str, stop: threading.Event, seen: Counter) -> None:
    """Replay the response's events again and again, reading as fast as it can; refused
    (429), try again a tenth of a second later (not the Retry-After it is told)."""
    url = f"{server.url}/v1/responses/{response_id}?stream=true"
    with httpx.Client(headers={"Authorization": f"Bearer {FLOODER}"}, timeout=60) as http:
        while not stop.is_set():
            with http.stream("GET", url) as r:
                body = b"".join(r.iter_raw())
            tail = body[-2000:]
            seen[r.status_code] += 1
            seen["bytes"] += len(body) if r.status_code == 200 else 0
            if r.status_code == 429:
                time.sleep(0.1)
            elif r.status_code == 200:
                last = tail.rstrip().rsplit(b"event: ", 1)[-1].split(b"\r\n", 1)[0].split(b"\n", 1)[0]
                seen[last.decode()] += 1


def test_a_replay_flood_is_held_to_its_limit_and_fails_no_other_key(server):
    """The flooding key runs its limit of replays and is told 429 past it; each replay is
    served whole, and all of them together no faster than the key's pace; the other key gets
    no error. Its completion's latency, quiet and beside the flood, is printed (a time: not
    asserted; the issue's target is 2x: 1.6-1.8x paced, 5.8x unpaced, 60-200x before)."""
    flooder = openai.OpenAI(base_url=server.url + "/v1", api_key=FLOODER, max_retries=0, timeout=120)
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=OTHER, max_retries=0, timeout=120)
    r = flooder.responses.create(input="A long tale.", background=True, max_output_tokens=EVENTS,
                                 extra_body={"min_tokens": EVENTS})  # fmt: skip
    # its end: max_output_tokens (incomplete) or, rarely, the template's turn stop completed by the
    # very token that reached it (completed: a stop is searched for first); either way EVENTS tokens
    last = list(flooder.responses.retrieve(r.id, stream=True))[-1]
    assert last.type in ("response.incomplete", "response.completed")
    assert last.response.usage is not None and last.response.usage.output_tokens == EVENTS
    completion_seconds(other)  # (warm)
    quiet = statistics.median(completion_seconds(other) for _ in range(SAMPLES))
    stop, seen = threading.Event(), Counter()
    threads = [threading.Thread(target=flood, args=(server, r.id, stop, seen)) for _ in range(CLIENTS)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    try:
        time.sleep(1)  # (the flood at full strength)
        flooded = statistics.median(completion_seconds(other) for _ in range(SAMPLES))
    finally:
        stop.set()
        for t in threads:
            t.join()
    seconds = time.perf_counter() - began
    print(f"quiet {quiet * 1000:.0f} ms, beside {CLIENTS} replaying clients {flooded * 1000:.0f} ms "
          f"({flooded / quiet:.2f}x); replays {dict(seen)}")  # fmt: skip
    assert seen[429] > 0 and seen[200] > 0  # the limit held the flood, and replays were served
    assert seen[503] == 0
    assert seen[last.type] == seen[200]  # every replay served whole, to its last event
    # paced: the events' bytes at RATE, after a half-second burst, and the SSE framing on top
    # (under 0.4 of an event's bytes)
    allowed = 1.4 * RATE * 2**20 * (seconds + 0.5)
    print(f"the flood received {seen['bytes'] / 2**20:.2f} MiB in {seconds:.1f} s; allowed {allowed / 2**20:.2f}")
    assert seen["bytes"] <= allowed
