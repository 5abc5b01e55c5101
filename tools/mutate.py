"""Mutation testing with a curated set: does the suite catch the bugs that matter?

Each mutation of ``tools/mutations.toml`` is a realistic one- or two-line bug (a check
skipped, an id left unscoped, a journal row not replayed, a lease not checked). For each,
this script puts the bug into a temporary copy of the tree, runs only the tests the
mutation names, and counts it caught when they fail. It never touches the working tree.

    python tools/mutate.py              # every mutation (make mutate)
    python tools/mutate.py --list       # the set, without running anything
    python tools/mutate.py ID [ID ...]  # some of them
    python tools/mutate.py --jobs 1     # one at a time (default: one per CPU, at most 4)

First the named tests run once on the unmutated copy: a mutation is only caught by tests
that pass without it. Mutations run in parallel, one per worker, each worker with its
own copy of the tree (made once, reused for every mutation it runs: the mutated file is
put back after each), so two never share files; the tests take free ports and their own
temporary directories, so they do not meet either.

Exits 0 when every mutation run was caught, 1 when one survived (or its tests errored
before running: a mutation must give valid code), 2 when the set no longer matches the
code (a ``find`` text that is gone or not unique: update the
mutation along with the code it targets).
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MUTATIONS = ROOT / "tools" / "mutations.toml"
# pytest's exit status when tests ran and some failed (2+: interrupted, usage, no tests).
TESTS_FAILED = 1
TIMEOUT_S = 600
# Workers by default: one per CPU, at most this many (each runs a pytest at a time).
MAX_DEFAULT_JOBS = 4


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
        # The copy has no compiled core (kvsvc/_compiled is not in git): the mutated
        # source is what runs. Said outright, so a build that travels along cannot hide it.
        "KVSVC_PURE_PYTHON": "1",
        **dict(extra),
    }
    interpreter = str(ROOT / python) if python else sys.executable
    # cloudcoil's pytest plugin (Kubernetes test clusters, for tests/deploy) costs ~0.8 s
    # of CPU at every start, once per mutation: none of the named tests uses it.
    args = [interpreter, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    args += ["-p", "no:cloudcoil", *tests]
    started = time.monotonic()
    try:
        result = subprocess.run(
            args, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - started, f"timed out after {TIMEOUT_S} s"
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
    return result.returncode, time.monotonic() - started, tail


def split(targets: Sequence[str], parts: int) -> list[list[str]]:
    """``targets`` dealt round-robin into at most ``parts`` non-empty lists."""
    chunks: list[list[str]] = [[] for _ in range(max(1, min(parts, len(targets))))]
    for i, target in enumerate(targets):
        chunks[i % len(chunks)].append(target)
    return chunks


class Copies:
    """One copy of the tree per worker, lent out one at a time."""

    def __init__(self, base: Path, count: int) -> None:
        self._free: queue.Queue[Path] = queue.Queue()
        for i in range(count):
            copy = base / f"w{i}"
            copy.mkdir()
            copy_tree(copy)
            self._free.put(copy)

    def take(self) -> Path:
        return self._free.get()

    def give_back(self, copy: Path) -> None:
        self._free.put(copy)


def run_mutation(copies: Copies, mutation: Mutation) -> tuple[str, float, str]:
    """Put ``mutation`` into a free copy, run its tests, put the file back; the verdict,
    seconds and the output's tail."""
    copy = copies.take()
    path = copy / mutation.file
    original = path.read_text()
    try:
        path.write_text(mutated_text(mutation, copy))
        status, seconds, tail = run_tests(copy, mutation.tests, mutation.python, mutation.env)
    finally:
        path.write_text(original)
        copies.give_back(copy)
    if status in (TESTS_FAILED, -1):
        return ("caught" if status == TESTS_FAILED else "caught (timed out)"), seconds, tail
    return ("SURVIVED" if status == 0 else f"ERROR (pytest exit {status})"), seconds, tail


def run_baselines(copies: Copies, jobs: int, chosen: Sequence[Mutation]) -> bool:
    """The tests the mutations name, on the unmutated tree (per interpreter and
    environment, split over the workers); False, having said why, when one fails."""
    groups: dict[tuple[str, tuple[tuple[str, str], ...]], set[str]] = {}
    for m in chosen:
        groups.setdefault((m.python, m.env), set()).update(m.tests)

    def run(python: str, extra: tuple[tuple[str, str], ...], tests: list[str]) -> Any:
        copy = copies.take()
        try:
            return run_tests(copy, tests, python, extra)
        finally:
            copies.give_back(copy)

    for (python, extra), tests in groups.items():
        print(f"baseline: {len(tests)} test targets on the unmutated tree ...", flush=True)
        started = time.monotonic()
        chunks = split(sorted(tests), jobs)
        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(run, [python] * len(chunks), [extra] * len(chunks), chunks))
        for status, _, tail in results:
            if status != 0:
                print(f"mutate: the tests fail without any mutation:\n{tail}")
                return False
        print(f"baseline: passed ({time.monotonic() - started:.0f} s)", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the set and exit")
    parser.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=min(os.cpu_count() or 1, MAX_DEFAULT_JOBS),
        help=f"mutations run at once (default: one per CPU, at most {MAX_DEFAULT_JOBS})",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
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

    jobs = min(args.jobs, len(chosen)) or 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvsvc-mutate-") as tmp:
        copies = Copies(Path(tmp), jobs)
        if not run_baselines(copies, jobs, chosen):
            return 1
        caught = 0
        done = 0
        lock = threading.Lock()

        def report(mutation: Mutation) -> None:
            nonlocal caught, done
            verdict, seconds, tail = run_mutation(copies, mutation)
            with lock:
                done += 1
                caught += verdict.startswith("caught")
                print(f"[{done}/{len(chosen)}] {verdict:<9} {mutation.id} ({seconds:.0f} s)")
                if not verdict.startswith("caught"):
                    print(f"    {mutation.why}\n    tests: {' '.join(mutation.tests)}")
                    print("    " + tail.replace("\n", "\n    "))
                sys.stdout.flush()

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(report, chosen))
    print(
        f"mutate: caught {caught}/{len(chosen)} "
        f"({time.monotonic() - started:.0f} s, {jobs} at a time)"
    )
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
