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
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import page
from plots import PLOTS

BENCH = Path(__file__).resolve().parent
DOCS = BENCH.parent / "docs"


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


def baseline(commit: str) -> dict | None:
    """`shakespeare-rlt` on `commit`'s model/ (the code before issue 14), measured in this run
    next to today's: its batch-1 decode and 2k prefill rows, or None where git cannot give
    that tree."""
    tree = Path(tempfile.mkdtemp(prefix="recur-baseline-"))
    archive = subprocess.run(
        ["git", "archive", commit, "model"], cwd=BENCH.parent, capture_output=True, check=False
    )
    if archive.returncode != 0:
        print(f"no baseline: git archive {commit} failed", flush=True)
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    result = run(
        "roofline.py", "--only", "shakespeare-rlt", "--batches", "1", "--eager", env={"PYTHONPATH": str(tree)}
    )
    shutil.rmtree(tree, ignore_errors=True)
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
