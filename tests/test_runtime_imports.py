"""`import torchmetrics_varlen` loads only what syncs metrics: none of the repository's tooling.

The demo, the benchmarks and the GPU check live in ``benchmarks/``, the worker pool and the collective meters in
``tests/``; the installed package has neither, so it must never import them.
"""

import json
import subprocess
import sys
from pathlib import Path

import torchmetrics_varlen

ROOT = Path(__file__).resolve().parents[1]
TOOLING = ("benchmarks", "tests")


def _modules_after(code: str) -> list[str]:
    """The names in ``sys.modules`` after running ``code`` in a fresh interpreter, from the repository root."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def _tooling(loaded: list[str]) -> list[str]:
    return [name for name in loaded if name.split(".")[0] in TOOLING]


def test_import_loads_no_tooling():
    loaded = _modules_after("import torchmetrics_varlen")
    assert "torchmetrics_varlen" in loaded and "torchmetrics_varlen.gather" in loaded  # the import did happen
    assert _tooling(loaded) == [], f"`import torchmetrics_varlen` imported tooling modules: {_tooling(loaded)}"


def test_every_public_name_loads_no_tooling():
    names = ", ".join(sorted(set(torchmetrics_varlen.__all__) - {"__version__"}))
    loaded = _modules_after(f"from torchmetrics_varlen import {names}")
    assert _tooling(loaded) == [], _tooling(loaded)


def test_command_line_reaches_the_tools_lazily():
    loaded = _modules_after("import benchmarks.__main__")
    assert _tooling(loaded) == ["benchmarks", "benchmarks.__main__"], _tooling(loaded)
    assert not [name for name in loaded if name.startswith("torchmetrics_varlen")], loaded
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "demo", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0 and "--report" in result.stdout, result.stdout + result.stderr


def test_package_and_lightning_module_import_without_lightning():
    # `sys.modules[name] = None` makes `import name` fail as if the package were not installed.
    script = (
        "import sys\n"
        "sys.modules['lightning'] = sys.modules['lightning.pytorch'] = None\n"
        "import torchmetrics_varlen\n"
        "from torchmetrics_varlen.lightning import ExactEvaluation\n"
        "try:\n"
        "    ExactEvaluation()\n"
        "except ModuleNotFoundError as err:\n"
        "    print('refused:', err)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused:" in result.stdout and "pip install 'torchmetrics-varlen[lightning]'" in result.stdout
