"""docs/BENCHMARKS.md's own sections: a script that measures something `bench/report.py`
does not puts its section in place of the one there (else at the end), so `make bench`
can run the scripts one after another and each keeps its part of the page."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def write(title: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replace the section headed `title` (a "## " line, up to the next one) with `text`."""
    page = path.read_text()
    start = page.find(title)
    if start < 0:
        page = page.rstrip("\n") + "\n\n" + text
    else:
        nxt = page.find("\n## ", start + len(title))
        page = page[:start] + text + ("" if nxt < 0 else "\n" + page[nxt + 1 :])
    path.write_text(page)
    print(f"wrote the section {title!r} of {path}")
