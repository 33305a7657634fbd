"""Progress of a run on stderr: a bar with step n/N, ETA and the last reward; plain, JSON or quiet.

`setup(quiet=False, log_format="text")` is called once by the CLI. It routes every log record through one handler that
knows about the bar, so a log line never tears it:
- text on a terminal: the bar is redrawn in place on the last line, log lines scroll above it;
- text elsewhere (a file, CI): one bar line per finished step;
- `log_format="json"`: each log record and each progress update is one JSON object per line
  (`{"ts", "level", "logger", "msg"}`; progress: `{"ts", "event": "progress", "step", "steps", "elapsed_s", "eta_s",
  "last_reward"}`);
- `quiet=True`: warnings and errors only, no bar. The final JSON summary still goes to stdout.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress", "current", "format_duration", "setup"]

_current: Progress | None = None


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    def __init__(
        self, stream: TextIO | None = None, mode: str = "text", tty: bool | None = None, width: int = 24
    ) -> None:
        if mode not in ("text", "json", "quiet"):
            raise ValueError(f"progress mode {mode!r}: expected text, json or quiet")
        self._stream = stream
        self.mode = mode
        self.tty = self.stream.isatty() if tty is None else tty
        self.width = width
        self.state: dict | None = None
        self._shown = ""
        self._last_step = -1
        self._lock = threading.Lock()

    @property
    def stream(self) -> TextIO:
        # looked up at each write: sys.stderr may be replaced (tests, redirection)
        return self._stream or sys.stderr

    def update(self, done: int, total: int, elapsed_s: float, last_reward: float | None) -> None:
        """Called at each step end and on the monitor's interval."""
        eta = elapsed_s / done * (total - done) if done else None
        self.state = {
            "step": done,
            "steps": total,
            "elapsed_s": round(elapsed_s, 1),
            "eta_s": None if eta is None else round(eta, 1),
            "last_reward": last_reward,
        }
        new_step = done != self._last_step
        self._last_step = done
        with self._lock:
            if self.mode == "quiet":
                return
            if self.mode == "json":
                if new_step:
                    self._emit(json.dumps({"ts": round(time.time(), 3), "event": "progress", **self.state}))
                return
            if self.tty:
                self._draw(self.bar())
            elif new_step:
                self._emit(self.bar())

    def bar(self) -> str:
        s = self.state or {"step": 0, "steps": 0, "elapsed_s": 0.0, "eta_s": None, "last_reward": None}
        frac = s["step"] / s["steps"] if s["steps"] else 0.0
        filled = math.floor(frac * self.width)
        eta = "?" if s["eta_s"] is None else format_duration(s["eta_s"])
        reward = "n/a" if s["last_reward"] is None else f"{s['last_reward']:.4f}"
        return (
            f"gyre: step {s['step']}/{s['steps']} [{'#' * filled}{'-' * (self.width - filled)}] "
            f"{100 * frac:3.0f}% elapsed {format_duration(s['elapsed_s'])} ETA {eta} last reward {reward}"
        )

    def _draw(self, line: str) -> None:
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()
        self._shown = line

    def _emit(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def log_line(self, line: str) -> None:
        """A log line, printed above the bar (which is redrawn below it on a terminal)."""
        with self._lock:
            if self.tty and self._shown and self.mode == "text":
                self.stream.write("\r\x1b[2K" + line + "\n" + self._shown)
                self.stream.flush()
            else:
                self._emit(line)

    def close(self) -> None:
        with self._lock:
            if self.tty and self._shown and self.mode == "text":
                self.stream.write("\n")
                self.stream.flush()
            self._shown = ""


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _Handler(logging.Handler):
    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.progress.log_line(self.format(record))
        except Exception:
            self.handleError(record)


def setup(quiet: bool = False, log_format: str = "text", stream: TextIO | None = None) -> Progress:
    """Install the log handler and the progress bar for this process; `current()` returns the bar."""
    global _current
    if log_format not in ("text", "json"):
        raise ValueError(f"--log-format {log_format!r}: expected text or json")
    progress = Progress(stream, "quiet" if quiet else log_format)
    handler = _Handler(progress)
    handler.setFormatter(
        _JsonFormatter() if log_format == "json" else logging.Formatter("%(asctime)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request drowns the progress
    _current = progress
    return progress


def current() -> Progress | None:
    """The bar `setup()` installed (None when the CLI did not set one up, e.g. a run started from Python)."""
    return _current
