"""Starting the server and worker agents as real child processes (demo, e2e tests, benches).

Children are started with ``python -m kvsvc ...`` and their own process group, so a
Ctrl-C in the terminal reaches the parent only and the parent stops them in order
(workers first, then the server), each with SIGTERM and a grace period, then SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PORT_LINE = re.compile(r"^kvsvc serving on port (\d+)(?:, metrics on port (\d+))?$")


@dataclass
class Child:
    """A child process whose output is kept (last lines) for error messages."""

    name: str
    process: subprocess.Popen[str]
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    _reader: threading.Thread | None = None
    echo: bool = False

    def start_reader(self) -> None:
        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                if self.echo:
                    print(f"[{self.name}] {line}", end="", file=sys.stderr)

        self._reader = threading.Thread(target=read, name=f"{self.name}-output", daemon=True)
        self._reader.start()

    def output(self) -> str:
        return "\n".join(self.lines)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 5.0) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._reader is not None:
            self._reader.join(2)
        return self.process.returncode


def spawn(
    name: str,
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    echo: bool = False,
    cwd: Path | None = None,
) -> Child:
    """Start ``python -m kvsvc <args>`` (in ``cwd``, default this process's) with merged
    stdout/stderr captured."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,  # our Ctrl-C is ours to handle; children get SIGTERM
        cwd=str(cwd or Path.cwd()),
    )
    child = Child(name, process, echo=echo)
    child.start_reader()
    return child


def wait_for_ports(server: Child, timeout: float = 30.0) -> tuple[int, int]:
    """Wait for the server's 'serving on port' line; returns (grpc port, metrics port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(server.lines):
            match = _PORT_LINE.search(line)
            if match:
                return int(match.group(1)), int(match.group(2) or 0)
        if not server.alive():
            server.stop()  # joins the reader: every line the server wrote is in
            output = server.output().strip()
            # One line (a port in use, a bad TLS file) reads best on the same line.
            sep = " " if output and "\n" not in output else "\n"
            raise RuntimeError(
                f"the server exited with status {server.process.returncode}:{sep}{output}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"the server did not start within {timeout:.0f}s:\n{server.output()}")


def stop_all(children: Sequence[Child], grace: float = 5.0) -> None:
    """Stop workers before the server (the server's stop is quicker without streams)."""
    for child in reversed(children):
        child.stop(grace)
