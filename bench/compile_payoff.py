"""Does the background compile pay for itself? A server's first minutes, with and without it.

For each shipped family, a fresh `recur serve` on its own Redis, once with the background
compile (`--compile`, a cold inductor cache: the first start of a version on a host) and
once without: four clients start the moment /readyz answers, each on its own session,
looping over a mixed load (a 5,000-character score that commits, a streamed 32-token
generate, a 32-token chat completion). Requests completed per minute, side by side, and
when the compile finished. Then the start times: to /readyz, and to the compiled step
serving, with the cache cold and again warm, without load.

Usage: python bench/compile_payoff.py [--minutes 10] [--models shakespeare,shakespeare-rlt] [--write]
Prints a table per model and `RESULT {json}`; `--write` also puts the "Background compile"
section into docs/BENCHMARKS.md (`make bench-compile`; not part of `make bench`: it takes
about an hour).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx
from harness import Redis, Server, emit, write_section
from serving import corpus_text

CLIENTS = 4
SCORE_CHARS = 5000
SECTION = "## Background compile"


def _client_loop(url: str, i: int, until: float, done: list[float], errors: list[str]) -> None:
    """One client: its own session, the three kinds of request in turn, until `until`."""
    score = corpus_text(SCORE_CHARS * (i + 1))[SCORE_CHARS * i :]
    with httpx.Client(base_url=url, timeout=600) as c:
        sid = c.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
        k = 0
        while time.monotonic() < until:
            if k % 3 == 0:
                r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": score, "commit": True})
            elif k % 3 == 1:
                r = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 32, "stream": True, "seed": k})
            else:
                body = {"messages": [{"role": "user", "content": "Speak, friend."}], "max_tokens": 32}
                r = c.post("/v1/chat/completions", json=body)
            if r.status_code < 400:
                done.append(time.monotonic())
            else:
                errors.append(f"{r.status_code} {r.text[:200]}")
                print(f"client {i}: {r.request.method} {r.request.url.path}: {errors[-1]}", flush=True)
            k += 1


def _load(srv: Server, minutes: float) -> tuple[list[float], int, float | None]:
    """Run the clients for `minutes`: completion times (from start), errors, and when the
    compile finished (seconds from the server's start; None: off, or not in time)."""
    until = time.monotonic() + minutes * 60
    done: list[float] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=_client_loop, args=(srv.url, i, until, done, errors)) for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    compiled = None
    while any(t.is_alive() for t in threads):
        if compiled is None and srv.compile_state() in ("ready", "failed"):
            compiled = time.monotonic() - srv.started
        time.sleep(1)
    return [t - srv.started for t in done], len(errors), compiled


def _per_minute(stamps: list[float], start: float, minutes: float) -> list[int]:
    return [sum(1 for t in stamps if start + 60 * m <= t < start + 60 * (m + 1)) for m in range(int(minutes))]


def payoff(model: str, minutes: float, work: Path) -> dict:
    out: dict = {"model": model}
    for arm, compile in (("compile", True), ("eager", False)):
        redis = Redis(work / f"{arm}-redis")
        env = {"TORCHINDUCTOR_CACHE_DIR": str(work / f"{model}-cache")}  # cold for the first start
        srv = Server(model, redis.url, work / arm, env=env, wait_compiled=False, compile=compile)
        try:
            stamps, errors, compiled = _load(srv, minutes)
        finally:
            srv.stop()
            redis.stop()
        out[arm] = {"ready_s": srv.ready, "per_minute": _per_minute(stamps, srv.ready, minutes),
                    "errors": errors, "compiled_s": compiled}  # fmt: skip
    out["ratio"] = sum(out["compile"]["per_minute"]) / max(1, sum(out["eager"]["per_minute"]))
    return out


