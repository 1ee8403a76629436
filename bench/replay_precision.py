"""Replay and precision: how far from 1 `recur replay`'s importance ratios are when the
server samples in one precision and replay scores in another, at the same weights.

For each shipped family, a `recur serve` process (real Redis, CPU, one thread) runs in
fp32, in bf16 (autocast), and in fp32 with bf16 states stored between requests; one
session per server generates with mixed sampling settings; its transcript is replayed in
fp32 and in bf16. Prints a markdown table (the
figures in docs/RELIABILITY.md, "Replay and precision") and `RESULT {json}`.

Usage: python bench/replay_precision.py [--tokens 100]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import httpx
import torch
from harness import Redis, Server, emit

import model
from app.replay_client import fetch_transcript
from model.replay import replay_transcript, transcript_rollout

# how the server computes, and how it stores states between requests
SERVERS = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "fp32, bf16 states": {"precision": "fp32", "state_dtype": "bfloat16"},
}
SETTINGS = [
    {"temperature": 0},
    {"temperature": 0.8, "top_k": 20, "seed": 1},
    {"temperature": 1.2, "top_p": 0.9, "seed": 2},
    {"temperature": 1.0, "top_k": 5, "top_p": 0.7, "seed": 3},
    {"temperature": 0.7, "seed": 4},
]


def session(url: str, tokens: int) -> str:
    """A session that generated `tokens` tokens under each of SETTINGS in turn."""
    with httpx.Client(base_url=url, timeout=300) as c:
        sid = c.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
        for body in SETTINGS:
            r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": tokens, **body})
            r.raise_for_status()
    return sid


def measure(name: str, transcript: dict, precision: str) -> dict:
    lm = model.load(name, device="cpu", precision=precision)
    result = replay_transcript(lm, transcript_rollout(transcript))
    dev = [abs(r - 1) for r in result.ratios]
    return {
        "replay": precision,
        "actions": len(dev),
        "max_abs_ratio_minus_1": max(dev),
        "median_abs_ratio_minus_1": statistics.median(dev),
        "mean_ratio": statistics.fmean(result.ratios),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100, help="tokens generated per sampling setting")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="recur-replay-precision-"))
    redis = Redis(work / "redis")
    rows = []
    try:
        for name in ("shakespeare", "shakespeare-rlt"):
            for served, flags in SERVERS.items():
                srv = Server(name, redis.url, work / f"{name}-{len(rows)}", cpu_threads=1, **flags)
                try:
                    transcript = fetch_transcript(srv.url, session(srv.url, args.tokens))
                finally:
                    srv.stop()
                rows += [
                    {"model": name, "server": served, **measure(name, transcript, p)}
                    for p in ("fp32", "bf16")
                ]
    finally:
        redis.stop()
    print("| model | server | replay | actions | max \\|ratio − 1\\| | median \\|ratio − 1\\| | mean ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['model']}` | {r['server']} | {r['replay']} | {r['actions']} | {r['max_abs_ratio_minus_1']:.2g} "
            f"| {r['median_abs_ratio_minus_1']:.2g} | {r['mean_ratio']:.6f} |"
        )
    emit({"replay_precision": rows})


if __name__ == "__main__":
    main()
