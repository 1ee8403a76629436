"""What a session costs in Redis (issue 41, item 5): state bytes, and the Redis traffic of a
16-token turn on each route, measured with Redis's own counters around each request.

One `recur serve` (`--model`, default the shipped assistant `smollm2`; 1 torch thread) on a
Redis of its own, nothing else running scripts on it. At about 1,000 tokens of history (and
8,000 with `--long`, where smollm2's bounded window of 4 sinks + 1,024 caps the state), a
slice of a held-out play as the history:

1. **State bytes per session**: a session created from the history (`GET /v1/sessions/{id}`'s
   `state_bytes` and `history_bytes`) and the growth of Redis's `used_memory` it caused.
2. **A 16-token turn** (temperature 0, 16 tokens exactly), `--turns` of each, on three routes:
   (a) a stored response with `previous_response_id` continuing the chain's latest response:
       the chain's session is continued in place (a delta commit);
   (b) a branch, continuing an earlier response the chain has already gone on from: that
       version is forked (`read_at` for its lineage, then `fork.lua`, naming its pages);
   (c) the session route, `POST /v1/sessions/{id}/generate`.
   Per turn: the scripts Redis ran (`INFO commandstats`: evalsha, eval, fcall), the bytes it
   received (`total_net_input_bytes`: written) and sent
   (`total_net_output_bytes`: read), the new positions the turn added, and issue 41's bound on
   both byte counts (2 × the new positions' state bytes + 16 KB; the state bytes of one
   position are measured: two sessions' `state_bytes` apart, below the window).
3. **A fork** (`POST /v1/sessions/{id}/fork`) of the ~1,000-token session: bytes written,
   `used_memory` growth as a fraction of the session's state, and its milliseconds (client
   to client, over HTTP).

Counting: the INFO calls that read the counters are subtracted (their cost, measured with
nothing between two readings); so are the storage guard's background `INFO memory` polls
(every 0.5 s, whatever the traffic: each one's request and reply bytes, times the polls
that fell within the turn). The scripts are a turn's round trips: watched with `MONITOR`
(on `--quick`'s model), a turn sends Redis nothing but its scripts (`commandstats` cannot
tell a client's commands from those a script calls, so it counts the scripts alone).

`--quick` is a smoke test on a tiny LLaMA of random weights (its byte-level vocabulary makes
every reply re-render to the tokens it was), 200 tokens of history, 2 turns a route.
Prints a table and `RESULT {json}`; `--write` puts the section "## State economy" into
docs/BENCHMARKS.md (smollm2 first: the shipped assistant; `--also shakespeare` adds the other
shipped model's row, measured after it in the same run), which `make bench` does.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai
import redis
from harness import ROOT, USER, Redis, Server, arguments, publish
from page import cpu

from model.corpus import load_split

SECTION = "## State economy"
TURN_TOKENS = 16
SLACK = 16 * 1024  # issue 41: the record, the items, the script arguments
MAX_ROUND_TRIPS = 5  # issue 41's target for a previous_response_id turn
FORK_SHARE = 0.02  # issue 41: a fork grows used_memory by less than 2% of the state
PLAY_START = 20_000  # characters into the held-out play (past its list of persons)
SCRIPTS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall", "cmdstat_evalsha_ro", "cmdstat_eval_ro")
KB = 1024


# -- Redis's own counters ----------------------------------------------------------------------
@dataclass(frozen=True)
class Cost:
    scripts: int  # a turn's round trips: it sends Redis nothing else (see the module's docstring)
    written: int  # bytes Redis received
    read: int  # bytes Redis sent
    infos: int = 0  # INFO calls (the counters' own, the storage guard's)

    def __sub__(self, o: Cost) -> Cost:
        return Cost(*(a - b for a, b in zip(asdict(self).values(), asdict(o).values(), strict=True)))


def counters(r: redis.Redis) -> Cost:
    stats = r.info("commandstats")
    calls = {k: int(v.get("calls", 0)) for k, v in stats.items()}
    net = r.info("stats")
    return Cost(
        scripts=sum(calls.get(k, 0) for k in SCRIPTS),
        written=int(net["total_net_input_bytes"]),
        read=int(net["total_net_output_bytes"]),
        infos=calls.get("cmdstat_info", 0),
    )


class Meter:
    """Reads a Redis's counters around a call and returns what the call cost it: less the
    reading's own cost, and less the storage guard's polls that fell in between."""

    def __init__(self, r: redis.Redis):
        self.r = r
        counters(r)  # (every command the readings use now has its commandstats line)
        nulls = []
        for _ in range(7):
            a = counters(r)
            nulls.append(counters(r) - a)
        self.own = min(nulls, key=lambda c: (c.infos, c.read))  # (one with no poll in it)
        # one poll of the storage guard: `INFO memory`, its request and its reply
        a = counters(r)
        r.info("memory")
        poll = counters(r) - a - self.own
        self.poll_written, self.poll_read = poll.written, poll.read

    def used_memory(self) -> int:
        """Redis's `used_memory` once the clients' buffers have let go of the last request: a
        large argument stays in its connection's query buffer (counted in `used_memory`) until
        Redis shrinks it, within a second or two."""
        deadline = time.monotonic() + 10
        while True:
            mem = self.r.info("memory")
            if int(mem.get("mem_clients_normal", 0)) < 4 * 2**20 or time.monotonic() > deadline:
                return int(mem["used_memory"])
            time.sleep(0.25)

    def around(self, call: Callable[[], object]) -> tuple[object, Cost, float]:
        before = counters(self.r)
        t0 = time.perf_counter()
        out = call()
        ms = (time.perf_counter() - t0) * 1e3
        c = counters(self.r) - before - self.own
        polls = max(c.infos, 0)
        return out, Cost(c.scripts, c.written - polls * self.poll_written,
                         c.read - polls * self.poll_read, polls), ms  # fmt: skip


# -- the server's routes --------------------------------------------------------------------
def history_text(url: str, tokens: int) -> str:
    """About `tokens` tokens of a held-out play, cut at a token by the served tokenizer."""
    play = load_split("shakespeare", "valid")[0][1][PLAY_START:]
    ids = httpx.post(url + "/tokenize", json={"prompt": play[: tokens * 8], "add_special_tokens": False},
                     timeout=120).json()["tokens"]  # fmt: skip
    assert len(ids) >= tokens, (len(ids), tokens)
    return httpx.post(url + "/detokenize", json={"tokens": ids[:tokens]}, timeout=120).json()["prompt"]


def meta(url: str, sid: str) -> dict:
    resp = httpx.get(f"{url}/v1/sessions/{sid}", timeout=60)
    resp.raise_for_status()
    return resp.json()


def post(url: str, path: str, body: dict) -> dict:
    resp = httpx.post(url + path, json=body, timeout=900)
    resp.raise_for_status()
    return resp.json()


@dataclass
class Turn:
    route: str
    new: int  # positions the turn added to the state
    cost: Cost
    ms: float
    continued: bool  # the turn started from the state it should (not a miss, prefilled anew)


def session_turns(url: str, m: Meter, sid: str, n: int, sampling: dict) -> list[Turn]:
    rows = []
    for i in range(n):
        held = meta(url, sid)["n_tokens"]
        body = {
            "prompt": "\n" + USER[i % len(USER)] + "\n",
            "max_tokens": TURN_TOKENS,
            "stream": False,
            **sampling,
        }
        out, cost, ms = m.around(lambda b=body: post(url, f"/v1/sessions/{sid}/generate", b))
        assert isinstance(out, dict) and out["usage"]["completion_tokens"] == TURN_TOKENS, out
        rows.append(Turn("session", meta(url, sid)["n_tokens"] - held, cost, ms, True))
    return rows


def response_turns(url: str, m: Meter, text: str, n: int, sampling: dict) -> tuple[list[Turn], list[Turn]]:
    """A chain of stored responses from `text`, then `n` turns each continuing its latest
    response (in place), then `n` branches, each continuing an earlier response of it."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=900)
    kw = {"temperature": 0, "max_output_tokens": TURN_TOKENS, "extra_body": sampling}

    def held(resp) -> int:  # the positions the response's state holds
        return resp.usage.input_tokens + resp.usage.output_tokens

    def turn(route: str, source, line: str) -> tuple[object, Turn]:
        resp, cost, ms = m.around(
            lambda: oa.responses.create(input=line, previous_response_id=source.id, **kw)
        )
        u = resp.usage  # type: ignore[attr-defined]
        assert u.output_tokens == TURN_TOKENS, u
        cached = u.input_tokens_details.cached_tokens
        return resp, Turn(
            route, u.input_tokens - cached + u.output_tokens, cost, ms, cached >= held(source) - 1
        )

    chain = [oa.responses.create(input=text, **kw)]
    chain.append(turn("first reading", chain[0], USER[0])[0])  # (a replica's first turn reads more)
    in_place, branches = [], []
    for i in range(n):
        resp, row = turn("previous_response_id", chain[-1], USER[(i + 1) % len(USER)])
        chain.append(resp)
        in_place.append(row)
    for i in range(n):  # chain[-2 - i]: the chain has gone on from it (within the kept versions)
        branches.append(turn("branch", chain[-2 - i], USER[(n + i + 1) % len(USER)])[1])
    return in_place, branches


