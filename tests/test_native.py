"""The two builds of the core (kvsvc.native): which one a process loads, and when it must
refuse the compiled one (switched off, built for another Python, older than its sources)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvsvc.native as native
from kvsvc.tools import compile_core
from tests.tooling import missing

REPO = Path(__file__).resolve().parents[1]
WHICH = (
    "import kvsvc.core.pool as pool, kvsvc.native as n; "
    "print(n.BUILD, pool.__file__, n.describe(), sep='\\n')"
)


def loaded(env: dict[str, str]) -> tuple[str, str, str]:
    """(build, the file kvsvc.core.pool came from, the describe() line) in a new process."""
    base = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", WHICH],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    build, file, line = done.stdout.splitlines()
    return build, file, line


def require_compiled_build() -> None:
    if not (native.COMPILED_DIR / native.MANIFEST_NAME).is_file():
        missing("the compiled core", "make venv builds it with mypyc (needs a C compiler)")


def test_the_compiled_build_is_loaded_unless_switched_off() -> None:
    require_compiled_build()
    build, file, line = loaded({})
    assert build == "mypyc" and line.startswith("core build: mypyc")
    assert Path(file).is_relative_to(native.COMPILED_DIR) and file.endswith(".so")
    for switch in ("1", "yes"):
        build, file, line = loaded({native.PURE_ENV: switch})
        assert build == "pure" and file == str(REPO / "kvsvc" / "core" / "pool.py")
        assert line == f"core build: pure Python ({native.PURE_ENV}={switch})"
    # "0" (or empty) does not switch it off.
    assert loaded({native.PURE_ENV: "0"})[0] == "mypyc"


def test_every_selected_source_is_compiled() -> None:
    """What compile_core selects is what the manifest lists and the loader finds."""
    require_compiled_build()
    manifest = json.loads((native.COMPILED_DIR / native.MANIFEST_NAME).read_text())
    sources = [str(path) for path in compile_core.compiled_sources()]
    assert sorted(manifest["sources"]) == sources
    assert "kvsvc/core/pool.py" in sources and "kvsvc/core/__init__.py" not in sources
    modules = {name for name in native._extension_files(native.COMPILED_DIR) if "." in name}
    assert modules == {source.removesuffix(".py").replace("/", ".") for source in sources}


@pytest.fixture
def fake_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package root with one source and a compiled folder whose manifest matches it."""
    source = tmp_path / "kvsvc" / "core" / "thing.py"
    source.parent.mkdir(parents=True)
    source.write_text("X = 1\n")
    compiled = tmp_path / "kvsvc" / native.COMPILED_DIR_NAME
    (compiled / "kvsvc" / "core").mkdir(parents=True)
    suffix = native.importlib.machinery.EXTENSION_SUFFIXES[0]
    (compiled / "kvsvc" / "core" / f"thing{suffix}").write_bytes(b"")
    (compiled / f"group__mypyc{suffix}").write_bytes(b"")
    manifest = {
        "python": sys.implementation.cache_tag,
        "sources": {"kvsvc/core/thing.py": native.source_digest(source)},
    }
    (compiled / native.MANIFEST_NAME).write_text(json.dumps(manifest))
    monkeypatch.setattr(native, "PACKAGE_ROOT", tmp_path / "kvsvc")
    monkeypatch.setattr(native, "COMPILED_DIR", compiled)
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    return tmp_path


def test_a_matching_build_is_chosen(fake_build: Path) -> None:
    reason, files = native._choose()
    assert reason == "compiled modules loaded"
    assert set(files) == {"kvsvc.core.thing", "group__mypyc"}


def test_a_build_older_than_its_source_is_refused_with_a_warning(fake_build: Path) -> None:
    (fake_build / "kvsvc" / "core" / "thing.py").write_text("X = 2\n")
    with pytest.warns(RuntimeWarning, match=r"older than kvsvc/core/thing.py.*make compiled"):
        reason, files = native._choose()
    assert files == {} and reason.startswith("stale (kvsvc/core/thing.py")


def test_a_build_for_another_python_is_refused(fake_build: Path) -> None:
    manifest_path = fake_build / "kvsvc" / native.COMPILED_DIR_NAME / native.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["python"] = "cpython-30"
    manifest_path.write_text(json.dumps(manifest))
    reason, files = native._choose()
    assert files == {} and reason == f"built for cpython-30, not {sys.implementation.cache_tag}"


def test_no_build_and_the_switch_are_pure(
    fake_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native._choose() == (f"{native.PURE_ENV}=1", {})
    monkeypatch.delenv(native.PURE_ENV)
    (fake_build / "kvsvc" / native.COMPILED_DIR_NAME / native.MANIFEST_NAME).unlink()
    reason, files = native._choose()
    assert files == {} and reason.startswith("not built")


def test_without_a_c_compiler_the_build_says_so_and_the_core_stays_pure(tmp_path: Path) -> None:
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc")}

    def build(ci: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvsvc.tools.compile_core"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "CI": ci},
            cwd=tmp_path,
        )

    done = build("false")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "notice: no C compiler found (CC or cc): the core stays pure Python "
        "(install gcc, then make compiled)"
    ]
    # In CI the compiled build is the one tested: a missing compiler fails.
    assert build("true").returncode == 1
