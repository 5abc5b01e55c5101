""".ci/run installs the system packages the tests need without touching what a machine
already runs: no service of the install starts (a policy-rc.d denies it), and nothing is
stopped by name afterwards (a person's own Prometheus once was: `pkill -x prometheus`).

The install block is taken out of .ci/run and run by bash as it is written, with the
policy file in a temporary directory and an ``apt-get`` that asks the policy, as Debian's
maintainer scripts do (invoke-rc.d), whether it may start the package's service.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.tooling import require_tool

REPO = Path(__file__).resolve().parents[1]
CI_RUN = (REPO / ".ci" / "run").read_text(encoding="utf-8")
POLICY = "/usr/sbin/policy-rc.d"


def install_block() -> str:
    """.ci/run's lines from the policy file to the apt-get install and its cleanup."""
    start = CI_RUN.index(f"    policy={POLICY}\n")
    end = CI_RUN.index("  else\n", start)
    return CI_RUN[start:end]


def run_install(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    bash = require_tool("bash", ".ci/run is a bash script")
    policy = tmp_path / "policy-rc.d"
    asked = tmp_path / "asked"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    apt_get = fake_bin / "apt-get"
    # An install that starts prometheus when the policy allows it (exit 0 or missing),
    # as invoke-rc.d does; it records the policy's answer.
    apt_get.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = install ] || exit 0\n'
        f"if [ -x {shlex.quote(str(policy))} ]; then\n"
        f"  {shlex.quote(str(policy))} prometheus start; echo $? >>{shlex.quote(str(asked))}\n"
        f"else echo started >>{shlex.quote(str(asked))}; fi\n"
    )
    apt_get.chmod(0o755)
    script = (
        "set -euo pipefail\n"
        "need_apt=(prometheus redis-server)\n"
        + install_block().replace(POLICY, str(policy))
        + f'test -e {shlex.quote(str(policy))} && echo "policy kept" || echo "policy gone"\n'
    )
    done = subprocess.run(
        [bash, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": f"{fake_bin}:/usr/bin:/bin"},
    )
    return done, policy, asked


def test_the_install_starts_no_service_and_leaves_no_policy_behind(tmp_path: Path) -> None:
    done, policy, asked = run_install(tmp_path)
    assert done.returncode == 0, done.stderr
    assert asked.read_text().split() == ["101"]  # invoke-rc.d's "action forbidden"
    assert done.stdout.strip() == "policy gone" and not policy.exists()


def test_a_policy_that_was_there_is_kept(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    done, _, asked = run_install(tmp_path)
    assert done.returncode == 0, done.stderr
    assert asked.read_text().split() == ["101"]
    assert done.stdout.strip() == "policy kept" and policy.read_text() == "#!/bin/sh\nexit 101\n"


@pytest.mark.parametrize("command", ["pkill", "killall"])
def test_nothing_is_stopped_by_name(command: str) -> None:
    code = "\n".join(line.partition("#")[0] for line in CI_RUN.splitlines())
    assert not re.search(rf"(^|[\s;(|&]){re.escape(command)}", code), command


def test_ci_installs_the_browser_the_docs_layout_test_drives() -> None:
    from tests.docs_browser import CHROMIUM

    assert CHROMIUM == "/usr/bin/chromium"  # Debian's package's binary
    assert "command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)" in CI_RUN
