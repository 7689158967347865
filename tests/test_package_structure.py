"""The package's module graph: no import cycles among the modules' imports (one engine, layered).

Imports under ``if TYPE_CHECKING:`` count too: a cycle there is still two modules that need each other's names.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchmetrics_varlen"


def _statements(body):
    """The module's top-level statements, and those inside its top-level ``if`` / ``try`` blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse, *([h.body for h in node.handlers] if isinstance(node, ast.Try) else [])]
            for block in blocks:
                yield from _statements(block)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in _statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchmetrics_varlen"):
            parts = node.module.split(".")
            found.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.split(".")[1] for alias in node.names if alias.name.startswith("torchmetrics_varlen.")
            )
    return found & modules


def test_no_import_cycles():
    modules = {path.stem for path in PACKAGE.glob("*.py")} | {"tools"}
    graph = {path.stem: _top_level_imports(path, modules) for path in PACKAGE.glob("*.py")}
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


def test_runtime_modules_never_import_the_tools():
    modules = {path.stem for path in PACKAGE.glob("*.py")} | {"tools"}
    for path in PACKAGE.glob("*.py"):
        if path.stem != "__main__":
            assert "tools" not in _top_level_imports(path, modules), path.name


def test_header_flags_are_distinct_bits():
    # Two features once picked the same header bit (the Join worker's record and the reduce mode): every flag is
    # defined in _protocol, one bit each.
    from torchmetrics_varlen import _join_shadow, _protocol

    flags = {name: value for name, value in vars(_protocol).items() if name.startswith("FLAG_")}
    assert all(value > 0 and value & (value - 1) == 0 for value in flags.values()), flags
    assert len(set(flags.values())) == len(flags), flags
    assert _join_shadow.FLAG_SHADOW in flags.values()
