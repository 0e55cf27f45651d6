"""The project's own imports: no cycle anywhere, the packages' layering, and every module
importable on its own.

The graph is built statically with `ast` from every module of every package of the project
(a top-level directory with an `__init__.py`, tests aside): each `import x` and
`from x import y` anywhere in a module, in functions too (an import that runs later still
closes a cycle) and inside `if TYPE_CHECKING:` too (a cycle of types is a cycle of the
design, even when no import runs it: the shared piece belongs in one of the modules).
Imports by string (`importlib.import_module`, engine/__init__.py's lazy names) are not
seen. An import's edges:

* `from pkg import name` goes to the submodule `pkg.name` when that is a module, else to
  `pkg` (whose namespace it reads); `import a.b.c` goes to `a.b.c`.
* Importing `a.b.c` first runs the `__init__` of `a` and of `a.b`, so the importer also
  depends on each of those packages, except one it lies inside: a submodule's own packages
  are already being imported before it runs, and it needs nothing from them. That is the
  one kind of edge left out. So a package `__init__` that re-exports its submodules makes
  no cycle with them (`engine.models.llama` has no edge to `engine.models`), while a module
  outside the package that imports one of its submodules depends on the `__init__` and on
  everything it re-exports (`engine.config` -> `engine.models` -> `engine.models.llama`);
  an `__init__`'s own edges to its submodules are kept: they run. An explicit
  `from pkg import name` of a non-module name inside `pkg` stays an edge to `pkg`: it reads
  the half-run `__init__`'s namespace.

A cycle is reported as its path, e.g. "engine.a -> engine.b -> engine.a".

"Importable on its own" is checked in a fresh process per module, each forked from one
that has imported the third-party and standard-library modules the project imports (torch
once, not once a module) but no module of the project, which it checks before forking.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every package of the project: a new one is covered without a line here.
PACKAGES = tuple(
    sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")
)


def module_files() -> dict[str, Path]:
    """Every module of PACKAGES by dotted name (a package by its `__init__.py`)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


Statement = ast.Import | ast.ImportFrom


def _imports(node: ast.AST, at_import: bool = True) -> Iterator[tuple[Statement, bool]]:
    """Every import statement under `node`, at any depth, and whether it runs when the
    module is imported (it is in no function and not under `if TYPE_CHECKING:`)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _imports_in(stmt, False)
            for stmt in child.orelse:
                yield from _imports_in(stmt, at_import)
            continue
        yield from _imports_in(child, at_import)


def _imports_in(node: ast.AST, at_import: bool) -> Iterator[tuple[Statement, bool]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, at_import
    function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
    yield from _imports(node, at_import and not function)


@cache
def _statements() -> dict[str, list[tuple[Statement, bool]]]:
    return {
        module: list(_imports(ast.parse(path.read_text(encoding="utf-8"), str(path))))
        for module, path in module_files().items()
    }


def _absolute(module: str, is_package: bool, stmt: ast.ImportFrom) -> str:
    if not stmt.level:
        return stmt.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (stmt.level - 1)]
    return ".".join([*base, *([stmt.module] if stmt.module else [])])


@cache
def import_graph(at_import_only: bool = False) -> dict[str, frozenset[str]]:
    """Each module's direct imports among the modules of PACKAGES (see the docstring); with
    `at_import_only`, those that run when it is imported."""
    files = module_files()
    graph: dict[str, frozenset[str]] = {}
    for module, statements in _statements().items():
        is_package = files[module].name == "__init__.py"
        targets: set[str] = set()
        for stmt, at_import in statements:
            if at_import_only and not at_import:
                continue
            if isinstance(stmt, ast.Import):
                named = [alias.name for alias in stmt.names]
            else:
                base = _absolute(module, is_package, stmt)
                named = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in stmt.names
                ]
            for name in named:
                parts = name.split(".")
                # `import a.b.c`: the longest prefix that is one of ours (a name that is not
                # a module can only be reached through `from`, handled above).
                while parts and ".".join(parts) not in files:
                    parts.pop()
                if not parts:
                    continue  # not one of ours
                targets.add(".".join(parts))
                for i in range(1, len(parts)):
                    package = ".".join(parts[:i])
                    if package in files and not (
                        module == package or module.startswith(package + ".")
                    ):
                        targets.add(package)
        targets.discard(module)
        graph[module] = frozenset(targets)
    return graph


def simple_cycles(graph: dict[str, list[str]], limit: int = 200) -> list[tuple[str, ...]]:
    """The elementary cycles of `graph`, each starting at its smallest module (at most
    `limit` of them: enough to report)."""
    cycles: list[tuple[str, ...]] = []
    for start in sorted(graph):
        # Only cycles whose smallest node is `start` (each is found once), so only through
        # the nodes after it that `start` reaches and that reach `start`: in an acyclic
        # graph, none (a search of every path would take exponential time there).
        later = {n: [m for m in graph[n] if m >= start] for n in graph if n >= start}
        back = {n: [m for m in later if n in later[m]] for n in later}
        inside = _reached(start, later) & _reached(start, back)
        successors_of = {n: [m for m in later[n] if m in inside] for n in inside}
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(successors_of[start]))]
        path = [start]
        on_path = {start}
        while stack:
            node, successors = stack[-1]
            for nxt in successors:
                if nxt == start:
                    cycles.append(tuple(path))
                    if len(cycles) >= limit:
                        return cycles
                elif nxt not in on_path:
                    stack.append((nxt, iter(successors_of[nxt])))
                    path.append(nxt)
                    on_path.add(nxt)
                    break
            else:
                stack.pop()
                on_path.discard(path.pop())
    return cycles


def _reached(start: str, graph: dict[str, list[str]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _shown(cycle: tuple[str, ...]) -> str:
    return " -> ".join([*cycle, cycle[0]])


# ------------------------------------------------------------------------------ cycles


def test_no_import_cycle() -> None:
    graph = {module: sorted(targets) for module, targets in import_graph().items()}
    cycles = simple_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(map(_shown, cycles))


def test_every_package_is_in_the_graph() -> None:
    # The packages the layering below names, and the server's, are found by the glob.
    assert {"engine", "scheduler", "kv_cache", "server", "bench"} <= set(PACKAGES)


def test_the_cycle_search_finds_cycles() -> None:
    graph = {"a": ["b"], "b": ["c", "a"], "c": ["a"], "d": ["d"], "e": ["a"]}
    assert sorted(map(_shown, simple_cycles(graph))) == [
        "a -> b -> a",
        "a -> b -> c -> a",
        "d -> d",
    ]


# ---------------------------------------------------------------------------- layering

# Each package and the packages it must never import, in any module or function. kv_cache
# is the bottom, then scheduler, then engine; server and bench sit on top. (That kv_cache
# and scheduler also stay free of torch at run time is tests/test_imports_torch_free.py.)
FORBIDDEN = {
    "engine": ("server", "bench"),
    "scheduler": ("engine", "server", "bench"),
    "kv_cache": ("scheduler", "engine", "server", "bench"),
}


def test_layering() -> None:
    wrong = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if target.split(".")[0] in FORBIDDEN.get(module.split(".")[0], ())
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


# -------------------------------------------------------------------- each module alone

# Modules not imported, and why (the test checks each still exists).
NOT_IMPORTED = {
    "engine.kernels.__main__": "a script (python -m engine.kernels): importing it builds",
}

# Imports each module named on the command line in a fresh process of its own, forked from
# this one once it has imported every third-party and standard-library module that the
# project's modules import at module level (the statements arrive on stdin), and before it
# has imported any module of the project: so each child starts as a fresh interpreter
# would, as far as the project's modules go, without paying for torch each time.
IMPORT_ALONE = r"""
import importlib, json, os, sys, tempfile, traceback

