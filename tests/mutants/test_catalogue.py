"""The planted faults' catalogue cannot rot between fault runs (`make test-faults` is not part
of `make test`): every fault still plants (its old line occurs exactly once), every test it
names exists, and docs/TESTING.md lists them as the catalogue does. Cheap: no fault is run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mutants import run
from tests.mutants.catalogue import FAULTS


def test_there_are_enough_faults_each_named_once():
    names = [f.name for f in FAULTS]
    assert len(names) >= 20
    assert len(set(names)) == len(names)


def test_every_fault_plants_exactly_once():
    assert {f.name: run.check(f, run.ROOT) for f in FAULTS} == {f.name: None for f in FAULTS}


def test_every_fault_changes_its_line():
    assert [f.name for f in FAULTS if f.old == f.new] == []


def _missing(ids: list[str], collected: set[str]) -> list[str]:
    # a node id that names a test function (not one parametrization) collects as its cases
    return [i for i in ids if i not in collected and not any(c.startswith(i + "[") for c in collected)]


def test_every_named_test_exists(request: pytest.FixtureRequest):
    """Looked up first in this run's own collection (make test collects the whole suite in
    each worker); what it lacks (a slow test, or a run of this file alone) is collected in a
    subprocess, which imports the suite again (10 s of CPU)."""
    ids = sorted({t for f in FAULTS for t in f.tests})
    rest = _missing(ids, {item.nodeid for item in request.session.items})
    if not rest:
        return
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         "-n", "0", *rest],
        cwd=run.ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _missing(rest, set(out.stdout.split())) == []


def test_the_doc_lists_every_fault_and_its_tests():
    doc = run.DOC.read_text()
    assert run.with_table(doc) == doc, "docs/TESTING.md is stale: python tests/mutants/run.py --write-doc"
