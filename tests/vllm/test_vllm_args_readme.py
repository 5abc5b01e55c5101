"""The GPU page's ``vllm serve MODEL ... $(kvsvc vllm-args ...)`` line (docs/vllm.md,
"On a GPU"), expanded by bash as written, into vLLM's own ``vllm serve`` parser.

Serving a model for real needs a GPU (the CPU recipe, which runs vLLM's server for real,
is ``test_vllm_recipes.py``'s). Here ``vllm`` on the PATH hands its argv to vLLM's own
``vllm serve`` argument parser and engine arguments (what ``vllm serve`` builds the engine
from) and prints what vLLM received; ``kvsvc`` on the PATH is this checkout's CLI. The
scheduler class, worker class and kvsvc settings vLLM ends up with must be the ones the
line asked for: the shell's word splitting of ``$(...)`` must not break them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.integrations.vllm import settings_from_additional_config, vllm_kwargs
from tests.test_readme import code_blocks, section
from tests.vllm.helpers import write_tiny_model

pytestmark = pytest.mark.e2e

# What `vllm serve` does with its argv up to building the engine, minus the engine.
STAND_IN = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args(sys.argv[1:])
args.model = args.model_tag  # as ServeSubcommand.cmd does
engine = AsyncEngineArgs.from_cli_args(args)
print(json.dumps({
    "model": engine.model,
    "block_size": engine.block_size,
    "scheduler_cls": engine.scheduler_cls,
    "worker_cls": engine.worker_cls,
    "additional_config": engine.additional_config,
}))
"""


def test_readmes_vllm_serve_line_gives_vllm_the_pool(tmp_path: Path) -> None:
    blocks = code_blocks(section("On a GPU", "docs/vllm.md"), "sh")
    (line,) = [
        command.strip()
        for block in blocks
        for command in block.splitlines()
        if command.startswith("vllm serve")
    ]
    assert "$(kvsvc vllm-args" in line and '"$(' not in line  # unquoted, as users type it
    # The line's MODEL, a local model directory (vLLM resolves the model's path).
    write_tiny_model(tmp_path / "MODEL")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    for name, command in (
        ("vllm", f'exec "{sys.executable}" "{tmp_path}/stand_in.py" "$@"'),
        ("kvsvc", f'exec "{sys.executable}" -m kvsvc "$@"'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{command}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VLLM_CONFIGURE_LOGGING": "0"}
    done = subprocess.run(
        ["bash", "-O", "failglob", "-c", line],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    want = vllm_kwargs("127.0.0.1:50051", "vllm")
    assert (got["model"], got["block_size"]) == ("MODEL", 32)  # the line's own flags
    assert got["scheduler_cls"] == want["scheduler_cls"]
    assert got["worker_cls"] == want["worker_cls"]
    assert got["additional_config"] == want["additional_config"]
    settings = settings_from_additional_config(got["additional_config"])
    assert (settings.server, settings.pool) == ("127.0.0.1:50051", "vllm")
