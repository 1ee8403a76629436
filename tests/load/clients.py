"""The load's clients and their tally (issue 38, item 4).

A client does one job after another, each on a session of its own: create the session
with the job's prompt, ask the job's request of it, compare the answer with the same
request's answer alone on the quiet server (`Job.alone`), delete the session. The tally
counts every outcome of every HTTP request, session creation and deletion included:
answers, refusals (429 and 503, or a stream's error event of those types: the limits at
work), and errors (anything else, a transport error, an answer that differs from the
request's answer alone).
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.api.http.error_types import ErrorType
from app.api.http.errors import STATUS
from app.chat import KEEPALIVE_EXPIRY
from tests.app.sse_client import events
from tests.conftest import ServerProcess

REFUSALS = {t.value for t, status in STATUS.items() if status in (429, 503)}
MAX_TOKENS = 16  # per generate by default; ignore_eos, so every answer has this many tokens
TOLERANCE = 1e-4  # scored log-probs, loaded under load against alone
RETRY_AFTER = 0.05  # seconds a refused client waits (the server's Retry-After, shortened)


@dataclass(frozen=True)
class Job:
    """A session made with `prompt`, then `kind` asked of it: a greedy generate (streamed or
    not), a seeded sampled one (streamed), or a score of `then` that commits; or, with no
    session, a greedy chat completion of `prompt` (prefix reuse serves it)."""

    prompt: str
    kind: str
    seed: int = 0
    then: str = " and the rest"
    max_tokens: int = MAX_TOKENS

    @property
    def route(self) -> str:
        return "score" if self.kind == "score" else "chat" if self.kind == "chat" else "generate"

    def body(self) -> dict:
        if self.kind == "score":
            return {"prompt": self.then, "commit": True}
        if self.kind == "chat":
            messages = [{"role": "user", "content": self.prompt}]
            return {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0}  # (the served model)
        sampled = self.kind == "seeded-stream"
        return {
            "prompt": " then",
            "max_tokens": self.max_tokens,
            "temperature": 0.8 if sampled else 0,
            "seed": self.seed,
            "ignore_eos": True,
            "stream": self.kind.endswith("stream"),
        }

    def ask(self, c: httpx.Client, sid: str) -> tuple[int, str, object, dict]:
        """(HTTP status, error type or "", the answer: token ids and text, or log-probs; the
        session as the answer says it committed it)."""
        route, body = self.route, self.body()
        if route == "chat":
            r = c.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                return r.status_code, _error_type(r), None, {}
            return 200, "", r.json()["choices"][0]["message"]["content"], {}
        if not body.get("stream"):
            r = c.post(f"/v1/sessions/{sid}/{route}", json=body)
            if r.status_code != 200:
                return r.status_code, _error_type(r), None, {}
            data = r.json()
            if route == "score":
                return 200, "", [t["logprob"] for t in data["tokens"]], data["session"]
            return 200, "", ([t["id"] for t in data["tokens"]], data["text"]), data["session"]
        with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, _error_type(r), None, {}
            ids = []
            for name, data in events(r):
                if name == "token":
                    ids.append(data["id"])
                elif name == "done":
                    return 200, "", (ids, data["text"]), data["session"]
                else:
                    return 200, data["error"]["type"], None, {}
        return 200, "stream ended without done", None, {}

    def same(self, answer: object, alone: object) -> bool:
        if self.kind != "score":
            return answer == alone
        assert isinstance(answer, list) and isinstance(alone, list)
        return len(answer) == len(alone) and all(
            a == b or (a is not None and b is not None and math.isclose(a, b, abs_tol=TOLERANCE))
            for a, b in zip(answer, alone, strict=True)
        )


KINDS = ("greedy", "greedy-stream", "seeded-stream", "score")


def jobs(
    prompts: list[str], kinds: tuple[str, ...] = KINDS, then: str = " and the rest", max_tokens: int = MAX_TOKENS
) -> list[Job]:
    """Every kind of job on every prompt, each sampled one with a seed of its own."""
    return [
        Job(p, kind, seed, then, max_tokens) for seed, (p, kind) in enumerate(itertools.product(prompts, kinds))
    ]


def _error_type(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return f"unparsed {r.status_code}"


@dataclass
class Tally:
    """Every outcome of the load, by route: answers, refusals by type, errors."""

    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    refusals: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, route: str, status: int, etype: str) -> bool:
        """Count one outcome; True for an answer."""
        with self.lock:
            if status < 300 and not etype:
                self.answers[route] += 1
                return True
            if status in (429, 503) or (status == 200 and etype in REFUSALS):
                self.refusals[(route, etype)] += 1
            else:
                self.errors.append(f"{route}: {status} {etype}")
        return False

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)

    def refused(self, route: str, etype: ErrorType) -> int:
        return self.refusals[(route, etype.value)]


def alone(c: httpx.Client, job: Job) -> object:
    """The job's answer on the quiet server."""
    if job.kind == "chat":
        status, etype, answer, _ = job.ask(c, "")
        assert (status, etype) == (200, ""), (job, status, etype)
        return answer
    r = c.post("/v1/sessions", json={"prompt": job.prompt})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    status, etype, answer, _ = job.ask(c, sid)
    assert (status, etype) == (200, ""), (job, status, etype)
    assert c.delete(f"/v1/sessions/{sid}").status_code in (200, 204)
    return answer


