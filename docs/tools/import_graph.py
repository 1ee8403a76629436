"""The import graph of recur's own code (app/ and model/), read with `ast`, never by importing it.

It guards the house in docs/ARCHITECTURE.md: arrows point one way (app/api -> app/sessions ->
app/store and app/engine -> model/), so the graph has no cycles and no arrow doubles back.

    python -m docs.tools.import_graph            # print the graph, cycles, house-rule breaches, long functions
    python -m docs.tools.import_graph --write    # redraw the Mermaid picture in docs/ARCHITECTURE.md (`make docs`)
    python -m docs.tools.import_graph --check    # exit 1 if that picture is out of date

Only imports of project modules count. Imports under `if TYPE_CHECKING:` are left out of the
graph (they never run) and counted apart; imports inside a function body count (they run on
the first call) and are drawn dotted. tests/test_architecture.py asserts the rules below.
This script reads files and writes only docs/ARCHITECTURE.md; it must never import app or model.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "model")
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
START = "<!-- import-graph:start -->"
END = "<!-- import-graph:end -->"
LONG_FUNCTION_LINES = 60

# name -> (modules the rule governs, modules they must not import); a name covers its submodules
HOUSE_RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "model/ is a library: it imports nothing from app/": (("model",), ("app",)),
    "app/engine imports only model/ and its own modules": (("app.engine",), ("app",)),
    "app/store knows only Redis": (("app.store",), ("app.engine", "app.api", "model")),
    "the transaction and tenant accounting know no HTTP": (("app.sessions", "app.tenants"), ("app.api",)),
}

# the rooms of the house, in reading order; any other app/ subpackage gets a room of its own
ROOMS = ("app/api", "app", "app/sessions", "app/store", "app/engine", "model")


@dataclass(frozen=True)
class Import:
    """One import statement's arrow from a project module to a project module."""

    source: str  # dotted module name, e.g. "app.api.http.errors"
    target: str
    path: str  # the importing file, relative to the root
    line: int
    lazy: bool  # inside a function body: runs on the first call, not at import time
    type_only: bool  # under `if TYPE_CHECKING:`: never runs


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of app/ and model/ by dotted name; a package is its __init__.py."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        if not (root / package / "__init__.py").is_file():  # a wrong root must not read as a clean house
            raise FileNotFoundError(f"no package {package}/ under {root}")
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(
    node: ast.AST, lazy: bool = False, type_only: bool = False
) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import statement under node, with whether it is lazy and whether it is type-only."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy, type_only
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _statements(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
            for stmt in child.orelse:
                yield from _statements(ast.Module(body=[stmt], type_ignores=[]), lazy, type_only)
        else:
            inside = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _statements(child, lazy or inside, type_only)


def _project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _targets(stmt: ast.stmt, module: str, is_package: bool, known: dict[str, Path]) -> Iterator[str]:
    """The dotted names of the project modules one statement imports (some may not exist)."""
    if isinstance(stmt, ast.Import):
        yield from (alias.name for alias in stmt.names if _project(alias.name))
        return
    assert isinstance(stmt, ast.ImportFrom)
    if stmt.level:  # relative: `.` is the package this module is in (or is)
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (stmt.level - 1)]
        parent = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        parent = stmt.module or ""
    if not _project(parent):
        return
    for alias in stmt.names:
        # `from pkg import name` imports the submodule pkg.name when there is one, else runs pkg
        submodule = f"{parent}.{alias.name}"
        yield submodule if submodule in known else parent


def _scan(root: Path) -> Iterator[Import]:
    known = modules(root)
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root).as_posix()
        is_package = path.name == "__init__.py"
        seen: set[tuple[int, str]] = set()
        for stmt, lazy, type_only in _statements(tree):
            for target in _targets(stmt, module, is_package, known):
                if (stmt.lineno, target) not in seen:  # `from m import a, b` is one arrow
                    seen.add((stmt.lineno, target))
                    yield Import(module, target, rel, stmt.lineno, lazy, type_only)


def collect_imports(root: Path = ROOT) -> list[Import]:
    """Every arrow between project modules, one per statement and module imported, in file order."""
    known = modules(root)
    return [i for i in _scan(root) if i.target in known]


def missing_imports(root: Path = ROOT) -> list[Import]:
    """Imports of app/ or model/ modules that do not exist (a refactor's loose ends)."""
    known = modules(root)
    return [i for i in _scan(root) if i.target not in known]


