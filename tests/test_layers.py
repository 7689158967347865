"""The runtime's shape, read from its code: layers that import only downward, one module that starts collectives,
public modules that never touch a collective or a group's state, few process-global mutable objects, two kinds of
thread (each driving gloo side groups only) and one exit handler.

These are read from the source (imports, calls) and from the imported modules (their module-level objects), so a
change that breaks the shape fails here, whatever it does at run time.
"""

import ast
import functools
import importlib
import threading
import types
import weakref
from collections import OrderedDict, defaultdict, deque
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchmetrics_varlen"

# Every runtime module, lowest layer first: a module may import only modules listed before it.
LAYERS = [
    "errors",
    # the engine's pure layers: nothing here communicates
    "_engine.record",
    "_engine.mismatch",
    "_engine.plan",
    "_engine.pack",
    "_engine.unpack",
    "_engine.objects",
    "_engine.scalar_codec",
    # state per group and the policy; then the one module that starts collectives, the one that waits for them
    "_engine.group",
    "_engine.comm",
    "_engine.wait",
    # the data step, the API and its orchestration, metrics' states
    "_engine.grad",
    "_engine.move",
    "_engine",
    "_engine.states",
    "_engine.deferred",
    # the public modules
    "sampler",
    "gather",
    "metric",
    "collection",
    "onerank",
    "_indexed",
    "indexed",
    "scalars",
    "join",
    "losses",
    "mesh",
    "checkpoint",
    "lightning",
    "",  # the package's __init__
]
PURE = {
    "errors",
    "_engine.record",
    "_engine.mismatch",
    "_engine.plan",
    "_engine.pack",
    "_engine.unpack",
    "_engine.objects",
}
PURE |= {"_engine.scalar_codec"}
ENGINE = [name for name in LAYERS if name.startswith("_engine")]
PUBLIC = [name for name in LAYERS if not name.startswith("_engine") and name not in ("errors", "")]
# What the public modules may take from the group module: how to name a sync's link and the settings; never the
# registry of group states, nor a state itself.
PUBLIC_FROM_GROUP = {"link", "Link", "needs_sync", "parse_cap", "resolve_timeout", "default_timeout", "sent_cap"}
# The calls that start a collective (or make a process group, which is one), on torch.distributed or Join.
COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv",
    "isend", "monitored_barrier", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "notify_join_context",
    "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "send", "split_group",
}  # fmt: skip


def _path(module: str) -> Path:
    if module == "":
        return PACKAGE / "__init__.py"
    parts = module.split(".")
    package = PACKAGE.joinpath(*parts)
    return package / "__init__.py" if package.is_dir() else PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py")


def _runtime_modules() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append(".".join(parts))
    return found


def _imports(module: str) -> dict[str, set[str]]:
    """The package modules ``module`` imports (anywhere in it), each with the names it takes from it."""
    tree = ast.parse(_path(module).read_text())
    known = set(LAYERS)
    found: dict[str, set[str]] = defaultdict(set)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchmetrics_varlen."):
                    found[alias.name.removeprefix("torchmetrics_varlen.")].add("*")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchmetrics_varlen"):
            base = node.module.removeprefix("torchmetrics_varlen").removeprefix(".")
            for alias in node.names:
                submodule = f"{base}.{alias.name}" if base else alias.name
                if submodule in known:
                    found[submodule].add("*")
                else:
                    found[base].add(alias.name)
    return found


def test_every_runtime_module_has_a_layer():
    assert sorted(_runtime_modules()) == sorted(LAYERS)


def test_layers_import_only_downward():
    rank = {name: position for position, name in enumerate(LAYERS)}
    upward = []
    for module in LAYERS:
        for imported in _imports(module):
            if imported not in rank:
                upward.append(f"{module or '__init__'} imports unknown {imported}")
            elif rank[imported] >= rank[module] and imported != module:
                upward.append(f"{module or '__init__'} imports {imported or '__init__'}, a layer above or beside it")
    assert not upward, "\n".join(upward)


def test_pure_layers_import_nothing_that_communicates():
    for module in PURE:
        assert not set(_imports(module)) - PURE, (module, _imports(module))
        for node in ast.walk(ast.parse(_path(module).read_text())):
            if isinstance(node, ast.Import):
                assert not any(alias.name.startswith("torch.distributed") for alias in node.names), module
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                assert [alias.name for alias in node.names] == ["DistError"], module  # the errors' base class


