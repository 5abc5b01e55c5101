"""Mutation testing with a curated set: does the suite catch the bugs that matter?

Each mutation of ``tools/mutations.toml`` is a realistic one- or two-line bug (a check
skipped, an id left unscoped, a journal row not replayed, a lease not checked). For each,
this script puts the bug into a temporary copy of the tree, runs only the tests the
mutation names, and counts it caught when they fail. It never touches the working tree.

    python tools/mutate.py              # every mutation (make mutate)
    python tools/mutate.py --list       # the set, without running anything
    python tools/mutate.py ID [ID ...]  # some of them

First the named tests run once on the unmutated copy: a mutation is only caught by tests
that pass without it. Exits 0 when every mutation run was caught, 1 when one survived (or
its tests errored before running: a mutation must give valid code), 2 when the set no
longer matches the code (a ``find`` text that is gone or not unique: update the
mutation along with the code it targets).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MUTATIONS = ROOT / "tools" / "mutations.toml"
# pytest's exit status when tests ran and some failed (2+: interrupted, usage, no tests).
TESTS_FAILED = 1
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutation:
    id: str
    area: str
    file: str
    # (find, replace) pairs applied in order: a bug is mostly one edit, sometimes two
    # places that must change together (``find``/``replace`` lists in the file).
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    why: str
    # The interpreter that runs the tests (relative to the tree: ".venv-vllm/bin/python"
    # for the vLLM tests; "" is the one running this script) and extra environment.
    python: str = ""
    env: tuple[tuple[str, str], ...] = ()


class StaleMutation(Exception):
    """A mutation whose ``find`` text is not exactly once in its file."""


def load(path: Path = MUTATIONS) -> list[Mutation]:
    with path.open("rb") as handle:
        entries = tomllib.load(handle)["mutation"]
    mutations = [
        Mutation(
            id=e["id"],
            area=e["area"],
            file=e["file"],
            edits=_edits(e),
            tests=tuple(e["tests"]),
            why=e["why"],
            python=e.get("python", ""),
            env=tuple(sorted(e.get("env", {}).items())),
        )
        for e in entries
    ]
    ids = [m.id for m in mutations]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise StaleMutation(f"{path}: ids used twice: {', '.join(duplicates)}")
    return mutations


def _edits(entry: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """An entry's ``find``/``replace``: two strings, or two lists of the same length."""
    finds, replaces = entry["find"], entry["replace"]
    if isinstance(finds, str) and isinstance(replaces, str):
        return ((finds, replaces),)
    if isinstance(finds, list) and isinstance(replaces, list) and len(finds) == len(replaces):
        return tuple(zip(finds, replaces, strict=True))
    raise StaleMutation(
        f"mutation {entry['id']}: find and replace must be two strings or two lists of "
        "the same length"
    )


def mutated_text(mutation: Mutation, root: Path) -> str:
    """The mutation's file under ``root`` with the bug in.

    Raises:
        StaleMutation: a ``find`` text is not exactly once in the file.
    """
    text = (root / mutation.file).read_text()
    for number, (find, replace) in enumerate(mutation.edits, 1):
        count = text.count(find)
        if count != 1:
            where = "is gone from" if count == 0 else f"occurs {count} times in"
            which = f"find text {number}" if len(mutation.edits) > 1 else "find text"
            raise StaleMutation(
                f"mutation {mutation.id}: its {which} {where} {mutation.file}; update "
                f"{MUTATIONS.relative_to(ROOT)} with the code"
            )
        text = text.replace(find, replace)
    return text


def copy_tree(destination: Path) -> None:
    """The working tree's files (tracked, and untracked ones git does not ignore)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if not source.is_file():  # deleted in the working tree, or a submodule
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def run_tests(
    copy: Path,
    tests: tuple[str, ...] | list[str],
    python: str = "",
    extra: tuple[tuple[str, str], ...] = (),
) -> tuple[int, float, str]:
    """pytest on ``tests`` in ``copy`` (its code first on the path, for the processes the
    tests spawn too); the exit status (-1: timed out), seconds and the output's tail."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "clients")]),
        **dict(extra),
    }
    interpreter = str(ROOT / python) if python else sys.executable
    args = [interpreter, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        result = subprocess.run(
            args, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - started, f"timed out after {TIMEOUT_S} s"
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
    return result.returncode, time.monotonic() - started, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the set and exit")
    args = parser.parse_args(argv)
    try:
        mutations = load()
        unknown = set(args.ids) - {m.id for m in mutations}
        if unknown:
            raise StaleMutation(f"no mutation named {', '.join(sorted(unknown))}")
        chosen = [m for m in mutations if not args.ids or m.id in args.ids]
        for mutation in chosen:
            mutated_text(mutation, ROOT)  # every one still applies, before anything runs
    except StaleMutation as exc:
        print(f"mutate: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.id}  [{m.area}] {m.file}\n    {m.why}\n    tests: {' '.join(m.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="kvsvc-mutate-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        # Once per interpreter and environment: the union of the tests named.
        baselines: dict[tuple[str, tuple[tuple[str, str], ...]], set[str]] = {}
        for m in chosen:
            baselines.setdefault((m.python, m.env), set()).update(m.tests)
        for (python, extra), tests in baselines.items():
            print(f"baseline: {len(tests)} test targets on the unmutated tree ...", flush=True)
            status, seconds, tail = run_tests(copy, sorted(tests), python, extra)
            if status != 0:
                print(f"mutate: the tests fail without any mutation ({seconds:.0f} s):\n{tail}")
                return 1
            print(f"baseline: passed ({seconds:.0f} s)", flush=True)
        caught = 0
        for number, mutation in enumerate(chosen, 1):
            path = copy / mutation.file
            original = path.read_text()
            path.write_text(mutated_text(mutation, copy))
            try:
                status, seconds, tail = run_tests(
                    copy, mutation.tests, mutation.python, mutation.env
                )
            finally:
                path.write_text(original)
            if status in (TESTS_FAILED, -1):
                caught += 1
                verdict = "caught" if status == TESTS_FAILED else "caught (timed out)"
            else:
                verdict = "SURVIVED" if status == 0 else f"ERROR (pytest exit {status})"
            print(f"[{number}/{len(chosen)}] {verdict:<9} {mutation.id} ({seconds:.0f} s)")
            if not verdict.startswith("caught"):
                print(f"    {mutation.why}\n    tests: {' '.join(mutation.tests)}")
                print("    " + tail.replace("\n", "\n    "))
    print(f"mutate: caught {caught}/{len(chosen)}")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