# -- one history length ---------------------------------------------------------------------
def figures(rows: list[Turn]) -> dict:
    """The median and the worst of a route's turns."""

    def of(f: Callable[[Turn], float]) -> dict:
        xs = [f(t) for t in rows]
        return {"median": statistics.median(xs), "max": max(xs)}

    return {
        "turns": len(rows),
        "continued": sum(t.continued for t in rows),
        "scripts": of(lambda t: t.cost.scripts),
        "written": of(lambda t: t.cost.written),
        "read": of(lambda t: t.cost.read),
        "new": of(lambda t: t.new),
        "ms": of(lambda t: t.ms),
        "rows": [
            {**asdict(t.cost), "new": t.new, "ms": round(t.ms, 1), "continued": t.continued} for t in rows
        ],
    }


def at_history(url: str, m: Meter, tokens: int, turns: int, sampling: dict, forks: int) -> dict:
    text = history_text(url, tokens)
    mem0 = m.used_memory()
    created, create_cost, _ = m.around(lambda: post(url, "/v1/sessions", {"prompt": text}))
    assert isinstance(created, dict)
    sid = created["id"]
    info = meta(url, sid)
    state = {
        "n_tokens": info["n_tokens"],
        "state_bytes": info["state_bytes"],
        "history_bytes": info["history_bytes"],
        "used_memory_growth": m.used_memory() - mem0,
        "create_written": create_cost.written,
    }
    print(f"history {tokens}: session of {info['n_tokens']} tokens, state {info['state_bytes'] / 2**20:.2f} MiB",
          flush=True)  # fmt: skip
    session = session_turns(url, m, sid, turns, sampling)
    in_place, branches = response_turns(url, m, text, turns, sampling)
    out = {
        "tokens": tokens,
        "state": state,
        "in_place": figures(in_place),
        "branch": figures(branches),
        "session": figures(session),
    }
    if forks:
        source = meta(url, sid)
        rows = []
        for _ in range(forks):
            mem0 = m.used_memory()
            _, cost, ms = m.around(lambda: post(url, f"/v1/sessions/{sid}/fork", {}))
            rows.append({**asdict(cost), "used_memory_growth": m.used_memory() - mem0, "ms": round(ms, 1)})
        out["fork"] = {
            "n_tokens": source["n_tokens"],
            "state_bytes": source["state_bytes"],
            "rows": rows,
            **{k: statistics.median(r[k] for r in rows) for k in ("written", "read", "scripts", "used_memory_growth", "ms")},
        }  # fmt: skip
    for k in ("in_place", "branch", "session"):
        f = out[k]
        print(f"  {k}: {f['scripts']['median']} scripts, {f['written']['median'] / KB:.0f} KB written, "
              f"{f['read']['median'] / KB:.0f} KB read, {f['new']['median']} new positions "
              f"({f['continued']} of {f['turns']} continued)", flush=True)  # fmt: skip
    return out


