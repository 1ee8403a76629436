"""Responses linked by previous_response_id against the same conversation resent whole: a
20-turn conversation through the official `openai` SDK against a real `recur serve`
(shipped `shakespeare`, a real Redis, 1 torch thread), once as a chain of responses (each
turn sends only its new user line and the previous response's id) and once through
/v1/chat/completions resending the whole conversation each turn (harness.conversation,
as bench/chat_reuse.py does), on a server with prefix reuse on and on one with it off.
The same fixed lines (the scene as `instructions`, the chat's system message), greedy,
every reply exactly `--max-tokens` tokens (`min_tokens` = the cap), so each turn decodes
the same and the growth of a turn's latency is its prefill.

The two servers run side by side and the repetitions alternate between them (and between
the chain and the chat), so the noise of a shared machine falls on every series alike;
each figure is the median over the repetitions. Each series of each repetition speaks
under an API key of its own, so its first turn finds no prefix (not even the other
series').

Prints a table and `RESULT {json}`; `--write` also puts the "Responses by
previous_response_id" section into docs/BENCHMARKS.md, which `make bench` does.
Usage: python bench/responses.py [--repetitions 5] [--turns 20] [--max-tokens 32] [--write]
"""

from __future__ import annotations

import os
import time

import openai
from harness import SCENE, USER, alternate, conversation, conversation_main, turn_medians

SECTION = "## 14. Responses by previous_response_id"
SHOWN = (1, 5, 10, 15, 20)
TARGET = 1.1  # turn 20 ÷ turn 1, chained by previous_response_id


def chain(url: str, model: str, key: str, turns: int, max_tokens: int) -> list[dict]:
    """One conversation as responses linked by previous_response_id: per turn, its latency
    (the SDK call), the input's tokens and those prefilled (not `cached_tokens`)."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    previous = None
    rows = []
    for turn in range(turns):
        t0 = time.perf_counter()
        r = oa.responses.create(
            model=model,
            instructions=SCENE[0]["content"],
            input=USER[turn % len(USER)],
            previous_response_id=previous,
            temperature=0,
            max_output_tokens=max_tokens,
            extra_body={"min_tokens": max_tokens},
        )
        seconds = time.perf_counter() - t0
        assert r.usage is not None and r.usage.output_tokens == max_tokens, r.usage
        cached = r.usage.input_tokens_details.cached_tokens
        assert turn == 0 or cached > 0, f"turn {turn + 1} did not continue the previous response's state"
        rows.append(
            {
                "turn": turn + 1,
                "ms": seconds * 1e3,
                "prompt_tokens": r.usage.input_tokens,
                "prefilled": r.usage.input_tokens - cached,
            }
        )
        previous = r.id
    return rows


def measure(repetitions: int, turns: int, max_tokens: int) -> dict:
    about, runs = alternate(
        {"chain": chain, "chat": conversation}, "recur-responses-", repetitions, turns, max_tokens
    )
    return {
        **about,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        **{f"{mode}_{series}": turn_medians(r) for (mode, series), r in runs.items()},
    }


LABELS = {
    "on_chain": "previous_response_id, reuse on",
    "off_chain": "previous_response_id, reuse off",
    "on_chat": "chat resent whole, reuse on",
    "off_chat": "chat resent whole, reuse off",
}


def _table(r: dict) -> list[str]:
    """Each series' latency per turn, and the tokens each prefilled."""
    n = r["turns"]
    shown = [t for t in SHOWN if t <= n]
    head = "| series | " + " | ".join(f"turn {t} (ms)" for t in shown) + f" | turn {n} ÷ turn 1 |"
    rows = [
        f"| {label} | "
        + " | ".join(str(r[k]["turn_ms"][t - 1]) for t in shown)
        + f" | {r[k]['ratio']}× (per run: {r[k]['ratio_median_of_runs']}×) |"
        for k, label in LABELS.items()
    ]
    tokens = [
        f"| tokens prefilled, {label} | " + " | ".join(str(r[k]["prefilled"][t - 1]) for t in shown) + " | |"
        for k, label in LABELS.items()
    ]
    return [head, "|---|" + "---|" * (len(shown) + 1), *rows, *tokens]


def section(r: dict) -> str:
    n, on, off, chat_off = r["turns"], r["on_chain"], r["off_chain"], r["off_chat"]
    worst = max(on["ratio"], off["ratio"])
    load = ", ".join(str(x) for x in r["load_average"])
    lines = [
        SECTION,
        "",
        f"Written by `bench/responses.py`. A {n}-turn conversation through the official `openai` SDK "
        f"against `recur serve` ({r['model']}, a real Redis, 1 torch thread): as responses linked by "
        "`previous_response_id` (each turn sends its new user line; the scene is the `instructions`), "
        "and as chat completions resending the whole conversation each turn (the scene its system "
        "message), on two servers side by side, one with prefix reuse on and one with "
        "`--no-prefix-reuse`, the repetitions alternating between the servers and the two clients. "
        f"The same fixed lines, greedy, each reply exactly {r['max_tokens']} tokens (`min_tokens` = the "
        "cap, so a turn's growth is its prefill); each latency is the median of "
        f"{r['repetitions']} repetitions (the SDK call, client to client). Run on the shared 2-core "
        f"machine; load average (1, 5, 15 min) at its end: {load} (above 2, other jobs took cores).",
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| turn-{n} latency ÷ turn-1 latency, previous_response_id: ≤ {TARGET}× | {on['ratio']}× "
        f"(reuse on), {off['ratio']}× (reuse off) | " + ("met" if worst <= TARGET else "**missed**") + " |",
        "",
        *_table(r),
        "",
        f"Chained by `previous_response_id`, turn {n} forks turn {n - 1}'s state and prefills only "
        f"the {on['prefilled'][-1]} tokens after it (its reply's turn stop, the new user line, the "
        "generation prompt) with prefix reuse on or off: the chain does not depend on the prefix "
        f"index. Resent whole without reuse, turn {n} re-prefills its {chat_off['prompt_tokens'][-1]}-"
        f"token conversation and takes {chat_off['ratio']}× turn 1, "
        f"{chat_off['turn_ms'][-1] / on['turn_ms'][-1]:.1f}× the chained turn {n}.",
    ]
    if worst > TARGET:
        lines += [
            "",
            f"**Why the target misses.** The chained turn {n} prefills {on['prefilled'][-1]} tokens "
            f"and turn 1 {on['prefilled'][0]}: no chained turn's work grows with the conversation (a "
            "fork copies a state of fixed size; the check that the state's tokens are a prefix of the "
            "rendering hashes the rendered ids once). What is left is the noise of single turns on "
            "this shared machine: see the per-run ratio and the turns between.",
        ]
    lines += ["", "Reproduce: `python bench/responses.py` (add `--write` to rewrite this section).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    conversation_main(__doc__, SECTION, measure, section)
