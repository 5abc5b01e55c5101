"""``python -m kvsvc.tools.devcerts``'s command line: the server's names given as the
security page writes them (``--san a b``) or repeated (``--san a --san b``)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tooling import require_tool

REPO = Path(__file__).resolve().parents[1]


def server_names(directory: Path) -> str:
    openssl = require_tool("openssl", "devcerts makes its certificates with it")
    done = subprocess.run(
        [openssl, "x509", "-in", str(directory / "server.crt"), "-noout", "-text"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    (names,) = re.findall(r"X509v3 Subject Alternative Name:.*?\n\s*(.*)\n", done.stdout)
    return names.strip()


def devcerts(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    require_tool("openssl", "devcerts makes its certificates with it")
    return subprocess.run(
        [sys.executable, "-m", "kvsvc.tools.devcerts", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_the_security_page_s_command_names_every_san(tmp_path: Path) -> None:
    page = (REPO / "docs" / "security.md").read_text(encoding="utf-8")
    (command,) = re.findall(r"^python -m kvsvc\.tools\.devcerts .*$", page, re.M)
    argv = shlex.split(command)[3:]
    done = devcerts(argv, tmp_path)
    assert done.returncode == 0, done.stderr
    sans = argv[argv.index("--san") + 1 :]
    assert sans == ["localhost", "127.0.0.1"]
    assert server_names(tmp_path / argv[0]) == "DNS:localhost, IP Address:127.0.0.1"


@pytest.mark.parametrize(
    "flags",
    [["--san", "kvsvc.example", "10.1.2.3"], ["--san", "kvsvc.example", "--san", "10.1.2.3"]],
    ids=["one --san, two names", "--san repeated"],
)
def test_names_after_one_san_or_repeated_sans_are_the_same(
    tmp_path: Path, flags: list[str]
) -> None:
    done = devcerts(["certs", *flags], tmp_path)
    assert done.returncode == 0, done.stderr
    assert server_names(tmp_path / "certs") == "DNS:kvsvc.example, IP Address:10.1.2.3"


def test_no_san_takes_the_local_names(tmp_path: Path) -> None:
    done = devcerts(["certs"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert server_names(tmp_path / "certs") == (
        "DNS:localhost, IP Address:127.0.0.1, IP Address:0:0:0:0:0:0:0:1"
    )
