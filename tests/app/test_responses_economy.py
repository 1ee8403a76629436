"""A `previous_response_id` chain costs what each turn adds (issue 41: "a session costs
what changed"). A chain of turns on a LLaMA model (whose state grows by a fixed number of
bytes per position) is measured turn by turn with Redis's own counters, around each
request, on a Redis of the module's own (nothing else runs scripts on it):

  - scripts run (`INFO commandstats`): at most 5 round trips a turn, however long the chain
    (13 when each turn forked its own session);
  - bytes Redis received (`total_net_input_bytes`): at most twice the new positions' state
    bytes, plus 16 KB (the record, the items, the script arguments);
  - bytes Redis sent back (`total_net_output_bytes`): at most the same.

A chain that forked every turn (each response in a session of its own, a whole state
written) fails all three from the first few turns."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import redis

from app import prefixes
from app.store import Keys
from app.transcript import Segment, lineage
from tests.conftest import RedisProcess, ServerProcess
from tests.model.llama_files import CONFIG, byte_vocabulary, random_weights, write_gguf

# a LLaMA whose state is 4 KB a position (a whole state of a few hundred positions is far
# more than a turn's new ones), byte-level: what it writes re-renders to the same tokens, so
# every turn continues the state before it (`test_responses.py` has the misses)
VOCAB = byte_vocabulary()
CFG = {
    **CONFIG,
    "n_layer": 4,
    "n_kv_head": 4,
    "n_head": 4,
    "head_dim": 32,
    "d_model": 128,
    "vocab_size": len(VOCAB[0]),
}
# greedy, 16 tokens a turn, never EOS, a special token or a byte past ASCII (the reply's text
# would not show the first two, nor a byte of a broken UTF-8 sequence, as the tokens it was)
NEVER = {i: -100 for i in [0, 1, 2, *range(3 + 128, 3 + 256)]}
TURN = {"temperature": 0, "max_output_tokens": 16, "extra_body": {"ignore_eos": True, "logit_bias": NEVER}}
BYTES_PER_POSITION = CFG["n_layer"] * 2 * CFG["n_kv_head"] * CFG["head_dim"] * 4
TURNS = 12
SLACK = 16 * 1024
# the record, begin, commit, the tenant's ledger (the session's settlement and the record's
# place, in one script) and the record: the first turn on a replica reads the tenant's
# ledger once more (`Tenants.reserve_growth`), so a warm-up turn comes first
MAX_ROUND_TRIPS = 5


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, redis.Redis]]:
    root = tmp_path_factory.mktemp("economy")
    gguf = write_gguf(root / "llama.gguf", random_weights(seed=5, cfg=CFG), "F32", cfg=CFG, vocab=VOCAB)
    (root / "redis").mkdir()
    red = RedisProcess(root / "redis")
    try:
        with ServerProcess(
            gguf, root / "server", red.url, cpu_threads=1, max_tokens=64, response_lease_seconds=600,
            model_options="window=500,sinks=4",
        ) as srv:  # fmt: skip
            yield srv, redis.Redis.from_url(red.url)
    finally:
        red.stop()


def counters(r: redis.Redis) -> tuple[int, int, int]:
    """(scripts run, bytes received, bytes sent) by Redis so far: its own counters."""
    scripts = sum(
        int(v.get("calls", 0))
        for k, v in r.info("commandstats").items()
        if k in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")
    )
    stats = r.info("stats")
    return scripts, int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])


class Monitor:
    """Redis's MONITOR on a connection of its own, in a thread: the commands every other
    client sends (not those a script calls), each as (client address, command); `between` reads those that came
    between two marks this test sends (ECHO), on Redis's own order."""

    def __init__(self, r: redis.Redis):
        self.seen: list[tuple[str, str]] = []
        self._monitor = r.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        with contextlib.suppress(Exception):
            for entry in self._monitor.listen():
                if entry.get("client_type") != "lua":  # (a script's own calls are that script)
                    self.seen.append((str(entry.get("client_address", "")), str(entry.get("command", ""))))

    def mark(self, r: redis.Redis, name: str) -> None:
        r.echo(f"mark {name}")
        deadline = time.monotonic() + 10
        while not any(c == f"ECHO mark {name}" for _, c in self.seen):
            assert time.monotonic() < deadline, "MONITOR never saw the mark"
            time.sleep(0.01)

    def between(self, first: str, last: str) -> list[tuple[str, str]]:
        names = [c for _, c in self.seen]
        return self.seen[names.index(f"ECHO mark {first}") + 1 : names.index(f"ECHO mark {last}")]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._monitor.connection.disconnect()


def test_a_chain_turn_sends_redis_its_scripts_and_nothing_else(served):
    """Counted with MONITOR: a previous_response_id turn sends Redis at most 5 commands,
    each a script (EVALSHA), whatever else the server does meanwhile."""
    srv, r = served
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
    previous = oa.responses.create(input="Hark, a knock.", **TURN)
    previous = oa.responses.create(input="Who is there?", previous_response_id=previous.id, **TURN)  # (warm)
    watch = Monitor(r)
    try:
        for turn in range(4):
            watch.mark(r, f"before {turn}")
            previous = oa.responses.create(input=f"Turn {turn}.", previous_response_id=previous.id, **TURN)
            watch.mark(r, f"after {turn}")
            sent = [c.split(" ", 1)[0] for _, c in watch.between(f"before {turn}", f"after {turn}")]
            # (no turn's: the storage guard's INFO polls, every 0.5 s whatever the traffic, and
            # the handshake of a connection the pool opens when all of its are busy)
            turn_commands = [
                c for c in sent if c.upper() not in ("INFO", "HELLO", "CLIENT", "AUTH", "SELECT")
            ]
            assert len(turn_commands) <= MAX_ROUND_TRIPS, (turn, sent)
            assert all(c.upper() == "EVALSHA" for c in turn_commands), (turn, sent)
    finally:
        watch.close()