def per_position(url: str, m: Meter, tokens: int) -> float:
    """The state bytes of one position: two sessions' state_bytes apart (both below the
    window: `tokens` and 16), over their positions apart; 0 for a state of fixed size."""
    sizes = []
    for n in (16, tokens):
        sid = post(url, "/v1/sessions", {"prompt": history_text(url, n)})["id"]
        info = meta(url, sid)
        sizes.append((info["n_tokens"], info["state_bytes"]))
        httpx.delete(f"{url}/v1/sessions/{sid}", timeout=60)
    (n0, b0), (n1, b1) = sizes
    return max(0.0, (b1 - b0) / (n1 - n0))


def tiny_model(work: Path) -> str:
    """A LLaMA GGUF of random weights, byte-level (tests/model/llama_files.py): what it writes
    re-renders to the same tokens, so a chain of its responses continues in place."""
    sys.path.insert(0, str(ROOT))  # tests/ is not installed
    from tests.model.llama_files import CONFIG, byte_vocabulary, random_weights, write_gguf

    vocab = byte_vocabulary()
    cfg = {**CONFIG, "n_layer": 4, "n_kv_head": 4, "n_head": 4, "head_dim": 32, "d_model": 128,
           "vocab_size": len(vocab[0])}  # fmt: skip
    return str(write_gguf(work / "tiny.gguf", random_weights(seed=5, cfg=cfg), "F32", cfg=cfg, vocab=vocab))