def import_graph(imports: Iterable[Import] | None = None, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (at run time: TYPE_CHECKING imports left out).
    Every module is a key, even one that imports nothing."""
    if imports is None:
        imports = collect_imports(root)
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for imp in imports:
        if not imp.type_only:
            graph[imp.source].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, and modules that import
    themselves; each sorted, and the list sorted (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))
    return sorted(found)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete loop through a cycle's first module, e.g. [a, b, a] (shortest, by BFS)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [start]
                    while node != start:
                        path.append(node)
                        node = came_from[node]
                    return [start, *reversed(path[1:]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise ValueError(f"{component} is not a cycle")


def describe_cycle(graph: dict[str, set[str]], component: list[str], imports: Iterable[Import]) -> str:
    """`a -> b -> a`, then where each arrow is made: `a.py:12 imports b (in a function)`."""
    path = cycle_path(graph, component)
    lines = [" -> ".join(path)]
    if len(component) > len(path) - 1:
        lines.append(f"    (the whole cycle: {', '.join(component)})")
    made = [i for i in imports if not i.type_only]
    for source, target in zip(path, path[1:], strict=False):
        for imp in made:
            if (imp.source, imp.target) == (source, target):
                where = " (in a function)" if imp.lazy else ""
                lines.append(f"    {imp.path}:{imp.line} imports {target}{where}")
    return "\n".join(lines)


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def forbidden_imports(
    imports: Iterable[Import], sources: Iterable[str], forbidden: Iterable[str]
) -> list[Import]:
    """The run-time imports by a module under `sources` of a module under `forbidden`
    (a module's imports of its own room, under `sources`, are always allowed)."""
    sources, forbidden = tuple(sources), tuple(forbidden)
    return [
        i
        for i in imports
        if not i.type_only
        and _within(i.source, sources)
        and _within(i.target, forbidden)
        and not _within(i.target, sources)
    ]


def describe_import(imp: Import) -> str:
    return f"{imp.path}:{imp.line} imports {imp.target}" + (" (in a function)" if imp.lazy else "")


@dataclass(frozen=True)
class LongFunction:
    path: str
    name: str  # qualified: Class.method, outer.inner
    line: int
    length: int  # def line to last line, decorators excluded

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name} is {self.length} lines"


# the folders whose functions the 60-line rule covers: the two packages and the benchmarks
LONG_FUNCTION_FOLDERS = (*PACKAGES, "bench")


def sources(root: Path, folders: Iterable[str]) -> list[Path]:
    """The Python files under `folders` of `root`."""
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py"))


def long_functions(
    limit: int = LONG_FUNCTION_LINES, root: Path = ROOT, folders: Iterable[str] = LONG_FUNCTION_FOLDERS
) -> list[LongFunction]:
    """Every function and method under `folders` longer than `limit` lines, by file and line."""
    found: list[LongFunction] = []

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if length > limit:
                        found.append(LongFunction(rel, name, child.lineno, length))
                visit(child, rel, name + ".")
            else:
                visit(child, rel, prefix)

    for path in sources(root, folders):
        visit(ast.parse(path.read_text(), filename=str(path)), path.relative_to(root).as_posix(), "")
    return sorted(found, key=lambda f: (f.path, f.line))


# ---- the picture


def room(module: str, known: Iterable[str]) -> str:
    """The room of the house a module lives in: app/api, app, app/store, app/engine, model, ..."""
    parts = module.split(".")
    if parts[0] != "app" or len(parts) == 1:
        return parts[0]
    sub = "app." + parts[1]
    is_package = any(m.startswith(sub + ".") for m in known)
    return f"app/{parts[1]}" if is_package or parts[1] in ("store", "sessions") else "app"


def label(module: str) -> str:
    """`api/native/sessions` for app.api.native.sessions, `model/hf` for model.hf, `app` for the package."""
    parts = module.split(".")
    return "/".join(parts[1:] if parts[0] == "app" and len(parts) > 1 else parts)


def _node_id(module: str) -> str:
    return module.replace(".", "_")


def mermaid(imports: Iterable[Import] | None = None, root: Path = ROOT) -> str:
    """The graph as a Mermaid flowchart: one subgraph per room, one node per module, one arrow
    per importing pair (dotted when every import of that pair is made inside a function)."""
    imports = list(collect_imports(root) if imports is None else imports)
    known = sorted(modules(root))
    rooms: dict[str, list[str]] = {}
    for module in known:
        rooms.setdefault(room(module, known), []).append(module)
    order = [r for r in ROOMS if r in rooms] + sorted(set(rooms) - set(ROOMS))
    lines = ["flowchart LR"]
    for name in order:
        lines.append(f'    subgraph room_{name.replace("/", "_")}["{name}"]')
        lines += [f'        {_node_id(m)}["{label(m)}"]' for m in rooms[name]]
        lines.append("    end")
    eager: dict[tuple[str, str], bool] = {}
    for imp in imports:
        if not imp.type_only:
            pair = (imp.source, imp.target)
            eager[pair] = eager.get(pair, False) or not imp.lazy
    for (source, target), at_import in sorted(eager.items()):
        arrow = "-->" if at_import else "-.->"
        lines.append(f"    {_node_id(source)} {arrow} {_node_id(target)}")
    return "\n".join(lines)


def section(root: Path = ROOT) -> str:
    """What belongs between the markers in docs/ARCHITECTURE.md."""
    return "\n".join(
        [
            "<!-- generated by `make docs` (docs/tools/import_graph.py) from the code: edit the code, not this -->",
            "",
            "Who imports whom in app/ and model/. A solid arrow is an import at module level; a dotted",
            "one is made only inside a function. Imports under `if TYPE_CHECKING:` are left out.",
            "",
            "```mermaid",
            mermaid(root=root),
            "```",
        ]
    )


def _split(text: str) -> tuple[str, str, str] | None:
    """(before the start marker, between the markers, from the end marker on), if both are there."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[: start + len(START)], text[start + len(START) : end], text[end:]


def is_current(path: Path = ARCHITECTURE, root: Path = ROOT) -> bool:
    """Whether the file's import-graph section is what the code gives now."""
    parts = _split(path.read_text()) if path.exists() else None
    return parts is not None and parts[1].strip("\n") == section(root)


def write(path: Path = ARCHITECTURE, root: Path = ROOT) -> None:
    """Redraw the section between the markers; create the file, or add the markers, if missing."""
    text = path.read_text() if path.exists() else f"# Architecture\n\n{START}\n{END}\n"
    parts = _split(text)
    if parts is None:
        text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
        parts = _split(text)
        assert parts is not None
    before, _, after = parts
    path.write_text(f"{before}\n{section(root)}\n{after}")


def report(root: Path = ROOT) -> str:
    imports = collect_imports(root)
    graph = import_graph(imports, root)
    type_only = sum(i.type_only for i in imports)
    out = [
        f"import graph: {len(graph)} modules, {sum(map(len, graph.values()))} arrows"
        f" ({type_only} imports under TYPE_CHECKING left out)"
    ]
    out += [f"  {m} -> {', '.join(sorted(graph[m])) or '(nothing)'}" for m in sorted(graph)]
    found = cycles(graph)
    out.append(f"\ncycles: {len(found) or 'none'}")
    out += ["  " + describe_cycle(graph, c, imports).replace("\n", "\n  ") for c in found]
    missing = missing_imports(root)
    if missing:
        out.append(f"\nimports of modules that do not exist: {len(missing)}")
        out += [f"  {describe_import(i)}" for i in missing]
    out.append("\nhouse rules:")
    for rule, (sources, forbidden) in HOUSE_RULES.items():
        breaches = forbidden_imports(imports, sources, forbidden)
        out.append(f"  {rule}: {'ok' if not breaches else f'{len(breaches)} breach(es)'}")
        out += [f"    {describe_import(i)}" for i in breaches]
    long = long_functions(root=root)
    out.append(f"\nfunctions over {LONG_FUNCTION_LINES} lines: {len(long) or 'none'}")
    out += [f"  {f}" for f in long]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"redraw the graph in {ARCHITECTURE.name}")
    group.add_argument("--check", action="store_true", help=f"exit 1 if {ARCHITECTURE.name} is out of date")
    args = parser.parse_args(argv)
    if args.write:
        write()
        print(f"wrote the import graph into {ARCHITECTURE.relative_to(ROOT)}")
    elif args.check:
        if not is_current():
            print(f"{ARCHITECTURE.relative_to(ROOT)}: the import graph is out of date; run `make docs`")
            return 1
        print(f"{ARCHITECTURE.relative_to(ROOT)}: the import graph is up to date")
    else:
        print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
