"""Every relative link in the docs lands inside the repository.

README.md, CONTRIBUTING.md and docs/*.md link to each other and to source files by relative
path, often to a heading (`BENCHMARKS.md#8-prefix-reuse`). A renamed heading or a moved file
breaks such a link silently: GitHub renders it, and the reader lands nowhere. This reads every
markdown link and checks that its file exists in the checkout and that its `#anchor` is a
heading of that file, slugged as GitHub slugs it. External (http, https, mailto) links are not
followed.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:
UPWARD = re.compile(r"(?<![.\w/])((?:\.\./)+[\w.-]+(?:/[\w.-]+)*)")  # `../x/y` in prose or code


def _prose(text: str) -> str:
    """The text with fenced blocks and code spans blanked: a link inside code is an example."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code marks and link targets gone),
    lower-cased, punctuation other than `-` and `_` dropped, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    kept = "".join(
        c
        for c in text
        if c in " -_" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"
    )
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a file's headings (and any `<a name=...>`) give, with GitHub's -1, -2 for
    repeats."""
    text = path.read_text()
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    prose = _prose(path.read_text())
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def upward(text: str) -> list[str]:
    """The paths that climb out of a doc's folder (`../x`), in prose or code (a sentence's
    full stop left off)."""
    return [p.rstrip(".") for p in UPWARD.findall(text)]


def broken(doc: Path) -> list[str]:
    out = []
    for target in links(doc):
        if EXTERNAL.match(target):
            continue
        name, _, anchor = target.partition("#")
        file = (doc.parent / unquote(name)).resolve() if name else doc
        where = f"{doc.relative_to(ROOT)}: ({target})"
        if not file.is_relative_to(ROOT):
            out.append(f"{where} points outside the repository")
        elif not file.exists():
            out.append(f"{where}: no such file")
        elif anchor and file.suffix == ".md" and unquote(anchor).lower() not in anchors(file):
            out.append(f"{where}: no heading #{anchor} in {file.relative_to(ROOT)}")
    for path in upward(doc.read_text()):
        if not (doc.parent / path).resolve().is_relative_to(ROOT) or not (doc.parent / path).exists():
            out.append(f"{doc.relative_to(ROOT)}: `{path}` names a path outside the repository")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands_in_the_repository(doc: Path) -> None:
    found = broken(doc)
    assert not found, "links to nothing (a moved file or a renamed heading):\n  " + "\n  ".join(found)


def test_the_checker_sees_what_github_renders(tmp_path: Path) -> None:
    """Its own check: slugs as GitHub makes them, repeats numbered, code and externals skipped."""
    assert slug("8. Prefix reuse") == "8-prefix-reuse"
    assert slug("`recur serve` — flags & settings") == "recur-serve--flags--settings"
    assert slug("Against [HF](https://huggingface.co) TransfoXL 4.37.2") == "against-hf-transfoxl-4372"
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n## Top\n\n```\n# not a heading\n[x](gone.md)\n```\n"
        "[a](#top-1) [b](page.md#top) `[c](gone.md)` [d](https://example.com/x) [e](#nowhere) [f](gone.md)\n"
    )
    assert anchors(page) == {"top", "top-1"}
    assert links(page) == ["#top-1", "page.md#top", "https://example.com/x", "#nowhere", "gone.md"]
    assert upward("run `../shared/tools/x`; `POST .../items`, see ../docs/A.md.") == [
        "../shared/tools/x",
        "../docs/A.md",
    ]
