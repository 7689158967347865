"""Developer sessions: ``python -m nox -s tests`` (the CI test command), lint, typecheck, docs, demo, bench, compat."""

from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / ".ci" / "constraints.txt"))  # pins torch to the CPU wheel on disk
# 1.0-1.3 skip the gather for an empty `cat` list (ranks issue different collectives);
# 1.2.0-1.4.0 share `_computed` between the members of a compute group.
OLDEST_TORCHMETRICS = "1.4.1"
OLDEST_LIGHTNING_UTILITIES = "0.12.0"  # the lower bound declared in pyproject.toml

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.default_venv_backend = "venv"


def _install(session: nox.Session, *args: str) -> None:
    session.install(*CONSTRAINTS, *args)


@nox.session
def tests(session: nox.Session) -> None:
    """The test-suite (spawned gloo CPU ranks, a Lightning Trainer, torchrun) and the doctests."""
    _install(session, "-e", ".[test,lightning]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on everything: lint rules and formatting."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    _install(session, "-e", ".", "mypy>=1.8")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Sphinx site, warnings as errors."""
    _install(session, "-e", ".[docs]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def demo(session: nox.Session) -> None:
    """Field report 1 replayed: naive vs stock torchmetrics vs torchmetrics_varlen."""
    _install(session, ".")
    session.run("python", "-m", "torchmetrics_varlen", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Stock torchmetrics vs torchmetrics_varlen, side by side in one run."""
    _install(session, ".[bench]")
    session.run(
        "python",
        "-m",
        "torchmetrics_varlen",
        "bench",
        "--json",
        "bench.json",
        "--plot",
        "docs/_static/bench.png",
        "--table",
        "docs/benchmarks_table.rst",
        *session.posargs,
    )


@nox.session
@nox.parametrize("torchmetrics", [OLDEST_TORCHMETRICS, "latest"])
def compat(session: nox.Session, torchmetrics: str) -> None:
    """The test-suite against the oldest supported (torchmetrics, lightning-utilities) and the newest torchmetrics."""
    _install(session, "-e", ".[test,lightning]")
    spec = "torchmetrics" if torchmetrics == "latest" else f"torchmetrics=={torchmetrics}"
    _install(session, "--upgrade" if torchmetrics == "latest" else "--force-reinstall", "--no-deps", spec)
    if torchmetrics != "latest":
        _install(session, "--force-reinstall", "--no-deps", f"lightning-utilities=={OLDEST_LIGHTNING_UTILITIES}")
    versions = (
        "import torchmetrics as tm, lightning_utilities as lu; print('torchmetrics', tm.__version__, lu.__version__)"
    )
    session.run("python", "-c", versions)
    session.run("python", "-m", "pytest", "-q", "-x", *session.posargs)
