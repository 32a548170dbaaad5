"""The sane range of every threshold the serving tools take, in one place. Standard library only.

Each range is an argparse `type` (so a value outside it is a usage error, exit 2, naming the flag
through argparse's "argument --flag: ..." line) and a plain check for the same rule where a value
arrives another way (serve.sh's variables in a systemd unit, a pid file). What each bound guards
against, as found by the second hostile review (of bad inputs):

- a time of 0 turns a poll loop into a busy loop (`--interval 0`: 2.6 s CPU per 3 s), or a judge
  into an executioner (`--probe-timeout 0` stops a healthy idle server);
- a negative time is a traceback inside time.sleep, or a SIGKILL without a grace period;
- a percentage outside 0-100 or a size over the machine's memory stops the server at once;
- PID 1 (init) and PIDs under 2 are no server.
"""

from __future__ import annotations

import argparse
import os
import re

__all__ = [
    "PID_MIN",
    "PORT_MAX",
    "check_port",
    "check_seconds",
    "log_file",
    "mem_total",
    "number",
    "pid",
    "seconds",
    "size",
    "url",
]

PID_MIN = 2  # 1 is init, 0 and negatives name process groups to kill(2)
PORT_MAX = 65535
DAY = 86400.0


def number(kind=float, low: float | None = None, high: float | None = None, *, zero: bool = False, what: str = ""):
    """An argparse type: KIND (int or float) within [LOW, HIGH]; ZERO: 0 is also accepted (it means
    "off"). The message says the range and, with WHAT, what the value is."""
    name = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
        if value != value or value in (float("inf"), float("-inf")):  # nan, inf
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if zero and value == 0:
            return value
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {_range(low, high, zero)}{what}")
        return value

    return parse


def _range(low, high, zero: bool) -> str:
    if low is not None and high is not None:
        text = f"expected {low:g} to {high:g}"
    elif low is not None:
        text = f"expected at least {low:g}"
    else:
        text = f"expected at most {high:g}"
    return text + (" (or 0 = off)" if zero else "")


def seconds(low: float, high: float = DAY, *, zero: bool = False):
    """A time in seconds within [LOW, HIGH] (default at most a day)."""
    return number(float, low, high, zero=zero, what=" seconds")


def pid(text: str) -> int:
    """--pid: a process ID of a server, never init (1) nor a process group (0, negatives)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process ID") from None
    if value < PID_MIN:
        raise argparse.ArgumentTypeError(
            f"{value} is no server's process ID (PID 1 is init; 0 and negative numbers name process groups)"
        )
    return value


def mem_total(meminfo: str = "/proc/meminfo") -> int | None:
    """MemTotal in bytes, None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def size(parse_size, *, below_mem_total: bool = False):
    """A size (PARSE_SIZE, cli.parse_size) that, with BELOW_MEM_TOTAL, must be under this machine's
    MemTotal: a MemAvailable threshold at or over it stops the server at once."""

    def parse(text: str) -> int:
        value = parse_size(text)
        total = mem_total() if below_mem_total else None
        if total is not None and value >= total:
            raise argparse.ArgumentTypeError(
                f"{text} is not under this machine's memory ({total / 1024**3:.2f} GiB MemTotal): the server "
                "would be stopped at once"
            )
        return value

    return parse


def url(text: str) -> str:
    """--url: an http:// or https:// address with a host (urllib refuses anything else only when the
    first request is made)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not rest.split("/")[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://HOST:PORT (e.g. http://127.0.0.1:8100)")
    return text


def log_file(text: str) -> str:
    """A file a tool appends its lines to: refused when it is a folder (the open would fail later)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file to append to")
    return text


# -- serve.sh's variables, checked the way serve.sh checks them (install-service writes them)

_DIGITS = re.compile(r"[0-9]+")


def check_port(value: str, name: str = "PORT") -> str | None:
    """None when VALUE is a TCP port serve.sh accepts (1-65535), else the reason."""
    if not _DIGITS.fullmatch(value) or not 1 <= int(value) <= PORT_MAX:
        return f"{name}={value}: expected a port number from 1 to {PORT_MAX}"
    return None


def check_seconds(value: str, name: str = "STOP_GRACE") -> str | None:
    """None when VALUE is a whole number of seconds serve.sh accepts (0 to a day), else the reason."""
    if not _DIGITS.fullmatch(value) or int(value) > DAY:
        return f"{name}={value}: expected a whole number of seconds from 0 to {DAY:g}"
    return None
