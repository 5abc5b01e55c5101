"""The docs site as a reader's browser lays it out (issue 34): nothing cut, nothing squeezed.

``make docs``'s build is loaded in headless Chromium (Debian's ``chromium``, driven over
its DevTools protocol: tests/docs_browser.py) at the width of a laptop's window, and three
pages are measured: the home page (its architecture diagram), the quick start (long
commands with their "what it prints" comments) and ``kvsvc serve`` (the Limits table).
A code block whose lines are wider than the text column (it scrolls: the reader sees
them cut) fails, and so does a table wider than the column or one whose names (a
setting, a status code) are broken across lines. Screenshots of each page are written
(to ``KVSVC_DOCS_SCREENSHOTS`` when set, else the test's temporary directory) for a
person to look at. A control build without the site's layout settings must fail the
same checks, so they cannot pass by measuring nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs_browser import Chromium, find_chromium
from tests.test_docs_site import docs_command
from tests.tooling import missing

REPO = Path(__file__).resolve().parents[1]
PAGES = {
    "home": "index.html",
    "quickstart": "quickstart/index.html",
    "serving": "serving/index.html",
}
# A laptop's window (the narrowest at which Material shows its navigation beside the
# text), and a small one (the navigation folds into a drawer).
LAPTOP = (1280, 800)
SMALL = (1024, 768)

# What a page's text column holds: each code block's and table's width against the
# column's, the lines of each name (inline code) in a table. Run in the page.
MEASURE = r"""
(() => {
  const column = document.querySelector('.md-content__inner');
  const right = column.getBoundingClientRect().right;
  const first = (el) => el.innerText.split('\n')[0].trim().slice(0, 60);
  const blocks = [...column.querySelectorAll('pre > code')].map((code) => ({
    what: first(code),
    width: code.clientWidth,
    needs: code.scrollWidth,
    past: Math.round(code.getBoundingClientRect().right - right),
  }));
  const tables = [...column.querySelectorAll('table')].map((table) => ({
    what: first(table.rows[0]),
    width: table.clientWidth,
    needs: table.scrollWidth,
    past: Math.round(table.getBoundingClientRect().right - right),
    broken: [...table.querySelectorAll('td code')]
      .filter((code) => code.getClientRects().length > 1)
      .map((code) => code.innerText),
  }));
  return {column: column.clientWidth, blocks, tables};
})()
"""


def problems(measured: dict[str, Any]) -> list[str]:
    """What a reader of the measured page would find cut or squeezed."""
    found = []
    for block in measured["blocks"]:
        if block["needs"] > block["width"] + 1 or block["past"] > 1:
            found.append(
                f"code block {block['what']!r} needs {block['needs']} px, its column "
                f"gives {block['width']} px"
            )
    for table in measured["tables"]:
        if table["needs"] > table["width"] + 1 or table["past"] > 1:
            found.append(
                f"table {table['what']!r} needs {table['needs']} px, its column gives "
                f"{table['width']} px"
            )
        if table["broken"]:
            found.append(f"table {table['what']!r} breaks names across lines: {table['broken']}")
    return found


def build_site(source: Path, out: Path) -> Path:
    """The site of ``source`` (mkdocs.yml, docs/, README.md) built as ``make docs`` does."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        missing("mkdocs", "the docs extra: pip install -e '.[docs]' (make venv installs it)")
    done = subprocess.run(
        [str(mkdocs), *docs_command(), "--site-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=source,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = find_chromium()
    if binary is None:
        missing("chromium", "the docs layout is checked in it (apt-get install chromium)")
    return binary


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_site(REPO, tmp_path_factory.mktemp("site") / "site")


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("KVSVC_DOCS_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module", params=[LAPTOP, SMALL], ids=["laptop", "small"])
def browser(request: pytest.FixtureRequest, chromium: str) -> Iterator[Chromium]:
    width, height = request.param
    with Chromium(chromium, width=width, height=height) as browser:
        yield browser


@pytest.mark.parametrize("page", PAGES)
def test_nothing_on_the_page_is_cut_or_squeezed(
    browser: Chromium, site: Path, screenshots: Path, page: str
) -> None:
    width = browser.evaluate("window.innerWidth")
    found = measure(browser, site / PAGES[page], screenshots / f"{page}-{width}.png")
    assert not found, f"{page} at {width} px: {found}"


def test_no_other_page_cuts_a_code_block_or_a_table(chromium: str, site: Path) -> None:
    """The same check on every other page of the site, at the laptop's width."""
    pages = sorted(site.glob("*/index.html"))
    others = [page for page in pages if page.relative_to(site).as_posix() not in PAGES.values()]
    assert len(others) > 10, others
    found = {}
    with Chromium(chromium, width=LAPTOP[0], height=LAPTOP[1]) as browser:
        for page in others:
            browser.open(page.as_uri())
            cut = problems(browser.evaluate(MEASURE))
            if cut:
                found[page.parent.name] = cut
    assert not found, found


def measure(browser: Chromium, page: Path, shot: Path) -> list[str]:
    """Load ``page``, write its screenshot to ``shot``, and say what is cut or squeezed."""
    browser.open(page.as_uri())
    measured = browser.evaluate(MEASURE)
    browser.screenshot(shot)
    assert shot.stat().st_size > 10_000  # a page was drawn, not a blank
    assert measured["blocks"], f"{page}: no code block measured"
    return problems(measured)


def test_the_check_fails_on_the_layout_it_replaced(
    chromium: str, tmp_path: Path, screenshots: Path
) -> None:
    """Material's default layout (no extra CSS, the table of contents on the right): the
    serve page's flags block and the Limits table's names are cut, as the issue found
    them."""
    source = tmp_path / "repo"
    shutil.copytree(REPO / "docs", source / "docs")
    shutil.copy(REPO / "README.md", source)
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    config = config.replace("    - toc.integrate\n", "")
    config = config.replace("extra_css:\n  - stylesheets/extra.css\n", "")
    assert "- toc.integrate" not in config and "extra_css:" not in config
    (source / "mkdocs.yml").write_text(config, encoding="utf-8")
    default = build_site(source, tmp_path / "site")
    with Chromium(chromium, width=LAPTOP[0], height=LAPTOP[1]) as browser:
        found = measure(
            browser, default / PAGES["serving"], screenshots / "serving-default-layout.png"
        )
    assert any(p.startswith("code block 'kvsvc serve --listen 0.0.0.0:50051") for p in found), found
    assert any("breaks names across lines" in p for p in found), found
