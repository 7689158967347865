"""Sphinx configuration of the torchmetrics-varlen documentation.

Build (warnings are errors, as in CI)::

    python -m nox -s docs
    # or, in an environment with `pip install -e .[docs]`:
    sphinx-build -W --keep-going -b html docs docs/_build/html

Cross-links to the Python, torch and torchmetrics documentation (intersphinx) are off unless
``DOCS_INTERSPHINX=1`` is set: their inventories come from the web, and CI machines reach only package registries.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torchmetrics_varlen

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

project = "torchmetrics-varlen"
author = "torchmetrics-varlen developers"
copyright = "torchmetrics-varlen developers"
release = version = torchmetrics_varlen.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]

# Intersphinx. An inventory that cannot be fetched is a warning ("failed to reach any of the inventories"), which
# -W turns into a failed build, and Sphinx gives that warning no type that `suppress_warnings` could silence. So the
# extension is loaded only where the web is reachable (release builds, Read the Docs): DOCS_INTERSPHINX=1. Without it,
# references to torch / torchmetrics objects render as plain code (nitpicky is off, so they are not warnings).
if os.environ.get("DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
        "torchmetrics": ("https://lightning.ai/docs/torchmetrics/stable", None),
    }
    intersphinx_timeout = 30
nitpicky = False

# autodoc + napoleon: the package's docstrings are Google style.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# torchmetrics.Metric brings hundreds of inherited members; only ours are documented.
autodoc_inherit_docstrings = False

# benchmarks_table.rst is written by `python -m nox -s bench` and included by benchmarks.rst, not a page of its own.
exclude_patterns = ["_build", "benchmarks_table.rst"]
html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_static_path = ["_static"]
html_title = f"torchmetrics-varlen {release}"


def _ensure_generated_files() -> None:
    """A fresh checkout builds before any benchmark ran: draw missing figures, write a placeholder table."""
    from figures import ensure_figures

    ensure_figures()
    for name in ("benchmarks_table.rst", "benchmarks_table_skew.rst", "benchmarks_table_sync_memory.rst"):
        table = HERE / name
        if not table.exists():
            table.write_text("::\n\n    No benchmark run yet: run `python -m nox -s bench` to fill in this table.\n")


_ensure_generated_files()


def _public_bases(app, name, obj, options, bases):
    """Show base classes by their public, unambiguous names (two classes are called ``Metric``)."""
    import torchmetrics
    from torch.distributed.algorithms.join import Joinable

    for index, base in enumerate(bases):
        if not isinstance(base, type):
            continue
        module, short = base.__module__, base.__name__
        if module.startswith("torchmetrics_varlen.join"):
            bases[index] = f":py:class:`{Joinable.__module__}.{Joinable.__name__}`"
        elif module.startswith("torchmetrics_varlen") and short in torchmetrics_varlen.__all__:
            bases[index] = f":py:class:`torchmetrics_varlen.{short}`"
        elif module.startswith("torchmetrics.") and getattr(torchmetrics, short, None) is base:
            bases[index] = f":py:class:`torchmetrics.{short}`"


def _check_api_page(app):
    """Fail the build (under -W) when a name of ``torchmetrics_varlen.__all__`` is missing from api.rst."""
    import re

    from sphinx.util import logging

    text = (HERE / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: torchmetrics_varlen\.(\w+)", text, flags=re.MULTILINE))
    for name in sorted(set(torchmetrics_varlen.__all__) - documented):
        logging.getLogger(__name__).warning(
            "torchmetrics_varlen.%s is public (in __all__) but not documented in api.rst", name, location="api"
        )


def setup(app):
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("builder-inited", _check_api_page)
