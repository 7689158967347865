"""Sphinx configuration of the torchmetrics-varlen documentation."""

import os

import torchmetrics_varlen

project = "torchmetrics-varlen"
author = "torchmetrics-varlen developers"
release = version = torchmetrics_varlen.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
# Cross-links to torch and torchmetrics need their inventories from the web. CI machines reach only package
# registries, so the build would warn (and fail under -W): set DOCS_INTERSPHINX=1 where the web is reachable.
if os.environ.get("DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://pytorch.org/docs/stable", None),
        "torchmetrics": ("https://lightning.ai/docs/torchmetrics/stable", None),
    }

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# torchmetrics.Metric brings hundreds of inherited members; only ours are documented.
autodoc_inherit_docstrings = False
exclude_patterns = ["_build", "benchmarks_table.rst"]
html_theme = "furo" if __import__("importlib.util").util.find_spec("furo") else "alabaster"
html_static_path = ["_static"]
html_title = "torchmetrics-varlen"
nitpicky = False
