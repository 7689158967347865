"""Developer sessions: ``python -m nox -s tests`` (the CI test command), lint, typecheck, docs, demo, bench, compat,
tests_newest.

``tests_newest`` (not a default session; CI runs it last) runs the core of the suite on the newest torch release, a
multi-GB download from the package registry.

``detection`` (not a default session) runs ``rebase(MeanAveragePrecision)`` with torchvision and pycocotools, on the
registry's torch build (about 4 minutes on 2 cores, 3 of them the download and install, measured).

``gpu`` (the GPU check) is not a default session: it needs GPUs, which CI does not have.
"""

import site
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / ".ci" / "constraints.txt"))  # pins torch to the CPU wheel on disk
NEWEST_CONSTRAINTS = ("-c", str(ROOT / ".ci" / "constraints-newest.txt"))  # pins the newest torch release
# What tests_newest runs: the sync itself, on the torch.distributed calls it uses (metrics, collections, the hook,
# gradients, the policy, the engine with its late, missing and crashed ranks in both waits, the repeated sync's fast
# path, parity with stock), join with its side groups (made through torch's group calls, whose naming changed in 2.15),
# the layering rules, and the metrics' shares through torch.distributed.checkpoint (whose planners change between
# releases). Left to the 2.13 run, to keep CI under 25 minutes: tests/test_timeouts.py (about 5 minutes,
# mostly ranks waiting out timeouts) and the integrations (Lightning, Accelerate, torchrun).
NEWEST_TESTS = (
    "tests/test_metric.py",
    "tests/test_collection.py",
    "tests/test_gather_hook.py",
    "tests/test_sync_grads.py",
    "tests/test_policy.py",
    "tests/test_engine.py",
    "tests/test_fast_path.py",
    "tests/test_parity.py",
    "tests/test_join.py",
    "tests/test_layers.py",
    "tests/test_checkpoint_dcp.py",
)
# 1.0-1.3 skip the gather for an empty `cat` list (ranks issue different collectives);
# 1.2.0-1.4.0 share `_computed` between the members of a compute group.
OLDEST_TORCHMETRICS = "1.4.1"
# The lowest lightning-utilities declared in pyproject.toml (0.10 and 0.11 import pkg_resources, gone from current
# setuptools), tested with the oldest torchmetrics. torch itself is declared >=2.13: the oldest release whose CPU wheel
# these machines install (older ones are multi-GB CUDA builds), so the oldest tested; tests_newest adds the newest.
OLDEST_LIGHTNING_UTILITIES = "0.12.0"

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.default_venv_backend = "venv"


def _install(session: nox.Session, *args: str) -> None:
    session.install(*CONSTRAINTS, *args)


