"""README.md's and docs/'s examples, run as they are written, so the pages a newcomer
follows cannot rot.

- README's quick start runs as real processes (server, two CPU agents, ``ctl``) and its
  Python client against them; the only edits are the address (a free port) and the
  server's ``/metrics`` port (any free one).
- The Python snippets of the docs pages run against a real server on a free port, or,
  where they need a GPU or vLLM, are parsed and their kvsvc imports checked.
- The ``kvsvc plan`` commands run from the repository root on the files in ``examples/``.
- Every ``kvsvc`` command line in README and the docs (code blocks and inline code) uses
  only flags its subcommand has, and the config-file example loads.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvsvc.server.config import PoolConfig
from tests.server.harness import running_server
from tests.tooling import missing

if TYPE_CHECKING:
    from kvsvc.demo.processes import Child

REPO = Path(__file__).resolve().parents[1]
README_ADDRESS = "127.0.0.1:50051"
# Every page a reader is sent to: README and the site's pages (mkdocs.yml's docs/).
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]


def page(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def section(title: str, name: str = "README.md") -> str:
    """The text of page ``name`` under the heading ``title``, up to the next heading of any
    level (a ``#`` line inside a code block is a comment, not a heading)."""
    out: list[str] = []
    inside, fenced = False, False
    for line in page(name).splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            if inside:
                break
            inside = line.rstrip("\n").split(" ", 1)[1] == title
            continue
        if inside:
            out.append(line)
    assert out, f"{name} has no section {title!r}"
    return "".join(out)


def code_blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of ``text`` in language ``lang`` ("" for a plain ``` block)."""
    blocks: list[str] = []
    body: list[str] | None = None  # the lines of the open fence
    keep = False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if body is None:
                body, keep = [], line[3:].strip() == lang
            else:
                if keep:
                    blocks.append("".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def run_snippet(code: str, address: str, timeout: float = 120) -> str:
    """Execute a page's code against ``address`` in a thread; return what it printed."""
    assert README_ADDRESS in code
    compiled = compile(code.replace(README_ADDRESS, address), "snippet", "exec")
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
    assert not thread.is_alive(), f"the snippet did not finish in {timeout}s"
    if errors:
        raise errors[0]
    return out.getvalue()


def printed_comment(code: str, call: str) -> str:
    """The ``# ...`` comment a page puts after a ``print(...)`` line, saying what it shows."""
    for line in code.splitlines():
        if line.strip().startswith(f"print({call}"):
            return line.partition("#")[2].strip()
    raise AssertionError(f"no print({call}...) in the snippet")


def shell_commands(block: str) -> list[str]:
    """The command lines of a ``sh`` block: continuations joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [c for line in joined.splitlines() if (c := line.partition("  #")[0].strip())]


# -- README's quick start, as a newcomer runs it ------------------------------------------


@pytest.mark.e2e
@pytest.mark.torch
def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The quick start's commands as real processes, then its client and `ctl usage`:
    each prints what the page says it prints. Then docs/state.md's "Moving a pool", which
    goes on in the same shell."""
    pytest.importorskip("torch")
    from kvsvc.demo.processes import spawn, stop_all, wait_for_ports

    text = section("Quick start: a server, two agents and a client in five minutes")
    start, finish = code_blocks(text, "sh")
    (client,) = code_blocks(text, "python")
    (usage_shown,) = code_blocks(text, "")
    commands = shell_commands(start)
    assert commands[0] == ". .venv/bin/activate"  # before the first bare `kvsvc`
    children: list[Child] = []
    address = README_ADDRESS
    try:
        for command in commands[1:]:
            argv = shlex.split(command)
            assert argv[0] == "kvsvc", command
            args = [a.replace(README_ADDRESS, address) for a in argv[1:] if a != "&"]
            if argv[1] == "serve":
                assert argv[-1] == "&"
                listen = args.index("--listen") + 1
                args[listen] = "127.0.0.1:0"
                args += ["--metrics-listen", "127.0.0.1:0"]
                children.append(spawn("serve", args))
                port, _ = wait_for_ports(children[-1])
                address = f"127.0.0.1:{port}"
            elif argv[-1] == "&":
                children.append(spawn(f"worker-{len(children)}", args))
            else:
                done = subprocess.run(
                    [sys.executable, "-m", "kvsvc", *args],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert done.returncode == 0, (done.stderr, [c.output() for c in children])
                if "wait-ready" in argv:
                    said = re.search(r"`wait-ready` prints `(.*?)`", " ".join(text.split()))
                    assert said and done.stdout.strip() == said.group(1)
        lines = run_snippet(client, address).splitlines()
        assert lines[0] == printed_comment(client, "r.num_cached_tokens") == "0 2003 126"
        assert lines[1] == printed_comment(client, "results[1]").split(":")[0] == "2000"
        assert lines[2].startswith(printed_comment(client, "results)").removesuffix("..."))
        assert "object at 0x" not in lines[2]
        # The lookup with the admission's salt hits; without it, nothing.
        assert lines[3] == printed_comment(client, "kv.lookup(other_prompt_ids, tenant)")
        assert lines[4] == printed_comment(client, "kv.lookup(other_prompt_ids))").split()[0]
        assert lines[5] == printed_comment(client, "batch.sequence") == "1 ['BlockStored']"
        assert len(lines) == 6
        usage, kill = shell_commands(finish)
        argv = [a.replace(README_ADDRESS, address) for a in shlex.split(usage)]
        done = subprocess.run(
            [sys.executable, "-m", "kvsvc", *argv[1:]], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == usage_shown.splitlines()
        # `kill %1 %2 %3`: one job per background process, each stops cleanly on SIGTERM.
        assert kill.split()[1:] == [f"%{i + 1}" for i in range(len(children))]
        # docs/state.md goes on from here: the pool moves to a new server, and its own
        # `kill` line stops what is left.
        move_the_pool_as_state_md_says(children, address, usage_shown, tmp_path)
    finally:
        stop_all(children)


def move_the_pool_as_state_md_says(
    jobs: list[Child], address: str, usage_shown: str, cwd: Path
) -> None:
    """docs/state.md's "Moving a pool" in the quick start's shell (``jobs``: its jobs, %1
    the server), line by line as written: snapshot, stop the server, restore the snapshot
    with no pool flags, and the agents come back to the pool with its cached blocks."""
    from kvsvc.demo.processes import spawn, wait_for_ports

    text = section("Moving a pool", "docs/state.md")
    (block,) = code_blocks(text, "sh")
    port = address.rpartition(":")[2]
    for command in shell_commands(block):
        argv = [a.replace(README_ADDRESS, address) for a in shlex.split(command)]
        if argv[0] in ("kill", "wait"):
            for job in argv[1:]:
                child = jobs[int(job.removeprefix("%")) - 1]
                if argv[0] == "kill":
                    child.process.send_signal(signal.SIGTERM)
                assert child.process.wait(30) == 0, child.output()
            continue
        assert argv[0] == "kvsvc", command
        if argv[-1] == "&":
            assert argv[1] == "serve" and "--restore" in argv
            # The quick start's address (the agents retry it); any free /metrics port.
            args = [*argv[1:-1], "--metrics-listen", "127.0.0.1:0"]
            assert args[args.index("--listen") + 1] == f"127.0.0.1:{port}"
            jobs.append(spawn("restored", args, cwd=cwd))
            assert wait_for_ports(jobs[-1])[0] == int(port)
            continue
        done = subprocess.run(
            [sys.executable, "-m", "kvsvc", *argv[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
        )
        assert done.returncode == 0, (done.stderr, [j.output() for j in jobs])
        if "usage" in argv:
            # "what it printed before the move": the quick start's usage, line for line.
            assert done.stdout.splitlines() == usage_shown.splitlines()
    assert "same 125 cached blocks" in " ".join(text.split())
    assert "cached blocks          125" in usage_shown


@pytest.mark.e2e
@pytest.mark.torch
def test_the_security_page_s_tls_session_runs_as_written(tmp_path: Path) -> None:
    """docs/security.md's mTLS block, line by line in one directory (its certificates),
    the server in the background as the page starts it: the line after it runs, every
    client presents the flags the page gives, and `kill` stops both jobs cleanly."""
    pytest.importorskip("torch")
    from kvsvc.demo.processes import spawn, stop_all, wait_for_ports
    from kvsvc.tools.devcerts import find_openssl

    if find_openssl() is None:
        missing("the openssl command line", "apt-get install openssl")
    (block,) = code_blocks(section("TLS", "docs/security.md"), "sh")
    jobs: list[Child] = []
    address = README_ADDRESS
    outputs: list[str] = []
    try:
        for command in shell_commands(block):
            argv = shlex.split(command)
            if argv[0] == "kill":
                assert argv[1:] == [f"%{i + 1}" for i in range(len(jobs))]
                for job in reversed(jobs):
                    assert job.stop(grace=30) == 0, job.output()
                continue
            if argv[:2] == ["python", "-m"]:
                argv = [sys.executable, *argv[1:]]
            else:
                assert argv[0] == "kvsvc", command
                argv = [sys.executable, "-m", *argv]
            argv = [a.replace(README_ADDRESS, address) for a in argv]
            if argv[-1] == "&":
                args = argv[3:-1]
                if args[0] == "serve":  # any free ports; the rest dial the one it took
                    args[args.index("--listen") + 1] = "127.0.0.1:0"
                    args += ["--metrics-listen", "127.0.0.1:0"]
                jobs.append(spawn(args[0], args, cwd=tmp_path))
                if args[0] == "serve":
                    address = f"127.0.0.1:{wait_for_ports(jobs[-1])[0]}"
                continue
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
            assert done.returncode == 0, (command, done.stderr, [j.output() for j in jobs])
            outputs.append(done.stdout)
    finally:
        stop_all(jobs)
    assert outputs[-2].startswith("pool 'llama' is READY: 1/1 ranks")
    assert "llama" in outputs[-1] and "READY" in outputs[-1]


def test_readme_has_a_deployment_section_pointing_at_its_page() -> None:
    """Deployment was reachable only from the docs list at the bottom of README."""
    text = section("Deployment")
    assert "[docs/deployment.md](docs/deployment.md)" in text
    for path in ("deploy/compose.yaml", "deploy/kubernetes/", "make images"):
        assert path in text, path
        if path.startswith("deploy/"):
            assert (REPO / path).exists(), path


def test_the_docs_site_shows_readme_s_quick_start() -> None:
    """docs/quickstart.md includes README's quick start (one text), between markers
    mkdocs' snippets extension finds, and the included part links nowhere (a link
    relative to README would be broken on the site, and the other way round)."""
    assert '--8<-- "README.md:quickstart"' in page("docs/quickstart.md")
    included = re.search(
        r"--8<-- \[start:quickstart\] -->\n(.*)<!-- --8<-- \[end:quickstart\]",
        page("README.md"),
        re.S,
    )
    assert included and "## Quick start" in page("README.md").partition(included.group(1))[0]
    assert "](" not in included.group(1)


# -- the docs pages' snippets ---------------------------------------------------------------


def test_the_cpu_agent_snippet_runs() -> None:
    pytest.importorskip("torch")
    text = section("The worker agent inside an engine", "docs/workers.md")
    (cpu,) = [b for b in code_blocks(text, "python") if 'device="cpu"' in b]
    assert "take_cuda_snapshot" not in cpu and "agent.stop()" in cpu
    # The serve command the page gives for it: the pool it names, world size 1.
    serve = re.search(
        r"`kvsvc serve --listen 127\.0\.0\.1:50051 --pool (\S+) --max-model-len (\d+)`",
        " ".join(text.split()),
    )
    assert serve, "the page names the server the CPU variant runs against"
    pool = PoolConfig(name=serve.group(1), world_size=1, max_model_len=int(serve.group(2)))
    with running_server(pool) as srv:
        printed = run_snippet(cpu, srv.address).strip()
    expected = re.search(r"# (16 \(.*?\)):", cpu)
    assert expected and printed == expected.group(1)


def python_blocks() -> Iterator[tuple[str, str]]:
    for name in PAGES:
        for block in code_blocks(page(name), "python"):
            yield name, block


@pytest.mark.parametrize(
    "name,code", list(python_blocks()), ids=[n for n, _ in python_blocks()]
)  # fmt: skip
def test_every_python_snippet_parses_and_imports_real_names(name: str, code: str) -> None:
    """Snippets that need a GPU or vLLM cannot run here: each at least parses, and every
    name it imports from kvsvc exists."""
    tree = ast.parse(code, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root not in ("kvsvc", "kvsvc_client"):
                continue
            if node.module.startswith("kvsvc.worker"):
                pytest.importorskip("torch")
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{name}: {node.module}.{alias.name}"


def plan_commands() -> list[str]:
    text = section("`kvsvc plan`: capacity planning without a GPU", "docs/plan.md")
    (block,) = code_blocks(text, "sh")
    return shell_commands(block)


@pytest.mark.parametrize("command", plan_commands())
def test_the_plan_commands_run_from_the_repository_root(command: str) -> None:
    argv = shlex.split(command)
    assert argv[:2] == ["kvsvc", "plan"]
    for flag in ("--model-config", "--spec-file"):
        if flag in argv:
            value = argv[argv.index(flag) + 1]
            if "/" in value:  # a file the page points at: it ships with the repository
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

    assert "(spec-files.md)" in section(
        "`kvsvc plan`: capacity planning without a GPU", "docs/plan.md"
    )
    doc = page("docs/spec-files.md")
    (example,) = code_blocks(doc, "json")
    specs = parse_spec_file(json.loads(example))
    assert {s.type_name for s in specs.values()} == {"sliding_window", "full_attention"}
    shipped = load_spec_file(REPO / "examples" / "specs.json")
    assert len(shipped) == 8
    # Every spec type there is is in the doc's table.
    from kvsvc.specs.kinds import SPEC_TYPES

    for name in SPEC_TYPES:
        assert f"`{name}`" in doc, name


def test_the_config_file_example_loads() -> None:
    from kvsvc.server.config import server_config_from_dict

    (example,) = code_blocks(section("Flags and the config file", "docs/serving.md"), "toml")
    config = server_config_from_dict(tomllib.loads(example))
    assert [p.name for p in config.pools] == ["llama"]


# -- every kvsvc command line names real flags ----------------------------------------------


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    """A parser's option strings, with those of its subcommands (``ctl pools --json``)."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options_of(sub)
    return found


def command_lines(text: str) -> Iterator[str]:
    """``kvsvc ...`` command lines of a page: in ``sh`` blocks, and in inline code that
    gives a flag (inline code without one may be a line kvsvc prints, like ``kvsvc
    serving on port P``)."""
    for block in code_blocks(text, "sh"):
        yield from (c for c in shell_commands(block) if c.startswith("kvsvc "))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`(kvsvc [a-z-]+[^`]*)`", prose):
        if " --" in span:
            yield " ".join(span.split())


def documented_commands() -> list[tuple[str, str]]:
    return [(name, line) for name in PAGES for line in command_lines(page(name))]


@pytest.mark.parametrize(
    "name,line", documented_commands(), ids=[f"{n}:{c[:60]}" for n, c in documented_commands()]
)  # fmt: skip
def test_every_documented_command_uses_flags_it_has(name: str, line: str) -> None:
    from kvsvc.cli import build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    command = line.split()[1]
    assert command in subparsers.choices, f"{name}: `{line}`: no command {command!r}"
    known = options_of(subparsers.choices[command])
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line))
    assert flags <= known, f"{name}: `{line}`: {sorted(flags - known)} not in kvsvc {command}"


def test_the_vllm_page_s_ipc_endpoint_rule_is_the_server_s() -> None:
    """The page's example: one pool publishes on the ipc:// path as given; only later pools
    get ``_<pool>`` appended (the walk-through found "is appended" imprecise)."""
    from kvsvc.server.config import ServerConfig
    from kvsvc.server.kv_events_targets import kv_events_targets

    text = " ".join(section("KV events in vLLM's format", "docs/vllm.md").split())
    example = re.search(r"publishes on `(ipc://\S+)` itself, not `(ipc://\S+)`", text)
    assert example, "the page gives the one-pool example"
    given, suffixed = example.groups()
    one = ServerConfig(pools=(PoolConfig(name="llama"),), kv_events_zmq=given)
    assert [t.endpoint for t in kv_events_targets(one)] == [given]
    assert suffixed == f"{given}_llama"
    two = ServerConfig(pools=(PoolConfig(name="a"), PoolConfig(name="b")), kv_events_zmq=given)
    assert [t.endpoint for t in kv_events_targets(two)] == [given, f"{given}_b"]
