"""`make bench` keeps running on the code it compares against.

bench/report.py measures shipped `shakespeare-rlt` on commit ad05664's model/ (the code before
issue 14) side by side with today's, by running today's bench/roofline.py with that tree on
PYTHONPATH. A change to model/'s API that the script follows must leave that older tree
measurable: once it did not (`from model import IN_PLACE`), and `make bench` stopped there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

MEASURE_BASELINE = """
import json, report, roofline
print("RESULT " + json.dumps(report.baseline(roofline.RLT_BASELINE["commit"])))
"""


@pytest.mark.slow
def test_the_bench_measures_its_baseline_tree_with_todays_scripts() -> None:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE_BASELINE], cwd=BENCH, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1].removeprefix("RESULT "))
    if result is None:
        pytest.skip("git cannot give the baseline commit here (a shallow clone?)")
    assert result["commit"] == "ad05664"
    assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0