@nox.session
def tests(session: nox.Session) -> None:
    """The test-suite (spawned gloo CPU ranks, Lightning Trainers, Accelerate and torchrun) and the doctests."""
    _install(session, "-e", ".[test,lightning,accelerate]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def tests_newest(session: nox.Session) -> None:
    """The core of the test-suite on the newest torch release (pinned in ``.ci/constraints-newest.txt``).

    The machines' global pip constraints file caps torch below it: ``PIP_CONSTRAINT`` points at an empty file here, so
    only the session's own pin applies. torch comes from the package registry (a CUDA build that runs on the CPU); the
    pin keeps pip off the CPU wheel of 2.13 on disk. Arguments after ``--`` replace the test selection.
    """
    empty = Path(session.create_tmp()) / "no-constraints.txt"
    empty.write_text("")
    session.env["PIP_CONSTRAINT"] = str(empty)
    session.install(*NEWEST_CONSTRAINTS, "torch")
    session.install(*NEWEST_CONSTRAINTS, "-e", ".[test,lightning,accelerate]")
    version = "import torch; print('torch', torch.__version__, 'CUDA build' if torch.version.cuda else 'CPU build')"
    session.run("python", "-c", version)
    session.run("python", "-m", "pytest", "-q", *(session.posargs or NEWEST_TESTS))


DETECTION_CONSTRAINTS = ("-c", str(ROOT / ".ci" / "constraints-detection.txt"))


@nox.session
def detection(session: nox.Session) -> None:
    """``rebase(MeanAveragePrecision)`` (boxes and masks) on uneven and empty ranks, with torchvision and pycocotools.

    Not a default session: torchvision's registry wheels need the registry's torch build (pinned in
    ``.ci/constraints-detection.txt``), a multi-GB download. pip runs ``--isolated``: the machines' configuration
    (their global constraints file, and the wheel folder holding the CPU build of the same version, which pip would
    prefer) does not apply. The ``tests`` session skips these tests (no torchvision there).
    """
    session.install("--isolated", *DETECTION_CONSTRAINTS, "torch", "torchvision", "pycocotools")
    session.install("--isolated", *DETECTION_CONSTRAINTS, "-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", *(session.posargs or ("tests/test_detection.py",)))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on everything: lint rules and formatting."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package, the benchmarks, and the worker pool and meters they share with the tests."""
    _install(session, "-e", ".", "mypy>=1.8")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Sphinx site, warnings as errors."""
    _install(session, "-e", ".[docs]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def demo(session: nox.Session) -> None:
    """The five field reports replayed: today's way (measured), stock, the fix, the single-process truth."""
    _install(session, ".")
    session.run("python", "-m", "benchmarks", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Stock vs ours side by side in one run (with the skew and sync-memory cases); then the scale benchmark."""
    _install(session, ".", "matplotlib>=3.7")
    session.run(
        "python",
        "-m",
        "benchmarks",
        "bench",
        "--json",
        "bench.json",
        "--plot",
        "docs/_static/bench.png",
        "--table",
        "docs/benchmarks_table.rst",
        *session.posargs,
    )
    session.run(
        "python",
        "-m",
        "benchmarks",
        "bench",
        "--scale",
        "--json",
        "scale.json",
        "--plot",
        "docs/_static/scale.png",
        "--table",
        "docs/scale_table.rst",
        *session.posargs,
    )


@nox.session
@nox.parametrize("torchmetrics", [OLDEST_TORCHMETRICS, "latest"])
def compat(session: nox.Session, torchmetrics: str) -> None:
    """The test-suite against the oldest supported (with the oldest lightning-utilities) and the newest torchmetrics."""
    _install(session, "-e", ".[test,lightning,accelerate]")
    if torchmetrics == "latest":
        _install(session, "--upgrade", "--no-deps", "torchmetrics", "lightning-utilities")
    else:
        specs = (f"torchmetrics=={torchmetrics}", f"lightning-utilities=={OLDEST_LIGHTNING_UTILITIES}")
        _install(session, "--force-reinstall", "--no-deps", *specs)
    versions = "import torchmetrics, lightning_utilities as lu; print(torchmetrics.__version__, lu.__version__)"
    session.run("python", "-c", versions)
    session.run("python", "-m", "pytest", "-q", "-x", *session.posargs)


@nox.session(venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """The GPU check on NCCL with every visible GPU, under torchrun (never run in CI; docs page "Where it runs").

    It must test the torch you train with (a CUDA build), so unlike the other sessions it pins nothing: no
    ``.ci/constraints.txt`` (that would install the CPU wheel). The session's virtualenv sees the packages of the Python
    that runs nox: the system site-packages (``--system-site-packages``) and, when nox runs inside a virtualenv or conda
    environment, that environment's site-packages too (a ``.pth`` file; a venv made from a venv only sees the base
    interpreter's). pip then finds your torch already installed and adds only this package (editable) and whatever
    else is missing; nothing is installed into your own environment.

    One process per GPU; with one GPU, two processes sharing it (NCCL needs a GPU per rank, so they run the CUDA
    states over gloo scenarios), then ``benchmarks.gpu_one_rank``, a 1-rank NCCL world in which the engine issues its
    real NCCL calls (the one-GPU mode). Last, ``python -m benchmarks.gpu_measure`` prints what a sync costs on that
    machine.
    No GPU: it says so and exits 0. Arguments after ``--`` go to the check;
    ``nox -s gpu -- --list`` prints the scenarios' names, with or without a GPU.
    """
    outer = [path for path in [*site.getsitepackages(), site.getusersitepackages()] if Path(path).is_dir()]
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True, log=False
    )
    if sys.prefix != sys.base_prefix and isinstance(purelib, str):
        Path(purelib.strip(), "_nox_outer_site.pth").write_text("".join(f"{path}\n" for path in outer))
    count = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        gpus = int(str(session.run("python", "-c", count, silent=True, log=False)).strip().splitlines()[-1])
    except (nox.command.CommandFailed, ValueError):
        session.skip("torch is not importable from the Python that runs nox: install your CUDA build of torch there")
    listing = "--list" in session.posargs  # the scenarios' names: no GPU and no torchrun needed
    if gpus == 0 and not listing:
        session.skip("no CUDA GPU visible to torch: nothing to check on NCCL (the tests run the check with --cpu)")
    session.install("-e", ".")
    if listing:
        session.run("python", "-m", "benchmarks.gpu_check", *session.posargs)
        return
    session.run(
        "python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(max(2, gpus)),
        "-m",
        "benchmarks.gpu_check",
        *session.posargs,
    )
    if gpus == 1:  # the one-GPU mode's other half: a 1-rank NCCL world in which the engine issues its NCCL calls
        session.run("python", "-m", "benchmarks.gpu_one_rank")
    session.run("python", "-m", "benchmarks.gpu_measure")  # what a sync costs there: time, collectives, copies, memory
