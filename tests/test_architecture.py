"""The house in docs/ARCHITECTURE.md, asserted: imports point one way (app/api -> app/sessions ->
app/store and app/engine -> model/), rooms keep to themselves, functions stay short, classes and files stay narrow, and the
picture in docs/ARCHITECTURE.md matches the code. The reading is docs/tools/import_graph.py's (ast only:
nothing here imports app or model)."""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

from docs.tools import import_graph as ig

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def imports() -> list:  # a function, not a fixture: pytest would print the whole list on failure
    return ig.collect_imports(ROOT)


def test_no_import_cycles() -> None:
    graph = ig.import_graph(imports(), ROOT)
    found = [ig.describe_cycle(graph, c, imports()) for c in ig.cycles(graph)]
    assert not found, (
        "import cycles in app/ and model/ (break each one; an import moved into a "
        "function still counts):\n" + "\n".join(found)
    )


def _assert_no_imports(sources: tuple[str, ...], forbidden: tuple[str, ...], why: str) -> None:
    breaches = ig.forbidden_imports(imports(), sources, forbidden)
    assert not breaches, f"{why}; yet:\n" + "\n".join("  " + ig.describe_import(i) for i in breaches)


def test_model_imports_nothing_from_app() -> None:
    _assert_no_imports(("model",), ("app",), "model/ is a library and imports nothing from app/")


def test_engine_imports_only_model_and_itself() -> None:
    _assert_no_imports(
        ("app.engine",),
        ("app",),
        "app/engine imports only model/ and its own modules (a request carries its state in, "
        "the committed state comes out): nothing else of app/, not even app.config or app.metrics",
    )


def test_store_imports_no_engine_api_or_model() -> None:
    _assert_no_imports(
        ("app.store",),
        ("app.engine", "app.api", "model"),
        "app/store knows the Redis key schema and scripts, nothing else: never app.engine, app.api or model",
    )


def test_only_the_tenants_room_opens_the_tenant_store() -> None:
    """`Tenants` (app/tenants.py) is the only door to the tenants' keys in Redis: no other
    room imports app/store/tenants.py (the assembly hands the store to Tenants)."""
    breaches = [
        i
        for i in imports()
        if i.target == "app.store.tenants"
        and not (i.source.startswith("app.store") or i.source == "app.tenants")
    ]
    assert not breaches, "outside app/tenants.py:\n" + "\n".join(
        "  " + ig.describe_import(i) for i in breaches
    )
    # nor reaches through it for the store it holds (which would skip its metrics)
    reaches = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "app").rglob("*.py"))
        if path != ROOT / "app" / "tenants.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "tenants.store." in line
    ]
    assert not reaches, "reaching through Tenants to its store:\n  " + "\n  ".join(reaches)


def test_house_rules_are_the_ones_asserted() -> None:
    # the script prints HOUSE_RULES; keep its list and the tests above telling the same story
    assert set(ig.HOUSE_RULES.values()) == {
        (("model",), ("app",)),
        (("app.engine",), ("app",)),
        (("app.store",), ("app.engine", "app.api", "model")),
        (("app.sessions", "app.tenants"), ("app.api",)),
    }


def test_sessions_and_tenants_know_no_http() -> None:
    _assert_no_imports(
        ("app.sessions", "app.tenants"),
        ("app.api",),
        "app/sessions and app/tenants run the transaction and its accounting: never app.api (HTTP)",
    )


def test_no_long_functions() -> None:
    long = ig.long_functions(60, ROOT)
    assert not long, (
        "functions over 60 lines (def line to last line) in app/, model/ and bench/; split them:\n"
        + "\n".join(f"  {f}" for f in long)
    )


def test_no_wide_classes_or_long_files() -> None:
    """Width, as the 60-line rule bounds length: no class in app/ or model/ over 300 lines
    (split its concerns into rooms), and no file in app/ over 700."""
    wide = [
        f"  {path.relative_to(ROOT)}: class {node.name}, {node.end_lineno - node.lineno + 1} lines"
        for path in ig.sources(ROOT, ("app", "model"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno + 1 > 300
    ]
    long = [
        f"  {path.relative_to(ROOT)}: {n} lines"
        for path in ig.sources(ROOT, ("app",))
        if (n := len(path.read_text().splitlines())) > 700
    ]
    assert not wide and not long, "classes over 300 lines, files over 700; split them:\n" + "\n".join(
        wide + long
    )


def test_architecture_picture_is_current() -> None:
    assert ig.is_current(ROOT / "docs" / "ARCHITECTURE.md", ROOT), (
        "docs/ARCHITECTURE.md's import graph (between the import-graph markers) no longer matches "
        "the code: run `make docs` and commit the result"
    )


def test_reader_resolves_the_project_import_forms(tmp_path: Path) -> None:
    """The script's own check, on a made-up tree: absolute, relative and package imports,
    TYPE_CHECKING imports left out, lazy imports kept, third-party ones ignored."""
    files = {
        "app/__init__.py": "",
        "app/metrics.py": "",
        "app/api/__init__.py": "from . import errors\nfrom .errors import Boom\n",
        "app/api/errors.py": """
            from typing import TYPE_CHECKING
            import torch
            from app import metrics
            from app.engine import Engine
            if TYPE_CHECKING:
                from .schemas import Body
            def late():
                from . import schemas
        """,
        "app/api/schemas.py": "import model\nfrom ..engine.run import go\n",
        "app/engine/__init__.py": "from .run import Engine\n",
        "app/engine/run.py": """
            import model.sampling
            class Engine:
                @staticmethod
                @property
                def step():
                    a = 1
                    return a
        """,
        "model/__init__.py": "",
        "model/sampling.py": "from .missing import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    found = ig.collect_imports(tmp_path)
    graph = ig.import_graph(found, tmp_path)
    assert graph == {
        "app": set(),
        "app.metrics": set(),
        "app.api": {"app.api.errors"},
        "app.api.errors": {"app.metrics", "app.engine", "app.api.schemas"},
        "app.api.schemas": {"model", "app.engine.run"},
        "app.engine": {"app.engine.run"},
        "app.engine.run": {"model.sampling"},
        "model": set(),
        "model.sampling": set(),
    }
    assert [(i.target, i.type_only) for i in found if i.type_only] == [("app.api.schemas", True)]
    assert [i.target for i in found if i.lazy] == ["app.api.schemas"]
    assert [i.target for i in ig.missing_imports(tmp_path)] == ["model.missing"]
    assert ig.cycles(graph) == []
    assert ig.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": set()}) == [["a", "b", "c"], ["d"]]
    assert ig.cycle_path({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    long = ig.long_functions(2, tmp_path)
    assert [(f.path, f.name, f.length) for f in long] == [("app/engine/run.py", "Engine.step", 3)]
