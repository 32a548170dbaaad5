"""The serving tools' logs: their own stamped lines, and the new lines of a log that grows (the
server's output, a kernel log a test writes). Standard library only.

    log = Log(sys.stderr, "watchdog")
    log("server healthy")                  # [watchdog 2026-12-02 04:30:00] server healthy
    follower = LogFollower("server.log", from_start=False)
    follower.lines()                       # the lines written since the last call
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["OWN_LINES", "SERVING_LINE", "TAGS", "Log", "LogFollower", "open_log"]

# The tags of the tools' own lines in a server log (`memguard run` and the guard write "[memguard",
# the watchdog "[watchdog").
TAGS = ("memguard", "watchdog")
# serve.sh's header (it explains the GB10 settings by the errors they avoid) and the tools' own
# lines: never evidence of what the server did.
OWN_LINES = ("# ", *(f"[{tag}" for tag in TAGS))
# uvicorn's line once the API server serves (vLLM logs it after the engine is up).
SERVING_LINE = "Application startup complete."


def open_log(path: str | None) -> TextIO:
    """A tool's --log: the file, appended to, or stderr when none is given."""
    return open(path, "a") if path else sys.stderr


class Log:
    """One tool's lines, "[TAG <time>] message", appended to FILE and flushed at once."""

    def __init__(self, file: TextIO, tag: str):
        if tag not in TAGS:
            raise ValueError(f"log tag {tag!r}: add it to magpie.serving.logs.TAGS (readers skip those lines)")
        self.file = file
        self.tag = tag

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{self.tag} {stamp}] {message}", file=self.file, flush=True)


class LogFollower:
    """New lines of a growing text file."""

    def __init__(self, path: str, from_start: bool):
        self.path = path
        self.offset = 0 if from_start else (os.path.getsize(path) if os.path.exists(path) else 0)
        self.partial = ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                data = f.read(8 << 20)
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        data = self.partial + data
        lines = data.split("\n")
        self.partial = lines.pop()
        return lines
