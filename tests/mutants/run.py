"""Plant each fault of the catalogue in a copy of the tree and run the tests that must catch it.

    python tests/mutants/run.py [--list] [--only NAME ...] [-j N] [--timeout S] [--baseline]
    python tests/mutants/run.py --write-doc   # the table in docs/TESTING.md, from the catalogue

For each fault: a copy of the working tree (the files git tracks, and the untracked ones it
does not ignore; hard links to one pristine copy made at the start, so a copy costs no disk),
the fault's one line changed in it, then `pytest -x -q -n 0 -p no:randomly TESTS` run in the
copy with the copy first on PYTHONPATH and the interpreter this runs under (the checkout's .venv:
the copy has none). The copy's code is what runs, the servers the tests start included
(tests/conftest.py puts its own root on their PYTHONPATH); the run checks it first (below).

A fault is KILLED when pytest reports a failing test (exit 1) or cannot even collect one
(exit 2: the fault broke an import), or its tests ran past `--timeout` (a hang is caught);
SURVIVED when every test passed (exit 0). Any other exit (no such test, a usage error) is
an ERROR: the catalogue is wrong. The run exits 1 if a fault survived or errored, or if a
fault's `old` does not occur exactly once in its file; 0 otherwise.

`--baseline` first runs every named test on the unplanted copy: a test that fails there
would kill every fault it is named for without catching anything.

stdlib only: it runs before, and apart from, the suite it drives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.mutants.catalogue import FAULTS, Fault  # noqa: E402

PYTHON = Path(sys.executable)  # the checkout's .venv, as `make test-faults` runs it: the copy has none
DOC = ROOT / "docs" / "TESTING.md"
BEGIN, END = "<!-- faults table: tests/mutants/run.py --write-doc -->", "<!-- end of the faults table -->"
LEFT_OUT = (".venv",)  # the virtual environments (.venv, .venv-ref, .venv-ref-current) stay here


@dataclass
class Outcome:
    fault: Fault
    verdict: str  # KILLED, SURVIVED, ERROR
    seconds: float
    detail: str  # the tail of pytest's output


def tree_files(root: Path) -> list[str]:
    """The working tree's files as git sees them: tracked and untracked-not-ignored (and
    present: a tracked file deleted in the tree is left out), the virtual environments aside."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode()  # fmt: skip
    names = sorted({n for n in out.split("\0") if n})
    return [n for n in names if not n.startswith(LEFT_OUT) and (root / n).is_file()]


def pristine_copy(root: Path, dest: Path) -> None:
    for name in tree_files(root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)


def linked_copy(pristine: Path, dest: Path) -> None:
    """A copy of `pristine` whose files are hard links (`plant` replaces the one it changes)."""
    shutil.copytree(pristine, dest, copy_function=os.link)


def occurrences(fault: Fault, root: Path) -> int:
    return (root / fault.file).read_text().count(fault.old)


def check(fault: Fault, root: Path) -> str | None:
    """Why `fault` cannot be planted in the tree at `root`, or None."""
    for text in (fault.old, fault.new):
        if "\n" in text.rstrip("\n") or text.count("\n") > 1:
            return "old and new must each be (part of) one line"
    if not (root / fault.file).is_file():
        return f"{fault.file} does not exist"
    n = occurrences(fault, root)
    if n != 1:
        return f"its old line occurs {n} times in {fault.file}, not once"
    if not fault.tests:
        return "it names no test"
    return None


def plant(fault: Fault, copy: Path) -> None:
    path = copy / fault.file
    text = path.read_text()
    path.unlink()  # a hard link to the pristine copy: write a file of its own
    path.write_text(text.replace(fault.old, fault.new, 1))


