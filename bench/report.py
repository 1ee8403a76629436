"""`make bench`: run every benchmark side by side and write docs/BENCHMARKS.md with plots.

Each benchmark is its own script (model_step.py, roofline.py, serving.py, persistence.py)
that ends by printing `RESULT {json}`; this script runs them one after another on this
machine, then writes the page (bench/page.py: the figures, the targets, and by how much and
why a target is missed; bench/plots.py: its plots). The sections other benchmarks put into
the page (`write_section` in bench/harness.py: prefix reuse, the background compile, ...)
are kept as they are.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import page
from harness import model_at, run
from plots import PLOTS

BENCH = Path(__file__).resolve().parent
DOCS = BENCH.parent / "docs"


def baseline(commit: str) -> dict | None:
    """`shakespeare-rlt` on `commit`'s model/ (the code before issue 14), measured in this run
    next to today's: its batch-1 decode and 2k prefill rows, or None where git cannot give
    that tree."""
    with model_at(commit) as tree:
        if tree is None:
            return None
        result = run(
            "roofline.py",
            "--only",
            "shakespeare-rlt",
            "--batches",
            "1",
            "--eager",
            env={"PYTHONPATH": str(tree)},
        )
    return {
        "commit": commit,
        "decode_tokens_per_s": result["decode"][0]["tokens_per_s"],
        "prefill_tokens_per_s": result["prefill"][0]["tokens_per_s"],
    }


def kept_sections(text: str, written: str) -> str:
    """The `## ` sections of `text` (the page as it was) that `written` (report.py's part)
    does not have: those other benchmarks wrote."""
    own = {line for line in written.splitlines() if line.startswith("## ")}
    parts = text.split("\n## ")[1:]
    return "".join("\n## " + p for p in parts if "## " + p.splitlines()[0] not in own)


def write(results: page.Results) -> None:
    path = DOCS / "BENCHMARKS.md"
    written = page.page(results)
    old = path.read_text() if path.exists() else ""
    path.write_text(written.rstrip("\n") + "\n" + kept_sections(old, written))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="shakespeare")
    ap.add_argument(
        "--rewrite", action="store_true", help="rewrite the document from the last run's results.json"
    )
    args = ap.parse_args()
    PLOTS.mkdir(parents=True, exist_ok=True)
    if args.rewrite:
        last = json.loads((PLOTS / "results.json").read_text())
        write(
            page.Results(
                last["model_step"],
                last["roofline"],
                last["serving"],
                last["persistence"],
                last.get("minutes"),
            )
        )
        return
    t0 = time.perf_counter()
    step = run("model_step.py", "--threads", "1")
    roof = run("roofline.py")
    roof["rlt_baseline_here"] = baseline(roof["rlt_baseline"]["commit"])
    serving = run("serving.py", "--model", args.model)
    persist = run("persistence.py", "--model", args.model)
    minutes = (time.perf_counter() - t0) / 60
    results = {
        "model_step": step,
        "roofline": roof,
        "serving": serving,
        "persistence": persist,
        "minutes": minutes,
    }
    (PLOTS / "results.json").write_text(json.dumps(results, indent=1))
    write(page.Results(step, roof, serving, persist, minutes))


if __name__ == "__main__":
    main()
