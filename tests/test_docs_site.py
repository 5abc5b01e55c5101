"""The docs site's strict build (``make docs``, also run by ``make test``) fails on what it
must: a broken link, a missing anchor, a page left out of the navigation.

Each case builds a copy of the site (mkdocs.yml, docs/, README.md for the included quick
start) with one fault, by the command ``make docs`` runs.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.tooling import missing, require_tool

REPO = Path(__file__).resolve().parents[1]


def docs_command() -> list[str]:
    """The build ``make docs`` runs, its mkdocs taken from this interpreter's venv."""
    make = require_tool("make", "the docs target is read with `make -n` (apt-get install make)")
    done = subprocess.run(
        [make, "-n", "-C", str(REPO), "docs", "VENV=VENV"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (line,) = [line for line in done.stdout.splitlines() if "mkdocs build" in line]
    argv = shlex.split(line)
    assert argv[0] == "NO_MKDOCS_2_WARNING=1" and argv[1] == "VENV/bin/mkdocs"
    return argv[2:]


def test_the_build_is_strict_and_not_quiet() -> None:
    """--quiet hides the warnings --strict counts: with it, a broken link passes."""
    args = docs_command()
    assert args[:2] == ["build", "--strict"]
    assert "-q" not in args and "--quiet" not in args


def build(tmp_path: Path, *faults: str) -> subprocess.CompletedProcess[str]:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        missing("mkdocs", "the docs extra: pip install -e '.[docs]' (make venv installs it)")
    site = tmp_path / "repo"
    shutil.copytree(REPO / "docs", site / "docs")
    shutil.copy(REPO / "mkdocs.yml", site)
    shutil.copy(REPO / "README.md", site)
    with (site / "docs" / "plan.md").open("a") as page:
        if "link" in faults:
            page.write("\nSee [the nowhere page](nowhere.md).\n")
        if "anchor" in faults:
            page.write("\nSee [limits](serving.md#no-such-section).\n")
    if "orphan" in faults:
        (site / "docs" / "orphan.md").write_text("# Not in the navigation\n")
    if "snippet" in faults:
        readme = site / "README.md"
        readme.write_text(readme.read_text().replace("[start:quickstart]", "[start:moved]"))
    return subprocess.run(
        [str(mkdocs), *docs_command(), "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=site,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )


def test_a_broken_link_or_anchor_or_a_page_out_of_the_navigation_fails(tmp_path: Path) -> None:
    done = build(tmp_path, "link", "anchor", "orphan")
    assert done.returncode != 0, done.stderr
    for said in (
        "contains a link 'nowhere.md', but the target is not found",
        "does not contain an anchor '#no-such-section'",
        'are not included in the "nav" configuration:\n  - orphan.md',
    ):
        assert said in done.stderr, (said, done.stderr)


def test_a_quick_start_the_site_cannot_include_fails(tmp_path: Path) -> None:
    done = build(tmp_path, "snippet")
    assert done.returncode != 0 and "quickstart" in done.stderr, done.stderr


def test_the_site_as_it_is_builds(tmp_path: Path) -> None:
    done = build(tmp_path)
    assert done.returncode == 0, done.stderr
    quickstart = (tmp_path / "site" / "quickstart" / "index.html").read_text()
    assert "Then be the engine: save this as" in quickstart  # README's text, included