def test_a_chain_turn_costs_what_it_adds(served):
    srv, r = served
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
    first = oa.responses.create(input="Good morrow, sweet lady.", **TURN)
    first = oa.responses.create(input="Good day.", previous_response_id=first.id, **TURN)  # (a first reading)
    previous, positions = first, first.usage.input_tokens + first.usage.output_tokens
    rows = []
    for turn in range(TURNS):
        before = counters(r)
        resp = oa.responses.create(input=f"And then, turn {turn}?", previous_response_id=previous.id, **TURN)
        after = counters(r)
        scripts, written, read = (a - b for a, b in zip(after, before, strict=True))
        assert resp.status in ("completed", "incomplete") and resp.previous_response_id == previous.id
        # the new positions: what the turn prefilled (its cached tokens were not) and generated
        details = resp.usage.input_tokens_details
        new = resp.usage.input_tokens - details.cached_tokens + resp.usage.output_tokens
        assert details.cached_tokens >= positions - 1, (
            turn,
            details,
            positions,
        )  # the chain's state was reused
        bound = 2 * new * BYTES_PER_POSITION + SLACK
        total = (resp.usage.input_tokens + resp.usage.output_tokens) * BYTES_PER_POSITION
        rows.append((turn, scripts, written, read, bound, total))
        previous, positions = resp, resp.usage.input_tokens + resp.usage.output_tokens
    for turn, scripts, written, read, bound, total in rows:
        print(f"turn {turn}: {scripts} scripts, {written} B in, {read} B out (bound {bound} B; "
              f"the whole state {total} B)")  # fmt: skip
    for turn, scripts, written, read, bound, _ in rows:
        assert scripts <= MAX_ROUND_TRIPS, (turn, scripts)
        assert written <= bound, (turn, written, bound)
        assert read <= bound, (turn, read, bound)
    # nor with the conversation's text: a turn reads and writes its own turn's, never the
    # history's (each turn adds about 150 bytes of text). Less the new positions' state, and
    # the least of three turns (the storage guard's INFO polls land in some turn's count)
    least = [
        (min(w - (b - SLACK) // 2 for _, _, w, _, b, _ in part), min(r for _, _, _, r, _, _ in part))
        for part in (rows[1:4], rows[-3:])
    ]
    (w0, r0), (w1, r1) = least
    assert w1 - w0 < 512 and r1 - r0 < 512, least


def test_a_chain_session_lives_while_a_response_holds_it(served):
    """Every stored response of a chain continued in place holds the chain's session:
    deleting the others leaves the last one continuable from its state, and deleting the
    last holder deletes the session."""
    srv, r = served
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
    before = set(r.scan_iter("*session:{*"))
    chain = [oa.responses.create(input="Hark.", **TURN)]
    for turn in range(3):
        chain.append(oa.responses.create(input=f"Turn {turn}.", previous_response_id=chain[-1].id, **TURN))
    sessions = set(r.scan_iter("*session:{*")) - before
    assert len(sessions) == 1, sessions  # the chain's one session
    for resp in chain[:-1]:
        oa.responses.delete(resp.id)
    assert sessions <= set(r.scan_iter("*session:{*"))  # the last response still holds it
    last = chain[-1]
    more = oa.responses.create(input="And more.", previous_response_id=last.id, **TURN)
    held = last.usage.input_tokens + last.usage.output_tokens
    assert more.usage.input_tokens_details.cached_tokens >= held - 1
    for resp in (last, more):
        oa.responses.delete(resp.id)
    assert not set(r.scan_iter("*session:{*")) & sessions, "the chain's session outlived its responses"


def test_a_record_says_what_its_next_turn_needs_to_render_alone(served):
    """Each stored response keeps what its next turn needs to render only its own input: the
    ids that close its reply after its state (`closing`: here the turn stop, the reply cut at
    `max_output_tokens`) and the frame it rendered under. A turn rendered whole (the first)
    keeps the one-pass digest of the tokens its state consumed: that of the session's
    transcript (app/transcript.py: what the state consumed, segment by segment); a turn
    rendered alone keeps none. A record that cannot say how its reply closes makes the next
    turn render the whole conversation, walked through the chain's turns (context.lua), and it
    still continues the state, checking it by the chained hash."""
    srv, r = served
    keys = Keys(srv.settings["key_prefix"])
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
    previous = oa.responses.create(input="Speak, fair one.", **TURN)
    for turn in range(4):
        record = keys.response(previous.id)[0]
        sid, version, n, digest, closing = (
            x.decode() for x in r.hmget(record, "session", "version", "n_tokens", "digest", "closing")
        )
        segments = [Segment.from_bytes(s) for s in r.lrange(keys.transcript(sid), 0, -1)]
        consumed = [i for s in lineage(segments, sid, int(version))[0] for i in s.ids]
        assert len(consumed) == int(n), turn
        assert digest == (prefixes.digest(consumed) if turn in (0, 2) else ""), turn  # (0, 2: rendered whole)
        assert json.loads(closing), turn  # (the turn stop the cut reply never reached)
        if turn == 1:
            r.hset(record, "closing", "")  # (a record that cannot say)
        resp = oa.responses.create(input=f"Again, {turn}?", previous_response_id=previous.id, **TURN)
        held = previous.usage.input_tokens + previous.usage.output_tokens
        assert resp.usage.input_tokens_details.cached_tokens >= held - 1, turn  # (the state continued)
        previous = resp
