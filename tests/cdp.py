"""A small Chrome DevTools Protocol client for the report's browser test: starts the operating
system's headless Chromium, loads a page, collects JavaScript console errors and exceptions,
evaluates expressions and takes a full-page screenshot. One websocket (websocket-client) in
flattened session mode (Target.attachToTarget with flatten=true), synchronous, no browser download.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--hide-scrollbars", "--remote-debugging-port=0", "--remote-allow-origins=*"]


def chromium_path() -> str | None:
    """The Chromium executable (Debian's chromium package), or None."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """Headless Chromium with a fresh profile in ``profile_dir``; use as a context manager."""

    def __init__(self, profile_dir: Path, *, width: int = 1280, height: int = 900, start_timeout_s: float = 60.0):
        import websocket  # websocket-client

        exe = chromium_path()
        if exe is None:
            raise FileNotFoundError("chromium not found")
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = self._devtools_url(start_timeout_s)
        self.ws = websocket.create_connection(url, timeout=60, suppress_origin=True)
        self._id = 0
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def _devtools_url(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            lines.append(line)
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                return m.group(1)
        self.close()
        raise RuntimeError("chromium did not start: " + "".join(lines[-10:]))

    def call(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events that arrive meanwhile are kept in ``events``.

        Raises:
            RuntimeError: the browser answered with an error.
        """
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait for an event of the page's session (already received ones count)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for e in self.events:
                if e.get("method") == method and not e.get("_seen"):
                    e["_seen"] = True
                    return e
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout_s} s")
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            self.events.append(json.loads(self.ws.recv()))

    def load(self, url: str, timeout_s: float = 120.0) -> None:
        """Navigate and wait for the load event."""
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired", timeout_s)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises awaited).

        Raises:
            RuntimeError: the expression threw.
        """
        res = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page threw: {res['exceptionDetails']}")
        return res["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries seen so far, one string each."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description")))
                                                                    for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append("log: " + str(p["entry"].get("text")) + " " + str(p["entry"].get("url", "")))
        return out

    def screenshot(self, path: Path, *, full_page: bool = True, max_height: int | None = None) -> Path:
        """Write a PNG of the page (the whole document when ``full_page``, its top ``max_height``
        CSS pixels when given)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            m = self.call("Page.getLayoutMetrics", session=True)
            size = m.get("cssContentSize") or m["contentSize"]
            height = size["height"] if max_height is None else min(size["height"], max_height)
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"],
                                                            "height": height, "scale": 1})
        data = self.call("Page.captureScreenshot", session=True, **params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        """Close the socket and end the browser process (the one this object started)."""
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                ws.close()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