def client(
    makers: list[Callable[[], httpx.Client]],
    todo: list[Job],
    start: int,
    answers: dict[Job, object],
    until: threading.Event,
    tally: Tally,
) -> None:
    """Do the jobs from `start` on, in turn, until `until` is set; count every outcome. With
    several servers (replicas of one Redis), job k makes its session on server k and asks
    and deletes it on the next: the state crosses replicas through Redis."""
    clients = [make() for make in makers]
    try:
        for k in itertools.count(start):
            if until.is_set():
                return
            job = todo[k % len(todo)]
            here, there = clients[k % len(clients)], clients[(k + 1) % len(clients)]
            try:
                _one(here, there, job, answers[job], tally)
            except httpx.TransportError as exc:
                tally.error(f"transport error: {exc!r}")
    finally:
        for c in clients:
            c.close()


def _one(here: httpx.Client, there: httpx.Client, job: Job, expected: object, tally: Tally) -> None:
    if job.kind == "chat":
        status, etype, answer, _ = job.ask(there, "")
        if not tally.count("chat", status, etype):
            time.sleep(RETRY_AFTER)
        elif answer != expected:
            tally.error(f"{job}: {answer!r} under load, {expected!r} alone")
        return
    r = here.post("/v1/sessions", json={"prompt": job.prompt})
    if not tally.count("create", r.status_code, "" if r.status_code == 201 else _error_type(r)):
        time.sleep(RETRY_AFTER)
        return
    sid = r.json()["id"]
    status, etype, answer, committed = job.ask(there, sid)
    if not tally.count(job.route, status, etype):
        time.sleep(RETRY_AFTER)
    elif not job.same(answer, expected):
        tally.error(f"{job}: {answer!r} under load, {expected!r} alone")
    else:  # the acknowledged commit is what the session holds, read where it was made
        meta = here.get(f"/v1/sessions/{sid}")
        if tally.count("read", meta.status_code, "" if meta.status_code == 200 else _error_type(meta)):
            held = {k: meta.json()[k] for k in ("version", "n_tokens")}
            if held != {k: committed[k] for k in held}:
                tally.error(f"{job}: committed {committed}, the session holds {held}")
    r = there.delete(f"/v1/sessions/{sid}")
    tally.count("delete", r.status_code, "" if r.status_code < 300 else _error_type(r))


# -- the load: limits lowered so that a dozen clients reach them ------------------------------
# (at the shipped 32 rows, 256 queued requests and 64 streams per key it would take hundreds)
LIMITS = dict(max_batch_size=4, max_queued_requests=4, max_streams_per_key=3)
KEYS = {"key-few-sessions": 3, "key-many-sessions": None}  # each key's session quota (None: the default)
CLIENTS_PER_KEY = 6
PROMPTS = [f"{name}, speak: " + "o" * (7 * i) for i, name in enumerate("ABCDEF")]  # (1 to 3 chunks)


def keys_file(directory: Path) -> Path:
    path = directory / "keys"
    path.write_text("".join(f"{k} sessions={n}\n" if n else f"{k}\n" for k, n in KEYS.items()))
    return path


def as_key(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.url,
        timeout=120,
        headers={"Authorization": f"Bearer {key}"},
        # (as `recur chat`'s: at httpx's 5 s, the server's own, one request in a with-compile
        # load left as the server closed its idle connection, and met a reset)
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
    )


def answers_alone(server: ServerProcess, todo: list[Job]) -> dict[Job, object]:
    """Every job's answer alone, one after another on the quiet `server` (from the key
    without a session quota: a chat completion's session outlives it)."""
    with as_key(server, next(k for k, n in KEYS.items() if n is None)) as c:
        return {job: alone(c, job) for job in todo}


def reached(servers: list[ServerProcess], tally: Tally, min_answers: dict[str, int]) -> dict[str, bool]:
    """Which limits the load has reached so far, and whether enough answers came."""
    with tally.lock:
        return {
            "a full batch": all(
                s.metric("recur_decode_batch_max") >= LIMITS["max_batch_size"] for s in servers
            ),
            "queue_full": any(etype == ErrorType.queue_full.value for _, etype in tally.refusals),
            "the streams per key": tally.refused("generate", ErrorType.quota_exceeded) > 0,
            "the sessions per key": tally.refused("create", ErrorType.quota_exceeded) > 0,
            "enough answers": all(tally.answers[route] >= n for route, n in min_answers.items()),
        }


def drive(
    servers: list[ServerProcess],
    todo: list[Job],
    answers: dict[Job, object],
    done: Callable[[Tally], bool],
    guard: float,
) -> Tally:
    """CLIENTS_PER_KEY clients per key, each doing the jobs from its own place in `todo`,
    until `done(tally)` (or `guard` seconds: a load that never gets there fails its
    test's assertions, not CI's timeout); the tally of every outcome. A key with a session
    quota does no chat: a chat's own session counts in the quota until it expires (15
    minutes by default), which would shut the key out of the load after its first chats."""
    tally, until = Tally(), threading.Event()
    threads = []
    for key, quota in KEYS.items():
        mine = [job for job in todo if quota is None or job.kind != "chat"]
        for i in range(CLIENTS_PER_KEY):
            makers = [functools.partial(as_key, s, key) for s in servers]
            args = (makers, mine, i * len(mine) // CLIENTS_PER_KEY, answers, until, tally)
            threads.append(threading.Thread(target=client, args=args, daemon=True))
    for t in threads:
        t.start()
    began = time.monotonic()
    try:
        while not done(tally) and time.monotonic() - began < guard:
            time.sleep(0.5)
    finally:
        until.set()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads), "a client never returned"
    return tally
