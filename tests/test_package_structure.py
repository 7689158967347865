"""The package's module graph and what it ships.

No import cycles among the package's modules (one engine, layered), nor among the repository's modules (the package,
the benchmarks, the tests), counting the imports inside functions; the runtime never imports the repository's tooling
(``benchmarks``, ``tests``), and the wheel holds the runtime alone. Imports under ``if TYPE_CHECKING:`` count too: a
cycle there is still two modules that need each other's names.
"""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchmetrics_varlen"
REPOSITORY = ("torchmetrics_varlen", "benchmarks", "tests")  # the top-level packages of the repository's Python
TOOLING = ("benchmarks", "tests")  # in the repository, not in the wheel: the runtime never imports them


def _statements(body):
    """The module's top-level statements, and those inside its top-level ``if`` / ``try`` blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse, *([h.body for h in node.handlers] if isinstance(node, ast.Try) else [])]
            for block in blocks:
                yield from _statements(block)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules (dotted, relative to the package) a file imports at its top level, ``TYPE_CHECKING`` too."""
    found = set()
    for node in _statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchmetrics_varlen"):
            base = node.module.removeprefix("torchmetrics_varlen").removeprefix(".")
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if name in modules else base)
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.removeprefix("torchmetrics_varlen.")
                for alias in node.names
                if alias.name.startswith("torchmetrics_varlen.")
            )
    return found & modules


def _package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_no_import_cycles():
    modules = _package_modules()
    graph = {name: _top_level_imports(path, set(modules)) - {name} for name, path in modules.items()}
    assert graph["_engine"] and "gather" not in graph["_engine"]  # the engine does not reach up to the hook

    def visit(module, path):
        for dependency in graph.get(module, ()):
            assert dependency not in path, f"import cycle: {' -> '.join([*path, dependency])}"
            visit(dependency, [*path, dependency])

    for module in graph:
        visit(module, [module])


def test_type_checking_imports_count(tmp_path):
    # The cycle check reads imports under `if TYPE_CHECKING:` (the join <-> metric cycle was one).
    path = tmp_path / "probe.py"
    probe = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torchmetrics_varlen.metric import Metric\n"
    path.write_text(probe)
    assert _top_level_imports(path, {"metric"}) == {"metric"}


def test_header_flags_are_distinct_bits():
    # Two features once picked the same header bit (the Join worker's record and the reduce mode): every flag is
    # defined in the record module, one bit each.
    import importlib

    from torchmetrics_varlen._engine import record

    join = importlib.import_module("torchmetrics_varlen.join")  # the module, which the package's `join` shadows

    flags = {name: value for name, value in vars(record).items() if name.startswith("FLAG_")}
    assert all(value > 0 and value & (value - 1) == 0 for value in flags.values()), flags
    assert len(set(flags.values())) == len(flags), flags
    assert join.FLAG_SHADOW in flags.values()


def _imported_names(path: Path):
    """The absolute names of every module an ``import`` or ``from`` statement of the file names, anywhere in it."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def test_runtime_modules_never_import_the_tooling():
    for path in sorted(PACKAGE.rglob("*.py")):
        tooling = [name for name in _imported_names(path) if name.split(".")[0] in TOOLING]
        assert not tooling, f"{path.relative_to(ROOT)} imports {tooling}: the runtime must not need the repository"


def test_no_tooling_left_in_the_package():
    assert not (PACKAGE / "tools").exists() and not (PACKAGE / "__main__.py").exists()


# ----------------------------------------------------------------------------------- the repository's import graph
def _repository_modules(root: Path) -> dict[str, Path]:
    """Every module of the repository's packages, by dotted name (a package by its ``__init__``)."""
    modules = {}
    for top in REPOSITORY:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which repository modules each module imports, at the top level or inside a function (or any block).

    ``from a import b`` counts as importing ``a.b`` where that is a module, else ``a``. The tests import each other
    by their bare names too (``from _helpers import ...``: ``tests/`` is on ``sys.path``).
    """
    bare = {name.split(".", 1)[1]: name for name in modules if name.startswith("tests.")}

    def known(name: str) -> str | None:
        return name if name in modules else bare.get(name)

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.update(known(f"{base}.{alias.name}") or known(base) for alias in node.names)
        graph[name] = found - {None, name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles found by a depth-first walk: one per edge back to a module still open (none: no cycle at all)."""
    cycles, state, path = [], {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dependency in sorted(graph[module]):
            if state.get(dependency) == "open":
                cycles.append([*path[path.index(dependency) :], dependency])
            elif dependency not in state:
                visit(dependency)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_import_cycle_in_the_repository():
    graph = _import_graph(_repository_modules(ROOT))
    assert {"tests._workers", "tests._meters", "benchmarks.skew"} <= graph["benchmarks.bench"]
    assert {"tests._helpers", "tests.conftest", "benchmarks.bench"} <= graph["tests.test_collection"]  # bare names too
    cycles = [" -> ".join(cycle) for cycle in _cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    package = tmp_path / "benchmarks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from benchmarks import b\n")
    (package / "b.py").write_text("def late():\n    from . import a\n")
    (package / "c.py").write_text("import benchmarks.a\n")
    graph = _import_graph(_repository_modules(tmp_path))
    assert graph["benchmarks.c"] == {"benchmarks.a"}
    assert _cycles(graph) == [["benchmarks.a", "benchmarks.b", "benchmarks.a"]]


# ------------------------------------------------------------------------------------------------------- the wheel
def test_the_wheel_holds_the_runtime_alone(tmp_path):
    pytest.importorskip("hatchling")  # the build backend (the test extra installs it)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    result = subprocess.run([*command, "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    metadata = [name for name in names if name.split("/")[0].endswith(".dist-info")]
    shipped = sorted(set(names) - set(metadata))
    sources = [path for path in PACKAGE.rglob("*") if path.is_file() and "__pycache__" not in path.parts]
    assert shipped == sorted(path.relative_to(ROOT).as_posix() for path in sources)
    assert not [name for name in shipped if name.endswith("__main__.py") or "/tools/" in name]
    assert not [name for name in metadata if name.endswith("entry_points.txt")]  # no command-line script
