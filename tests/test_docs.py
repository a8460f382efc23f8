"""The documentation holds together: the API reference builds with Sphinx with no warning (a
docstring that does not parse, a documented name that no longer exists) and documents every
public name; every relative link of the README, the changelog and ``docs/`` reaches a file and
heading that exist; every ``fxshard.name`` the pages mention exists (an attribute, a module or a
logger)."""

from __future__ import annotations

import glob
import importlib
import logging
import os
import re
import subprocess
import sys

import pytest

import fxshard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "CHANGELOG.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NAME = re.compile(r"\bfxshard(?:\.[A-Za-z_]\w*)+")


def _read(page):
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: str) -> set[str]:
    body = re.sub(r"```.*?```", "", _read(page), flags=re.S)  # no headings inside code
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", body, flags=re.M)}


def test_the_api_reference_builds_without_warnings(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         os.path.join(ROOT, "docs", "api"), str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "index.html").exists()


def test_the_api_reference_documents_every_public_name():
    rst = _read(os.path.join("docs", "api", "index.rst"))
    documented = set(re.findall(r"^\.\. auto(?:class|function|data):: (\w+)", rst, flags=re.M))
    assert documented == set(fxshard.__all__), (
        f"missing: {sorted(set(fxshard.__all__) - documented)}; "
        f"not public: {sorted(documented - set(fxshard.__all__))}"
    )


@pytest.mark.parametrize("page", PAGES)
def test_links_reach_files_and_headings(page):
    bad = []
    for target in LINK.findall(_read(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(ROOT, dest)):
            bad.append(f"{target}: no file {dest}")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest}")
    assert not bad, f"{page}: " + "; ".join(bad)


def _resolves(dotted: str) -> bool:
    if dotted in logging.Logger.manager.loggerDict:  # a logger fxshard logs on
        return True
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", PAGES)
def test_the_names_a_page_mentions_exist(page):
    names = {m.rstrip(".") for m in NAME.findall(_read(page))}
    stale = sorted(n for n in names if not _resolves(n))
    assert not stale, f"{page} mentions names fxshard does not have: {stale}"


def test_the_benchmark_plots_are_drawn_from_the_page_tables():
    """Every plot of docs/benchmarks.md is drawn by benchmarks/plots.py from a table on that page:
    the table parses, the figure exists and the page shows it."""
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", "plots.py")
    spec = importlib.util.spec_from_file_location("plots", path)
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    page = _read("docs/benchmarks.md")
    tables = plots.tables(page)
    for name, _, columns, draw in plots.FIGURES:
        rows = plots.find(tables, *columns)
        assert rows and all(len(r) == len(rows[0]) for r in rows), name
        assert callable(getattr(plots, draw)), name
        assert os.path.exists(os.path.join(ROOT, "docs/img", name)), f"run make plots: {name}"
        assert f"(img/{name})" in page, f"docs/benchmarks.md does not show {name}"
