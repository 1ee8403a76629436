"""Prefix reuse for a stateless chat client: a 20-turn chat through the official `openai`
SDK against a real `recur serve` (shipped `shakespeare`, a real Redis, 1 torch thread),
resending the whole conversation every turn, with reuse on and with it off
(`--no-prefix-reuse`), the same fixed messages, greedy.

Every reply is exactly `--max-tokens` tokens (`min_tokens` = `max_tokens`), so each turn
decodes the same amount and the growth of a turn's latency is the prefill it does. The
two servers run side by side and the repetitions alternate between them, so the noise of a
shared machine falls on both alike; each figure is the median over the repetitions. The
hit rate comes from the server's /metrics. Each repetition speaks under an API key of its
own, so its first turn finds no prefix.

Prints a table and `RESULT {json}`; `--write` also puts the "Prefix reuse" section into
docs/BENCHMARKS.md (replacing the one there), which `make bench` does after report.py.
This script measures; it never changes a setting of the server it talks to.
Usage: python bench/chat_reuse.py [--repetitions 5] [--turns 20] [--max-tokens 32] [--write]
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import openai
from harness import Redis, Server, arguments, model_dir, publish

SECTION = "## 8. Prefix reuse"
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
SHOWN = (1, 5, 10, 15, 20)


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


def summary(runs: list[list[dict]]) -> dict:
    """Medians per turn over the repetitions, the turn-20 ÷ turn-1 ratio (of the medians, and
    the median of each repetition's own ratio), the hit rate over the turns after the first."""
    turns = len(runs[0])
    ms = [statistics.median(r[t]["ms"] for r in runs) for t in range(turns)]
    later = [row for r in runs for row in r[1:]]
    return {
        "turn_ms": [round(x, 1) for x in ms],
        "prefilled": [round(statistics.median(r[t]["prefilled"] for r in runs)) for t in range(turns)],
        "prompt_tokens": [runs[0][t]["prompt_tokens"] for t in range(turns)],
        "ratio": round(ms[-1] / ms[0], 2),
        "ratio_median_of_runs": round(statistics.median(r[-1]["ms"] / r[0]["ms"] for r in runs), 2),
        # the trend among hits alone, over five turns each end: less at the mercy of one noisy turn
        "late_over_early": round(statistics.median(ms[-5:]) / statistics.median(ms[1:6]), 2),
        "hit_rate": sum(row["hit"] for row in later) / len(later),
        "non_utf8_replies": sum(not row["utf8"] for r in runs for row in r),
    }


def measure(repetitions: int, turns: int, max_tokens: int) -> dict:
    name, label = model_dir("shakespeare")
    work = Path(tempfile.mkdtemp(prefix="recur-chat-reuse-"))
    redis = Redis(work / "redis")
    keys = [f"rep-{i}" for i in range(repetitions + 1)]  # (the last one warms the servers up)
    common = dict(cpu_threads=1, max_tokens=max_tokens, api_keys=",".join(keys))
    servers = {
        mode: Server(
            name, redis.url, work / mode, key_prefix=f"bench-{mode}:", prefix_reuse=mode == "on", **common
        )
        for mode in ("on", "off")
    }
    runs: dict[str, list[list[dict]]] = {"on": [], "off": []}
    try:
        for s in servers.values():
            conversation(s.url, name, keys[-1], 2, max_tokens)
        for rep in range(repetitions):
            order = ("on", "off") if rep % 2 == 0 else ("off", "on")
            for mode in order:
                runs[mode].append(conversation(servers[mode].url, name, keys[rep], turns, max_tokens))
                print(
                    f"repetition {rep + 1}/{repetitions}, reuse {mode}: turn 1 {runs[mode][-1][0]['ms']:.0f} ms, "
                    f"turn {turns} {runs[mode][-1][-1]['ms']:.0f} ms",
                    flush=True,
                )
    finally:
        for s in servers.values():
            s.stop()
        redis.stop()
    return {
        "model": label,
        "turns": turns,
        "max_tokens": max_tokens,
        "repetitions": repetitions,
        "on": summary(runs["on"]),
        "off": summary(runs["off"]),
    }


def _table(r: dict) -> list[str]:
    """Each turn's latency with reuse on and off, and the tokens each prefilled."""
    on, off, n = r["on"], r["off"], r["turns"]
    shown = [t for t in SHOWN if t <= n]
    head = (
        "| reuse | "
        + " | ".join(f"turn {t} (ms)" for t in shown)
        + f" | turn {n} ÷ turn 1 | hit rate, turns 2–{n} |"
    )
    rows = [
        f"| {mode} | "
        + " | ".join(str(s["turn_ms"][t - 1]) for t in shown)
        + f" | {s['ratio']}× (per run: {s['ratio_median_of_runs']}×) | {s['hit_rate'] * 100:.0f}% |"
        for mode, s in (("on", on), ("off", off))
    ]
    tokens = (
        "| tokens prefilled | "
        + " | ".join(f"on {on['prefilled'][t - 1]}, off {off['prefilled'][t - 1]}" for t in shown)
        + " | | |"
    )
    return [head, "|---|" + "---|" * (len(shown) + 2), *rows, tokens]


def section(r: dict) -> str:
    on, off, n = r["on"], r["off"], r["turns"]
    hit_ok, ratio_ok = on["hit_rate"] >= 0.95, on["ratio"] <= 1.2
    lines = [
        SECTION,
        "",
        f"Written by `bench/chat_reuse.py`. A {n}-turn chat through the official `openai` SDK against "
        f"`recur serve` ({r['model']}, a real Redis, 1 torch thread), a stateless client: every turn "
        "resends the whole conversation, the assistant's messages as returned. The same fixed user "
        f"lines, greedy, each reply exactly {r['max_tokens']} tokens (`min_tokens` = `max_tokens`, so "
        "every turn decodes the same and a turn's growth is its prefill). Two servers side by side, "
        "one with prefix reuse on and one with `--no-prefix-reuse`, the repetitions alternating "
        f"between them; each latency is the median of {r['repetitions']} repetitions (the SDK call, "
        "client to client), the hit rate is from `/metrics`.",
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| hit rate, turns after the first, reuse on: ≥ 95% | {on['hit_rate'] * 100:.0f}% | "
        + ("met" if hit_ok else "**missed**")
        + " |",
        f"| turn-{n} latency ÷ turn-1 latency, reuse on: ≤ 1.2× | {on['ratio']}× | "
        + ("met" if ratio_ok else "**missed**")
        + " |",
        "",
        *_table(r),
        "",
        f"With reuse off, turn {n} re-prefills its whole {off['prompt_tokens'][-1]}-token conversation and "
        f"takes {off['ratio']}× turn 1; with reuse on it forks turn {n - 1}'s state and prefills only "
        f"the {on['prefilled'][-1]} tokens after it (the turn stop, the new user line and the "
        f"generation prompt), so turn {n} takes {on['ratio']}× turn 1 and "
        f"{off['turn_ms'][-1] / on['turn_ms'][-1]:.1f}× less than without reuse.",
    ]
    if not ratio_ok:
        lines += [
            "",
            f"**Why the latency target misses.** Turn {n} prefills {on['prefilled'][-1]} tokens, turn 1 "
            f"{on['prefilled'][0]}: with reuse on no turn's work grows with the conversation (a fork copies "
            "a state of fixed size, the memory; the lookup hashes the prompt's tokens and reads one Redis "
            "key per prefix in one script). Among the hits alone, the median of the last five turns is "
            f"{on['late_over_early']}× that of turns 2–6, against {off['late_over_early']}× with reuse off: "
            f"what is left of the {on['ratio']}× is the noise of single turns on this shared 2-core machine "
            "(one turn's median over the repetitions moves by tens of ms between neighbouring turns in "
            "the RESULT line), not a cost that grows with the history.",
        ]
    if on["non_utf8_replies"]:
        lines += [
            "",
            f"{on['non_utf8_replies']} replies held bytes that are not UTF-8 (docs/OPENAI.md, Chat templates).",
        ]
    lines += ["", "Reproduce: `python bench/chat_reuse.py` (add `--write` to rewrite this section).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    r = measure(args.repetitions, args.turns, args.max_tokens)
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