def measured_commit() -> str:
    """HEAD, and whether app/ or model/ differ from it (the server runs the tree, not HEAD)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "app", "model")
    return git("rev-parse", "--short", "HEAD") + (
        " with uncommitted changes to app/ or model/" if dirty else ""
    )


def measure(name: str, quick: bool, long: bool, turns: int, forks: int, long_turns: int = 4) -> dict:
    commit = measured_commit()  # (before the server starts: the code it runs)
    work = Path(tempfile.mkdtemp(prefix="recur-state-economy-"))
    histories = [200] if quick else [1000, 8000] if long else [1000]
    if quick:
        path, label = tiny_model(work), "a tiny LLaMA (random weights, 4 KB a position)"
        # greedy, never EOS, a special token or a byte past ASCII (its text would not re-render)
        sampling: dict = {"ignore_eos": True, "logit_bias": {i: -100 for i in [0, 1, 2, *range(131, 259)]}}
    else:
        path, label = name, f"`{name}`"
        sampling = {"min_tokens": TURN_TOKENS}  # (16 tokens exactly: EOS cannot end a turn early)
    red = Redis(work / "redis")
    # (a byte quota past the default 2 GiB: 20 branches of SmolLM2's 45 MB states, each
    # past the kept versions prefilled in a session of its own, would pass it)
    settings = dict(cpu_threads=1, max_tokens=64, response_lease_seconds=600,
                    max_prompt_tokens=max(histories) * 2, quota_state_mb=65536)  # fmt: skip
    if quick:
        settings["model_options"] = "window=500,sinks=4"
    srv = Server(path, red.url, work / "server", **settings)
    try:
        m = Meter(redis.Redis.from_url(red.url))
        position = per_position(srv.url, m, min(histories))
        runs = [
            at_history(srv.url, m, h, turns if h == histories[0] else long_turns, sampling,
                       forks if h == histories[0] else 0)
            for h in histories
        ]  # fmt: skip
    finally:
        srv.stop()
        red.stop()
    return {
        "model": name if not quick else "tiny",
        "label": label,
        "bytes_per_position": position,
        "histories": runs,
        "machine": f"{cpu()}, {os.cpu_count()} CPU cores",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# -- the section ----------------------------------------------------------------------------
ROUTES = {
    "in_place": "(a) previous_response_id, the latest",
    "branch": "(b) branch: an earlier response (fork)",
    "session": "(c) POST /v1/sessions/{id}/generate",
}


def _kb(x: float) -> str:
    return f"{x / KB:,.0f}" if abs(x) >= 10 * KB else f"{x / KB:,.1f}"


def bound(r: dict, new: float) -> float:
    return 2 * new * r["bytes_per_position"] + SLACK


def turn_table(r: dict, h: dict) -> list[str]:
    a, b = h["in_place"], h["branch"]

    def ratio(key: str) -> str:
        x = b[key]["median"] / a[key]["median"] if a[key]["median"] > 0 else None
        return "—" if x is None else f"{x:,.0f}×" if x >= 100 else f"{x:.1f}×"

    def row(label: str, key: str, fmt: Callable[[float], str]) -> str:
        cells = [f"{fmt(h[k][key]['median'])} (max {fmt(h[k][key]['max'])})" for k in ROUTES]
        return f"| {label} | " + " | ".join(cells) + f" | {ratio(key)} |"

    bounds = [f"{_kb(bound(r, h[k]['new']['max']))}" for k in ROUTES]
    return [
        "| per 16-token turn (median, max) | " + " | ".join(ROUTES.values()) + " | (b) ÷ (a) |",
        "|---|---|---|---|---|",
        row("Redis scripts (round trips)", "scripts", lambda x: f"{x:.0f}"),
        row("written to Redis, KB", "written", _kb),
        row("read from Redis, KB", "read", _kb),
        row("new positions", "new", lambda x: f"{x:.0f}"),
        row("the request, ms (client to client)", "ms", lambda x: f"{x:,.0f}"),
        "| bound: 2 × the new positions' bytes + 16 KB, KB | " + " | ".join(bounds) + " | |",
        "| turns that continued their state | "
        + " | ".join(f"{h[k]['continued']} of {h[k]['turns']}" for k in ROUTES)
        + " | |",
    ]


def verdicts(r: dict) -> tuple[list[str], dict]:
    h = r["histories"][0]
    a, fork = h["in_place"], h["fork"]
    trips = a["scripts"]["max"]
    over_w = [t for t in a["rows"] if t["written"] > bound(r, t["new"])]
    over_r = [t for t in a["rows"] if t["read"] > bound(r, t["new"])]
    share = fork["used_memory_growth"] / fork["state_bytes"]
    worst_w = max(a["rows"], key=lambda t: t["written"] - bound(r, t["new"]))
    worst_r = max(a["rows"], key=lambda t: t["read"] - bound(r, t["new"]))
    met = {"round_trips": trips <= MAX_ROUND_TRIPS, "writes": not over_w, "reads": not over_r,
           "fork": share < FORK_SHARE}  # fmt: skip

    def v(ok: bool) -> str:
        return "met" if ok else "**missed**"

    lines = [
        "| issue 41's Done-when (smollm2, a `previous_response_id` turn) | measured here | |",
        "|---|---|---|",
        f"| at most {MAX_ROUND_TRIPS} round trips a turn | {trips:.0f} scripts a turn (worst of {a['turns']}) "
        f"| {v(met['round_trips'])} |",
        f"| writes ≤ 2 × the new positions' bytes + 16 KB | the turn nearest its bound: {_kb(worst_w['written'])} KB of "
        f"{_kb(bound(r, worst_w['new']))} KB ({len(over_w)} of {a['turns']} over) | {v(met['writes'])} |",
        f"| reads ≤ the same | the turn nearest its bound: {_kb(worst_r['read'])} KB of {_kb(bound(r, worst_r['new']))} KB "
        f"({len(over_r)} of {a['turns']} over) | {v(met['reads'])} |",
        f"| a fork of a ~1,000-token session grows `used_memory` by < 2% of its state | {share:.1%} "
        f"({fork['used_memory_growth'] / 2**20:.1f} of {fork['state_bytes'] / 2**20:.1f} MiB) | {v(met['fork'])} |",
    ]
    return lines, met


def _head(r: dict) -> list[str]:
    """How the figures were measured, and the state of a session at each history."""
    load = ", ".join(str(x) for x in r["load_average"])
    state_rows = [
        f"| {h['tokens']:,} | {h['state']['n_tokens']:,} | {h['state']['state_bytes'] / 2**20:.2f} | "
        f"{h['state']['history_bytes'] / 2**20:.2f} | {h['state']['used_memory_growth'] / 2**20:.2f} |"
        for h in r["histories"]
    ]
    return [
        SECTION,
        "",
        f"Written by `bench/state_economy.py` on {r['date']} at commit {r['commit']}, {r['machine']} (shared; "
        f"load average at its end {load}): {r['label']} served by `recur serve` (1 torch thread) on a Redis of "
        "its own, the history a slice of a held-out play. Each turn is measured with Redis's own counters "
        "around the request: scripts (`INFO commandstats`), bytes received and sent (`INFO stats` "
        "`total_net_input_bytes`, `total_net_output_bytes`), less the readings' own INFO calls and the "
        "storage guard's `INFO memory` polls (every 0.5 s, whatever the traffic). One position of state is "
        f"{r['bytes_per_position'] / KB:.1f} KB (two sessions' `state_bytes` apart); `used_memory` is read "
        "once Redis has let go of the request's query buffer.",
        "",
        "| history (tokens) | tokens consumed | state, MiB | kept versions and transcript, MiB | "
        "Redis `used_memory` growth on create, MiB |",
        "|---|---|---|---|---|",
        *state_rows,
        "",
    ]


def _fork(fork: dict) -> list[str]:
    share = fork["used_memory_growth"] / fork["state_bytes"]
    return [
        f"A fork (`POST /v1/sessions/{{id}}/fork`) of the {fork['n_tokens']:,}-token session (its state "
        f"{fork['state_bytes'] / 2**20:.1f} MiB), median of {len(fork['rows'])}: {_kb(fork['written'])} KB "
        f"written, {_kb(fork['read'])} KB read, {fork['scripts']:.0f} scripts, `used_memory` "
        f"+{fork['used_memory_growth'] / 2**20:.1f} MiB ({share:.0%} of the state), {fork['ms']:.0f} ms over HTTP.",
        "",
    ]


def _closing(r: dict, also: list[dict] | None = None) -> list[str]:
    """The Done-when verdicts, why each miss misses, and what is not measured."""
    table, met = verdicts(r)
    a = r["histories"][0]["in_place"]
    why = []
    if not met["round_trips"]:
        why.append(
            f"The round trips miss: {a['scripts']['median']:.0f} a turn (median), the record's place in the "
            "tenant's ledger a script of its own after the commit's settlement (docs/ARCHITECTURE.md, \"One "
            '`previous_response_id` turn"; one ledger script for both would make a turn 5). A turn that runs '
            "past 3.3 s (a slow CPU's) adds the writer lock's renewals (`renew.lua`, one per third of "
            "`lock_lease_seconds`; `MONITOR` shows them), counted here where they happen."
        )
    b = r["histories"][0]["branch"]
    if b["continued"] < b["turns"]:
        why.append(
            f"Only {b['continued']} of {b['turns']} branches continued a stored state: the i-th branch goes "
            "back i + 2 responses, and one older than the chain session's kept versions (`--history-versions`, "
            "8 by default) is prefilled anew in a session of its own, which writes its whole state: those "
            "turns set the branch column's medians."
        )
    if not met["fork"]:
        why.append(
            "The fork misses: it writes more than the manifest of names a paged fork should "
            '(docs/ARCHITECTURE.md, "the manifest and the pages").'
        )
    return [
        *table,
        "",
        "A turn that continues the chain's latest response commits a delta in the chain's own session, so "
        "its bytes follow the positions it added, and it reads and renders only its own input: the previous "
        "record says which ids close its reply after its state, and the chain keeps each turn's text once "
        "(d7fb1bc), so (a)'s reads are the same at 1,000 and 8,000 tokens of history (before, 9 KB and 31 KB: "
        "each turn read and rewrote the whole conversation's text). A turn longer than a third of the writer "
        "lock's lease (10 s) renews it, a script more. A branch (a second continuation of a response) forks that "
        "version: the fork names its pages (`fork.lua`, no state written), and the branch's `begin` then "
        "reads that state once, since the hot cache holds the chain's latest commit, not the older one "
        "branched from; its writes are its own delta, as (a)'s. Before pages (until 85c6d17) a branch also wrote "
        "the whole state (52 MB a turn here) and read it twice, and a fork copied 100% of it. "
        + " ".join(why),
        "",
        "Not measured here: "
        + ("" if len(r["histories"]) > 1 else "8,000 tokens of history (`--long`); ")
        + ("" if also else "`shakespeare` (`--also shakespeare` adds it); ")
        + "Redis "
        '`used_memory` for 1,000 sessions is in "Sessions at scale" (bench/session_scale.py).',
        "",
        "Reproduce: `python bench/state_economy.py --turns 20 --long --also shakespeare` (as `make bench` "
        "runs it; `--long` adds 8,000 tokens of history, `--long-turns` turns a route there; `--write` "
        "rewrites this section).",
        "",
    ]


def section(r: dict, also: list[dict] | None = None) -> str:
    lines = _head(r)
    for h in r["histories"]:
        lines += [
            f"At {h['tokens']:,} tokens of history, per 16-token turn (greedy, 16 tokens exactly; "
            f"{h['in_place']['turns']} turns a route):",
            "",
        ]
        lines += [*turn_table(r, h), ""]
    return "\n".join(
        [*lines, *_fork(r["histories"][0]["fork"]), *_others([r, *(also or [])]), *_closing(r, also)]
    )


def _others(results: list[dict]) -> list[str]:
    """Every model and history of the run in one table: medians of each route's turns."""
    if len(results) == 1 and len(results[0]["histories"]) == 1:
        return []
    rows = [
        "Each model and history measured in this run (medians; KB written / read per 16-token turn):",
        "",
        "| model | history | state, MiB | (a) chain: scripts, written, read | (b) branch: written, read "
        "(continued) | (c) session: written, read | fork: `used_memory` growth |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for h in r["histories"]:
            a, b, c = h["in_place"], h["branch"], h["session"]
            fork = h.get("fork")
            share = f"{fork['used_memory_growth'] / fork['state_bytes']:.2%}" if fork else "-"
            rows.append(
                f"| {r['label']} | {h['tokens']:,} | {h['state']['state_bytes'] / 2**20:.2f} | "
                f"{a['scripts']['median']:.0f}, {_kb(a['written']['median'])}, {_kb(a['read']['median'])} | "
                f"{_kb(b['written']['median'])}, {_kb(b['read']['median'])} ({b['continued']} of {b['turns']}) | "
                f"{_kb(c['written']['median'])}, {_kb(c['read']['median'])} | {share} |"
            )
    return [*rows, ""]


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--model", default="smollm2", help="a shipped model or a checkpoint path")
    ap.add_argument("--turns", type=int, default=4, help="turns measured on each route")
    ap.add_argument("--forks", type=int, default=3)
    ap.add_argument("--long", action="store_true", help="also at 8,000 tokens of history")
    ap.add_argument("--long-turns", type=int, default=4, help="turns a route at 8,000 tokens (--long)")
    ap.add_argument("--also", action="append", default=[], help="another model, measured after (a table row)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: a tiny LLaMA, 200 tokens, 2 turns")
    args = ap.parse_args()
    if args.quick:
        args.turns, args.forks = 2, 1
    r = measure(args.model, args.quick, args.long, args.turns, args.forks, args.long_turns)
    also = [measure(m, False, args.long, args.turns, args.forks, args.long_turns) for m in args.also]
    for x in [r, *also]:
        for h in x["histories"]:
            print("\n".join(turn_table(x, h)))
    write = args.write and not args.quick and args.model == "smollm2"
    if args.write and not write:
        print("--write: only a full run on smollm2 writes the section")
    publish(SECTION, section(r, also), {**r, "also": also}, write)


if __name__ == "__main__":
    main()
