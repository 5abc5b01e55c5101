"""The curated mutation set (``make mutate``) stays in step with the code: every mutation
still applies exactly once, gives code that compiles, and names tests that exist. The
mutations themselves are run by ``make mutate``, not here (a few minutes)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import pytest

from tests.tooling import load_script

REPO = Path(__file__).resolve().parents[1]


def _load_runner() -> ModuleType:
    return load_script("kvsvc_mutate", REPO / "tools" / "mutate.py")


RUNNER = _load_runner()
MUTATIONS = RUNNER.load()


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_the_mutation_still_applies_to_the_code_and_its_tests_exist(mutation: object) -> None:
    text = RUNNER.mutated_text(mutation, REPO)  # raises StaleMutation when it does not apply
    if mutation.file.endswith(".py"):  # type: ignore[attr-defined]
        compile(text, mutation.file, "exec")  # type: ignore[attr-defined]
    for target in mutation.tests:  # type: ignore[attr-defined]
        path, _, name = target.partition("::")
        assert (REPO / path).is_file(), f"{mutation.id}: no test file {path}"  # type: ignore[attr-defined]
        if name:
            assert name.split("[")[0] in _test_names(REPO / path), f"no test {target}"


def test_the_set_covers_the_areas_that_must_not_break_silently() -> None:
    areas = {m.area for m in MUTATIONS}
    assert {"auth", "namespaces", "journal", "leases"} <= areas


def test_a_stale_mutation_is_named(tmp_path: Path) -> None:
    (tmp_path / "kvsvc").mkdir()
    (tmp_path / "kvsvc" / "a.py").write_text("x = 1\nx = 1\n")
    twice = RUNNER.Mutation("m", "auth", "kvsvc/a.py", (("x = 1", "x = 2"),), (), "")
    with pytest.raises(RUNNER.StaleMutation, match="mutation m: its find text occurs 2 times"):
        RUNNER.mutated_text(twice, tmp_path)
    gone = RUNNER.Mutation(
        "m", "auth", "kvsvc/a.py", (("x = 1\nx = 1", "z = 1"), ("y = 1", "y = 2")), (), ""
    )
    with pytest.raises(RUNNER.StaleMutation, match=r"its find text 2 is gone from kvsvc/a\.py"):
        RUNNER.mutated_text(gone, tmp_path)


def test_the_baseline_is_dealt_over_the_workers_whole() -> None:
    targets = [f"t{i}" for i in range(7)]
    chunks = RUNNER.split(targets, 3)
    assert chunks == [["t0", "t3", "t6"], ["t1", "t4"], ["t2", "t5"]]
    assert RUNNER.split(targets[:2], 4) == [["t0"], ["t1"]]  # no worker without tests
    assert RUNNER.split(targets, 1) == [targets]
