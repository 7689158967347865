"""`import torchmetrics_varlen` loads only what syncs metrics: no tooling (demo, bench, launcher, memory probe)."""

import json
import subprocess
import sys
from pathlib import Path

import torchmetrics_varlen

ROOT = Path(__file__).resolve().parents[1]
TOOLING = ("tools", "demo", "bench", "_launch", "_memory")


def _modules_after(code: str) -> list[str]:
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [name for name in json.loads(result.stdout.splitlines()[-1]) if name.startswith("torchmetrics_varlen")]


def test_import_loads_no_tooling():
    loaded = _modules_after("import torchmetrics_varlen")
    assert "torchmetrics_varlen" in loaded and "torchmetrics_varlen.gather" in loaded  # the import did happen
    tooling = [name for name in loaded if any(part in TOOLING for part in name.split(".")[1:])]
    assert tooling == [], f"`import torchmetrics_varlen` imported tooling modules: {tooling}"


def test_every_public_name_loads_no_tooling():
    names = ", ".join(sorted(set(torchmetrics_varlen.__all__) - {"__version__"}))
    loaded = _modules_after(f"from torchmetrics_varlen import {names}")
    assert not [name for name in loaded if ".tools" in name], loaded


def test_command_line_reaches_the_tools_lazily():
    loaded = _modules_after("import torchmetrics_varlen.__main__")
    assert not [name for name in loaded if ".tools" in name], loaded
    result = subprocess.run(
        [sys.executable, "-m", "torchmetrics_varlen", "demo", "--help"], cwd=ROOT, capture_output=True, text=True
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