def start_times(model: str, work: Path) -> dict:
    """To /readyz and to the compile's end, idle, with a cold and then a warm cache."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(work / f"{model}-start-cache")}
    out = {}
    for label in ("cold", "warm"):
        redis = Redis(work / f"{label}-redis")
        srv = Server(model, redis.url, work / f"start-{label}", env=env, wait_compiled=False, compile=True)
        try:
            out[label] = {"ready_s": srv.ready, "compiled_s": srv.wait_compiled(time.monotonic() + 1800),
                          "state": srv.compile_state()}  # fmt: skip
        finally:
            srv.stop()
            redis.stop()
    return out


def report(r: dict) -> None:
    c, e = r["compile"], r["eager"]
    print(f"\n{r['model']}: requests completed per minute by 4 clients from /readyz (compile | eager)")
    for m, (a, b) in enumerate(zip(c["per_minute"], e["per_minute"], strict=True)):
        print(f"  minute {m + 1:2d}: {a:4d} | {b:4d}")
    print(
        f"  total: {sum(c['per_minute'])} | {sum(e['per_minute'])}  (ratio {r['ratio']:.2f}); errors "
        f"{c['errors']} | {e['errors']}; compile finished at {c['compiled_s']} s after start"
    )
    s = r["starts"]
    for label in ("cold", "warm"):
        print(
            f"  {label} start, idle: /readyz {s[label]['ready_s']:.1f} s, compile {s[label]['state']} at "
            f"{s[label]['compiled_s']:.1f} s"
        )


def section(results: list[dict], minutes: float) -> str:
    lines = [
        SECTION,
        "",
        "Is the background compile of the decode step (`RECUR_COMPILE`, app/engine/compiler.py) worth "
        f"its default? A fresh server per case, four clients from the moment `/readyz` answers, for {minutes:g} "
        "minutes, each on its own session, looping over a 5,000-character score that commits, a streamed "
        "32-token generate and a 32-token chat completion; the compile starts from a cold inductor cache "
        "(the first start of a version on a host). Requests completed:",
        "",
        "| model | with the compile | eager only | ratio | compile done after | start, cold cache: /readyz, compiled | warm cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c, e, st = r["compile"], r["eager"], r["starts"]
        done = "not in the run" if c["compiled_s"] is None else f"{c['compiled_s']:.0f} s"
        lines.append(
            f"| `{r['model']}` | {sum(c['per_minute'])} | {sum(e['per_minute'])} | {r['ratio']:.2f} | {done} | "
            f"{st['cold']['ready_s']:.0f} s, {st['cold']['compiled_s']:.0f} s ({st['cold']['state']}) | "
            f"{st['warm']['ready_s']:.0f} s, {st['warm']['compiled_s']:.0f} s ({st['warm']['state']}) |"
        )
    lines += ["", "Per minute (with the compile / eager only):", ""]
    for r in results:
        pairs = zip(r["compile"]["per_minute"], r["eager"]["per_minute"], strict=True)
        lines.append(f"* `{r['model']}`: " + ", ".join(f"{a}/{b}" for a, b in pairs))
    lines += [
        "",
        "The compile is therefore off by default (`RECUR_COMPILE=false`): where the ratio is below 1 it "
        "costs more requests in a server's first minutes than the compiled step wins back. Its work holds "
        "Python's lock for most of its minutes (dynamo's tracing and inductor's lowering), which the "
        "engine thread and the event loop need too, so a lower CPU priority for the compile thread does "
        "not give the serving threads their time back. Turn it on where the steady state matters more "
        "than the first minutes and the probe adopts the compiled step (`recur_decode_compiled` in "
        "`/metrics`), or on a host with cores to spare. Start times are idle starts (no load): "
        "`/readyz` does not wait for the compile; the eager step serves until the compiled one is ready.",
        "",
        f"Reproduce: `python bench/compile_payoff.py --minutes {minutes:g}` (add `--write` to rewrite this "
        "section; `make bench-compile`).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--models", default="shakespeare,shakespeare-rlt")
    ap.add_argument("--write", action="store_true", help="put the section into docs/BENCHMARKS.md")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="recur-compile-payoff-") as tmp:
        for model in args.models.split(","):
            r = payoff(model, args.minutes, Path(tmp) / model)
            r["starts"] = start_times(model, Path(tmp) / model)
            report(r)
            results.append(r)
    emit({"compile_payoff": results, "minutes": args.minutes})
    if args.write:
        write_section(SECTION, section(results, args.minutes))


if __name__ == "__main__":
    main()