def pytest_env(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECUR_", "PYTEST_"))}
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """pytest's exit status on `tests` in `copy` (None: it ran past `timeout`) and its output's tail."""
    cmd = [str(PYTHON), "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider",
           "--rootdir", str(copy), *tests]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=copy, env=pytest_env(copy), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the servers it started with it
            proc.wait()
            code = None
        log.seek(0)
        return code, log.read().decode(errors="replace")[-3000:]


def imports_from(copy: Path) -> str | None:
    """Where the interpreter, run as the faults' tests are, imports `app` and `model` from;
    None if from the copy (as it must: the checkout's editable install must not win)."""
    probe = "import app, model; print(app.__file__); print(model.__file__)"
    out = subprocess.run([str(PYTHON), "-c", probe], cwd=copy, env=pytest_env(copy),
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    wrong = [p for p in out if not Path(p).resolve().is_relative_to(copy.resolve())]
    return ", ".join(wrong) or None


def judge(fault: Fault, pristine: Path, work: Path, timeout: float) -> Outcome:
    t0 = time.monotonic()
    copy = work / fault.name
    linked_copy(pristine, copy)
    try:
        plant(fault, copy)
        code, tail = run_tests(copy, fault.tests, timeout)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    verdict = {None: "KILLED", 1: "KILLED", 2: "KILLED", 0: "SURVIVED"}.get(code, "ERROR")
    detail = f"timed out after {timeout:.0f} s" if code is None else f"pytest exit {code}"
    return Outcome(fault, verdict, time.monotonic() - t0, detail + "\n" + tail)


def baseline(pristine: Path, faults: list[Fault], timeout: float) -> bool:
    tests = tuple(dict.fromkeys(t for f in faults for t in f.tests))
    print(f"baseline: {len(tests)} tests on the unplanted tree", flush=True)
    code, tail = run_tests(pristine, tests, timeout * 4)
    if code != 0:
        print(f"baseline FAILED (pytest exit {code}): a named test fails without any fault\n{tail}")
    return code == 0


def table() -> str:
    """The catalogue as docs/TESTING.md shows it: a row per fault, with the tests that catch it."""
    rows = ["| fault | what it plants | where | the tests that must catch it |", "|---|---|---|---|"]
    for f in FAULTS:
        tests = "<br>".join(f"`{t}`" for t in f.tests)
        rows.append(f"| `{f.name}` | {f.what} | `{f.file}` | {tests} |")
    return "\n".join(rows)


def with_table(doc: str) -> str:
    """`doc` with the text between its table markers replaced by `table()`."""
    head, sep, rest = doc.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{DOC} lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the faults and their tests, run nothing")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run this fault (repeatable)")
    ap.add_argument("-j", type=int, default=2, metavar="N", help="faults run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per fault (default 300)")
    ap.add_argument("--baseline", action="store_true", help="first run the named tests unplanted")
    ap.add_argument(
        "--write-doc", action="store_true", help="rewrite the table in docs/TESTING.md, run nothing"
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output for every fault")
    args = ap.parse_args(argv)

    unknown = set(args.only) - {f.name for f in FAULTS}
    if unknown:
        ap.error(f"no such fault: {', '.join(sorted(unknown))}")
    faults = [f for f in FAULTS if not args.only or f.name in args.only]
    if args.write_doc:
        DOC.write_text(with_table(DOC.read_text()))
        return 0
    if args.list:
        for f in faults:
            print(f"{f.name}: {f.what}\n  {f.file}\n  " + "\n  ".join(f.tests))
        return 0
    broken = [(f, why) for f in faults if (why := check(f, ROOT))]
    for f, why in broken:
        print(f"CANNOT PLANT {f.name}: {why}")
    if broken:
        return 1

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="recur-faults-") as tmp:
        pristine, work = Path(tmp) / "tree", Path(tmp) / "planted"
        pristine_copy(ROOT, pristine)
        work.mkdir()
        wrong = imports_from(pristine)
        if wrong:
            print(f"the copy's tests would import the checkout's code ({wrong}), not the copy's")
            return 1
        if args.baseline and not baseline(pristine, faults, args.timeout):
            return 1
        print(f"{len(faults)} faults, {args.j} at a time", flush=True)
        outcomes = []
        with ThreadPoolExecutor(max(1, args.j)) as pool:
            for o in pool.map(lambda f: judge(f, pristine, work, args.timeout), faults):
                print(f"{o.verdict:8} {o.seconds:6.1f} s  {o.fault.name}", flush=True)
                if args.verbose or o.verdict != "KILLED":
                    print("    " + o.detail.strip().replace("\n", "\n    "))
                outcomes.append(o)
    bad = [o for o in outcomes if o.verdict != "KILLED"]
    total = time.monotonic() - start
    print(f"== {len(outcomes) - len(bad)} of {len(outcomes)} faults killed in {int(total // 60)} min "
          f"{int(total % 60)} s; " + (f"NOT KILLED: {', '.join(o.fault.name for o in bad)}" if bad else "none survived"))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
