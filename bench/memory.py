"""Resident memory and decode speed of the scheduler's allocation pattern, with and without
handing freed memory back to the OS (app/engine/malloc.py), measured side by side.

Each variant runs in its own process (a fresh allocator) and replays what the scheduler
does to memory: batches of 4-16 sessions with full states are stacked, decoded 16 steps
(each step allocates the batch's new state and frees the old one), split and kept, in a
seeded random order, for `--rounds` rounds. Variants:

* `off`       no trimming (glibc as is);
* `trim 5 s`  `malloc_trim(0)` at most every 5 s, as the server does by default
              (`RECUR_MALLOC_TRIM_INTERVAL=5`); the run is short, so this bench uses
              `--trim-interval` (default 1 s) to trim as often relative to its length;
* `mmap 64k`  the usual alternative, a fixed glibc mmap threshold
              (`MALLOC_MMAP_THRESHOLD_=65536`): every large tensor is a fresh mapping.

Usage: python bench/memory.py [--model shakespeare-rlt] [--rounds 150] [--repeats 2]
Prints ms per decode step and resident memory per variant, and their ratios to `off`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import ROOT, emit


def child(args: argparse.Namespace) -> None:
    import psutil
    import torch

    import model
    from app.engine.malloc import MallocTrimmer

    torch.set_num_threads(1)
    lm = model.load(args.model, device="cpu")
    rel = MallocTrimmer(args.child_trim)
    rng = random.Random(0)
    states = []
    with torch.no_grad():
        for _ in range(48):
            _, st = lm.consume([rng.randrange(256) for _ in range(160)], lm.new_state(1))
            states.append(st.clone())
        proc = psutil.Process()
        rss: list[float] = []
        steps = 0
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            rows = rng.sample(range(len(states)), rng.randint(4, 16))
            batch = lm.stack_states([states[i] for i in rows])
            for _ in range(16):
                ids = lm.next_logits(batch).argmax(-1)
                _, batch = lm(ids[:, None], batch, model.IN_PLACE)
                steps += 1
                rel.worked()
            for i, st in zip(rows, lm.split_state(batch), strict=True):
                states[i] = st.clone()
            rss.append(proc.memory_info().rss / 2**20)
        elapsed = time.perf_counter() - t0
    tail = rss[len(rss) // 2 :]
    print(
        json.dumps(
            {
                "ms_per_step": elapsed / steps * 1e3,
                "rss_median_mib": statistics.median(tail),
                "rss_max_mib": max(rss),
                "trims": rel.releases,
                "ms_per_trim": rel.seconds / rel.releases * 1e3 if rel.releases else None,
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shakespeare-rlt")
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trim-interval", type=float, default=1.0)
    p.add_argument("--child-trim", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_trim is not None:
        child(args)
        return
    variants = {
        "off": ({}, 0.0),
        "trim": ({}, args.trim_interval),
        "mmap 64k": ({"MALLOC_MMAP_THRESHOLD_": "65536"}, 0.0),
    }
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every variant alike
        for name, (env, trim) in variants.items():
            cmd = [
                sys.executable,
                __file__,
                "--model",
                args.model,
                "--rounds",
                str(args.rounds),
                "--child-trim",
                str(trim),
            ]
            out = subprocess.run(
                cmd,
                env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    result = {}
    for name, rs in runs.items():
        result[name] = {
            k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None for k in rs[0]
        }
    base = result["off"]
    print(
        f"{'variant':10} {'ms/step':>8} {'x off':>6} {'RSS MiB':>8} {'x off':>6} {'max MiB':>8} {'ms/trim':>8}"
    )
    for name, r in result.items():
        label = f"trim {args.trim_interval:g} s" if name == "trim" else name
        trim_ms = f"{r['ms_per_trim']:.2f}" if r["ms_per_trim"] else "-"
        print(
            f"{label:10} {r['ms_per_step']:8.2f} {r['ms_per_step'] / base['ms_per_step']:6.2f} "
            f"{r['rss_median_mib']:8.0f} {r['rss_median_mib'] / base['rss_median_mib']:6.2f} "
            f"{r['rss_max_mib']:8.0f} {trim_ms:>8}"
        )
    emit({"model": args.model, "trim_interval_s": args.trim_interval, "variants": result})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
