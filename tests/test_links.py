"""Links a reader can open: README's relative links resolve, and no link points at a site that was never published."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Hosts the project's text may link to: published sites of its dependencies. Its own docs are not published.
KNOWN_HOSTS = {"lightning.ai", "docs.python.org", "docs.pytorch.org"}


def _texts():
    paths = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.rst"))]
    paths += [ROOT / "docs" / "conf.py", *sorted((ROOT / "torchmetrics_varlen").rglob("*.py"))]
    paths += sorted((ROOT / "benchmarks").rglob("*.py"))
    paths += sorted((ROOT / "examples").glob("*.py"))
    return {path: path.read_text() for path in paths}


def test_no_link_to_an_unpublished_site():
    for path, text in _texts().items():
        for url in re.findall(r"https?://[^\s)\"'>`]+", text):
            host = url.split("/")[2]
            assert host in KNOWN_HOSTS, f"{path.relative_to(ROOT)} links to {url}: no such site is published"


def test_pyproject_urls_point_at_published_sites():
    text = (ROOT / "pyproject.toml").read_text()  # tomllib is Python 3.11+; the package supports 3.10
    table = re.search(r"^\[project\.urls\]\n(.*?)(?=^\[|\Z)", text, flags=re.M | re.S)
    for name, url in re.findall(r'^([\w-]+)\s*=\s*"([^"]*)"', table.group(1) if table else "", flags=re.M):
        assert url.split("/")[2] in KNOWN_HOSTS, f"pyproject.toml [project.urls] {name} = {url}"


def test_readme_relative_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]
    assert any(target.startswith("docs/") for target in targets)  # the docs are linked from the README
    for target in targets:
        path = ROOT / target.split("#", 1)[0]
        assert path.exists(), f"README.md links to {target}, which is not in the repository"
