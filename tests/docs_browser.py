"""Headless Chromium driven over its DevTools protocol, for looking at the docs site the way
a reader's browser lays it out (tests/test_docs_layout.py).

The protocol runs over a pipe (``--remote-debugging-pipe``: the browser reads JSON
messages, each ended by a NUL byte, on its fd 3 and writes on its fd 4), so it needs
nothing beyond the standard library: no WebSocket client, no browser-automation package.
Only the few commands the layout test uses are wrapped.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

# Debian's package (`apt-get install chromium`), where .ci/run installs it.
CHROMIUM = "/usr/bin/chromium"
# What the browser may do besides rendering the page it is given: nothing (a fresh
# profile, no GPU, no background fetches, no sandbox since CI runs as root).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    """The Chromium binary (Debian's path, else one on PATH), or None."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or stopped."""


class Chromium:
    """One headless browser with one page, at a fixed viewport.

    Example::

        with Chromium(find_chromium(), width=1280, height=800) as browser:
            browser.open("file:///.../site/index.html")
            widths = browser.evaluate("document.body.scrollWidth")
            png = browser.screenshot()
    """

    def __init__(self, binary: str, *, width: int, height: int, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="kvsvc-chromium-")
        # Its own log goes to a file: a pipe nobody reads while it runs could fill and
        # stall it.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        to_browser, self._write_fd = os.pipe()
        self._read_fd, from_browser = os.pipe()
        # fd 3: what the browser reads, fd 4: what it writes (its protocol's convention).
        self._process = subprocess.Popen(
            [
                "bash",
                "-c",
                f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser}',
                binary,
                *FLAGS,
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(to_browser, from_browser),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        try:
            target = self._command("Target.createTarget", url="about:blank")["targetId"]
            self._session = self._command("Target.attachToTarget", targetId=target, flatten=True)[
                "sessionId"
            ]
            self.command("Page.enable")
            self.command(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    # -- the protocol ------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError("the browser did not answer in time")
            chunk = os.read(self._read_fd, 1 << 16)
            if not chunk:
                self._log.seek(0)
                log = self._log.read().decode(errors="replace")
                raise BrowserError(f"the browser stopped: {log[-2000:]}")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)  # type: ignore[no-any-return]

    def _command(self, method: str, session: str | None = None, **params: Any) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        self._send(message)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def command(self, method: str, **params: Any) -> Any:
        """One DevTools command on the page; its result."""
        return self._command(method, self._session, **params)

    def _wait_for(self, method: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    del self._events[: i + 1]
                    return
            self._events.append(self._receive(deadline))

    # -- what the test uses --------------------------------------------------------------

    def open(self, url: str) -> None:
        """Load ``url`` and wait for its load event and its web fonts."""
        self._events.clear()
        self.command("Page.navigate", url=url)
        self._wait_for("Page.loadEventFired")
        self.evaluate("document.fonts.ready.then(() => true)", await_promise=True)

    def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.command(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=await_promise,
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, *, full_page: bool = True) -> None:
        """A PNG of the page (the whole page's height with ``full_page``)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width, height = self.evaluate(
                "[document.documentElement.clientWidth, document.documentElement.scrollHeight]"
            )
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.command("Page.captureScreenshot", **params)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            if self._process.poll() is None:
                with contextlib.suppress(BrowserError, OSError, ValueError):
                    self._command("Browser.close")
                try:
                    self._process.wait(10)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait(10)
        finally:
            for fd in (self._write_fd, self._read_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._log.close()
            self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