given = json.load(sys.stdin)
for statement in given["preload"]:
    try:
        exec(statement, {})
    except BaseException:
        pass  # the module that needs it fails in its child and says why
ours = set(given["packages"])
early = sorted(m for m in sys.modules if m.split(".")[0] in ours)
if early:
    sys.exit(f"the project's modules were imported before the fork: {early}")
out = tempfile.TemporaryDirectory()
running, failed = {}, {}
todo = list(enumerate(given["modules"]))
while todo or running:
    while todo and len(running) < given["jobs"]:
        index, module = todo.pop(0)
        path = os.path.join(out.name, str(index))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                importlib.import_module(module)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        running[pid] = (module, path)
    pid, status = os.wait()
    module, path = running.pop(pid)
    if status:
        with open(path, errors="replace") as f:
            failed[module] = f"exit code {os.waitstatus_to_exitcode(status)}:\n" + f.read()[-3000:]
out.cleanup()
print(json.dumps(failed))
"""


def _preload(modules: list[str]) -> list[str]:
    """The statements by which `modules`, and the project's modules they import when
    imported, import other code than the project's (the standard library's, torch, ...)."""
    graph = import_graph(at_import_only=True)
    seen, todo = set(modules), list(modules)
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    # Every package of a module runs too (engine/__init__.py for engine.config).
    seen |= {".".join(m.split(".")[:i]) for m in seen for i in range(1, m.count(".") + 1)}
    statements: set[str] = set()
    for module in seen & set(graph):
        for stmt, at_import in _statements()[module]:
            if not at_import:
                continue
            if isinstance(stmt, ast.ImportFrom):
                names = [] if stmt.level else [stmt.module or ""]
            else:
                names = [alias.name for alias in stmt.names]
            top = {name.split(".")[0] for name in names}
            if top and not top & {*PACKAGES, "__future__", "tests"}:
                statements.add(ast.unparse(stmt))
    return sorted(statements)


def test_each_module_imports_alone() -> None:
    files = module_files()
    for module in NOT_IMPORTED:
        assert module in files, f"{module} is gone: remove it from NOT_IMPORTED"
    modules = [m for m in files if m not in NOT_IMPORTED]
    given = {
        "preload": _preload(modules),
        "packages": [*PACKAGES, "tests"],
        "modules": modules,
        "jobs": max(2, os.cpu_count() or 1),
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALONE],
        input=json.dumps(given),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "modules that fail to import on their own:\n" + "\n".join(
        f"--- {module}: {why}" for module, why in failed.items()
    )
