"""README.md's examples, run as they are written, so the page a newcomer follows cannot rot.

The Python snippets are taken out of README.md and executed against a real server on a
free port (the only edit: the address); the ``kvsvc plan`` commands run from the
repository root on the files in ``examples/``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvsvc.server.config import PoolConfig
from tests.server.harness import bring_up, running_server

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
README_ADDRESS = "127.0.0.1:50051"


def section(title: str) -> str:
    """The README text under the heading ``title``, up to the next heading of any level
    (a ``#`` line inside a code block is a comment, not a heading)."""
    lines = README.splitlines(keepends=True)
    out: list[str] = []
    inside, fenced = False, False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            if inside:
                break
            inside = line.rstrip("\n").split(" ", 1)[1] == title
            continue
        if inside:
            out.append(line)
    assert out, f"README has no section {title!r}"
    return "".join(out)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def run_snippet(code: str, address: str, timeout: float = 120) -> str:
    """Execute README code against ``address`` in a thread; return what it printed."""
    assert README_ADDRESS in code
    compiled = compile(code.replace(README_ADDRESS, address), "README.md", "exec")
    out = io.StringIO()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with contextlib.redirect_stdout(out):
                exec(compiled, {"__name__": "readme"})
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the README snippet did not finish in {timeout}s"
    if errors:
        raise errors[0]
    return out.getvalue()


def printed_comment(code: str, call: str) -> str:
    """The ``# ...`` comment README puts after a ``print(...)`` line, saying what it shows."""
    for line in code.splitlines():
        if line.strip().startswith(f"print({call}"):
            return line.partition("#")[2].strip()
    raise AssertionError(f"no print({call}...) in the snippet")


def test_the_client_snippet_runs_and_prints_what_it_says() -> None:
    (code,) = [b for b in code_blocks(section("Running it by hand"), "python") if "kv." in b]
    pool = PoolConfig(name="llama", world_size=1, max_model_len=4096)
    with running_server(pool) as srv:
        ranks = bring_up(srv, pool="llama", kv_cache_bytes=32 << 20)
        try:
            lines = run_snippet(code, srv.address).splitlines()
        finally:
            for rank in ranks:
                rank.close()
    first = printed_comment(code, "r.num_cached_tokens")
    assert lines[0] == first == "0 2003 126"
    assert lines[1] == printed_comment(code, "results[1]").split(":")[0] == "2000"
    assert lines[2].startswith(printed_comment(code, "results)").removesuffix("..."))
    assert "object at 0x" not in lines[2]
    # The lookup with the admission's salt hits; without it, nothing (the trap).
    assert lines[3] == printed_comment(code, "kv.lookup(other_prompt_ids, tenant)") == "2000"
    assert lines[4] == printed_comment(code, "kv.lookup(other_prompt_ids))").split()[0] == "0"
    assert lines[5] == printed_comment(code, "batch.sequence") == "1 ['BlockStored']"
    assert len(lines) == 6


def test_the_cpu_agent_snippet_runs() -> None:
    pytest.importorskip("torch")
    blocks = code_blocks(section("The worker agent inside an engine"), "python")
    (cpu,) = [b for b in blocks if 'device="cpu"' in b]
    assert "take_cuda_snapshot" not in cpu and "agent.stop()" in cpu
    # The serve command README gives for it: the pool it names, world size 1.
    prose = " ".join(section("The worker agent inside an engine").split())
    serve = re.search(r"`kvsvc serve --listen 127\.0\.0\.1:50051 --pool (\S+) "
                      r"--max-model-len (\d+)`", prose)  # fmt: skip
    assert serve, "README names the server the CPU variant runs against"
    pool = PoolConfig(name=serve.group(1), world_size=1, max_model_len=int(serve.group(2)))
    with running_server(pool) as srv:
        printed = run_snippet(cpu, srv.address).strip()
    expected = re.search(r"# (16 \(.*?\)):", cpu)
    assert expected and printed == expected.group(1)


def test_the_gpu_agent_snippet_is_valid_python_using_real_names() -> None:
    pytest.importorskip("torch")
    blocks = code_blocks(section("The worker agent inside an engine"), "python")
    (gpu,) = [b for b in blocks if "take_cuda_snapshot()" in b]
    tree = ast.parse(gpu, "README.md")
    import kvsvc.specs
    import kvsvc.worker

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = {"kvsvc.worker": kvsvc.worker, "kvsvc.specs": kvsvc.specs}[node.module]
            for alias in node.names:
                assert hasattr(module, alias.name), alias.name
    assert "agent.stop()" in gpu and "layer_specs = " in gpu


def plan_commands() -> list[str]:
    text = section("`kvsvc plan`: capacity planning without a GPU")
    (block,) = code_blocks(text, "sh")
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.parametrize("command", plan_commands())
def test_the_plan_commands_run_from_the_repository_root(command: str) -> None:
    argv = shlex.split(command)
    assert argv[:2] == ["kvsvc", "plan"]
    for flag in ("--model-config", "--spec-file"):
        if flag in argv:
            value = argv[argv.index(flag) + 1]
            if "/" in value:  # a file README points at: it ships with the repository
                assert (REPO / value).is_file(), value
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    if "--json" in argv:
        assert json.loads(done.stdout)["num_blocks"] > 0
    else:
        assert "Max concurrency:" in done.stdout


def test_the_spec_file_format_is_documented_with_an_example_that_loads() -> None:
    from kvsvc.models import load_spec_file, parse_spec_file

    assert "docs/spec-files.md" in section("`kvsvc plan`: capacity planning without a GPU")
    doc = (REPO / "docs" / "spec-files.md").read_text(encoding="utf-8")
    (example,) = code_blocks(doc, "json")
    specs = parse_spec_file(json.loads(example))
    assert {s.type_name for s in specs.values()} == {"sliding_window", "full_attention"}
    shipped = load_spec_file(REPO / "examples" / "specs.json")
    assert len(shipped) == 8
    # Every spec type there is is in the doc's table.
    from kvsvc.specs.kinds import SPEC_TYPES

    for name in SPEC_TYPES:
        assert f"`{name}`" in doc, name
