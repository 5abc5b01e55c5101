"""Config-file keys as `kvsvc serve --config` reads them (issue 22, item 13)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.demo.processes import spawn, wait_for_ports
from tests.tooling import free_port

pytestmark = pytest.mark.e2e


def test_metrics_listen_off_in_a_config_file_is_no_endpoint(tmp_path: Path) -> None:
    """``--metrics-listen off`` worked; the same value in a file was refused as an
    address."""
    config = tmp_path / "kvsvc.toml"
    config.write_text(
        'listen = "127.0.0.1:0"\nmetrics_listen = "off"\n\n'
        '[[pools]]\nname = "p"\nmax_model_len = 256\n'
    )
    server = spawn("server", ["serve", "--config", str(config)])
    try:
        port, metrics_port = wait_for_ports(server, timeout=60)
    finally:
        server.stop()
    assert port > 0 and metrics_port == 0, server.output()


def test_flags_win_over_the_config_file(tmp_path: Path) -> None:
    """``kvsvc serve --config f.toml --listen X --metrics-listen Y`` serves on X and Y,
    whatever the file says (the file's values are the defaults the flags change)."""
    config = tmp_path / "kvsvc.toml"
    config.write_text(
        'listen = "127.0.0.1:0"\nmetrics_listen = "off"\n\n'
        '[[pools]]\nname = "p"\nmax_model_len = 256\n'
    )
    port = free_port()
    server = spawn("server", [
        "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0",
    ])  # fmt: skip
    try:
        served, metrics_port = wait_for_ports(server, timeout=60)
    finally:
        server.stop()
    assert served == port and metrics_port > 0, server.output()


def test_the_unknown_key_message_lists_hash_seed_file(tmp_path: Path) -> None:
    config = tmp_path / "kvsvc.toml"
    config.write_text('[[pools]]\nname = "p"\nhash_seed_fil = "seed"\n')
    result = subprocess.run(
        [sys.executable, "-m", "kvsvc", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "pools[0]: unknown key(s) hash_seed_fil; valid: " in line
    valid = line.split("valid: ", 1)[1].split(", ")
    assert "hash_seed_file" in valid and "hash_seed" in valid and "max_pool_tokens" in valid