def test_the_public_modules_call_the_engine_never_a_collective_nor_group_state():
    for module in PUBLIC:
        imports = _imports(module)
        assert not {"_engine.comm", "_engine.wait"} & set(imports), (module, imports)
        assert imports.get("_engine.group", set()) <= PUBLIC_FROM_GROUP, (module, imports["_engine.group"])
        source = _path(module).read_text()
        for private in ("REGISTRY", "GroupState", ".state.", "state.side", "._lock"):
            assert private not in source, (module, private)


def _collective_calls(path: Path) -> list[str]:
    """The calls in a file that start a collective: a collective's name on ``dist``, ``torch.distributed`` or Join."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            receiver = ast.unparse(node.func.value)
            if "dist" in receiver or "Join" in receiver or "strategy" in receiver:
                calls.append(ast.unparse(node.func))
    return calls


def test_only_the_communication_layer_starts_collectives():
    outside = [
        f"{module}: {call}"
        for module in LAYERS
        if module != "_engine.comm"
        for call in _collective_calls(_path(module))
    ]
    assert not outside, "\n".join(outside)
    assert _collective_calls(_path("_engine.comm"))  # the check sees the calls where they are


def test_the_check_tells_a_collective_from_a_tensor_operation(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\nimport torch.distributed as dist\n"
        "def f(t, strategy):\n    torch.gather(t, 0, t)\n    strategy.all_gather(t)\n"
        "    return dist.all_reduce(t, async_op=True)\n"
    )
    assert sorted(_collective_calls(probe)) == ["dist.all_reduce", "strategy.all_gather"]


# ---------------------------------------------------------------------------------- process-global mutable objects
# Each with why it is process-global (the budget is at most 6).
GLOBALS = {
    "_engine.group.REGISTRY": "a group's state must outlive the metrics that sync on it",
    "_engine.wait.NOTES": "notes are per process (one key per global rank), and the exit handler needs them",
    "_engine.states._class_layout": "what a set of metric classes syncs, asked at every per-step sync",
    "metric.rebase": "one rebased class per stock class, so that instances pickle and compare",
    "metric._rebased_meta": "one metaclass per stock metaclass, registered once with copyreg",
    "_engine.deferred.WORKER": "one thread runs every pending compute_async sync in call order, as every rank calls",
}
_MUTABLE = (
    dict, list, set, bytearray, OrderedDict, defaultdict, deque, weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary, threading.local,
)  # fmt: skip


def _is_mutable_global(value: object) -> bool:
    """A mutable container, a writeable array, a memoising function, or an instance of one of the package's classes."""
    if isinstance(value, (*_MUTABLE, functools._lru_cache_wrapper)):
        return True
    if isinstance(value, np.ndarray):
        return bool(value.flags.writeable)
    if isinstance(value, (type, types.FunctionType, types.ModuleType)):
        return False
    return (getattr(type(value), "__module__", "") or "").startswith("torchmetrics_varlen")


def _defined_at_top(module: str) -> set[str]:
    """The names a module binds at its top level itself (assignments, functions), not the names it imports."""
    names = set()
    for node in ast.parse(_path(module).read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    return names


def test_few_process_global_mutable_objects_each_with_a_reason():
    found = []
    for name in LAYERS:
        module = importlib.import_module("torchmetrics_varlen" + (f".{name}" if name else ""))
        for attr in sorted(_defined_at_top(name) - {"__all__"}):
            if _is_mutable_global(getattr(module, attr)):
                found.append(f"{name}.{attr}" if name else attr)
    assert sorted(found) == sorted(GLOBALS), found
    assert len(GLOBALS) <= 6


# --------------------------------------------------------------------------------------- threads and exit handlers
def _calls(name: str) -> list[str]:
    found = []
    for module in LAYERS:
        for node in ast.walk(ast.parse(_path(module).read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(name):
                found.append(module)
    return found


def test_two_kinds_of_thread_and_one_exit_handler():
    # The pending syncs' worker (compute_async) and the Join worker; both drive gloo side groups only.
    assert _calls("threading.Thread") == ["_engine.deferred", "join"]
    assert _calls("atexit.register") == ["_engine.wait"]
    assert len(_calls("atexit.register")) == 1


@pytest.mark.parametrize("module", ENGINE)
def test_engine_modules_say_what_they_are(module):
    doc = ast.get_docstring(ast.parse(_path(module).read_text()))
    assert doc and len(doc) > 80, module
