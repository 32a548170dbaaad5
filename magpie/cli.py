"""What every magpie tool's command line starts with: one help format, one parser preamble, one
way to run until stopped.

    from magpie import cli, files

    def build_parser():
        parser = cli.parser("magpie report", __doc__)
        parser.add_argument("--output", help="HTML to write")
        cli.add_force(parser)
        return parser

- `--help` shows the module docstring's first paragraph, the options with every default that
  is set, then the rest of the docstring (examples, formats) as written.
- Subcommands made with `parser.add_subparsers().add_parser(...)` get the same format.
- `run_tool(name, main, argv)` runs a tool's main as every entry point does (`python3 magpie
  TOOL`, the `magpie-TOOL` console scripts, `python3 -m magpie.x.y`): an ordinary error (a file
  missing, unreadable or a folder, JSON that is truncated or of the wrong shape, a bad regular
  expression, ...) ends it with one line naming the input last opened and what to do, exit 1;
  MAGPIE_TRACEBACK=1 shows the traceback instead. SIGTERM ends it as Ctrl-C does (its `finally`
  blocks run: a server it started is stopped), then it dies by SIGTERM.

Standard library only.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import re
import signal
import struct
import sys
from collections.abc import Callable, Sequence

from magpie import files

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_URL",
    "HelpFormatter",
    "Parser",
    "add_force",
    "add_server",
    "format_size",
    "parse_size",
    "parser",
    "require_modules",
    "run_piped",
    "run_tool",
    "run_until_stopped",
    "split_doc",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8100
DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
"""Where serve.sh serves by default (its HOST and PORT), the URL of every client tool."""


# In a docstring that is not raw, an example command continued with a backslash arrives joined:
# "... --log server.log" + " " + the next line's indent + "--server-log ...". In an indented line
# that starts as a command does (python3 ..., set ..., VAR=...), a run of spaces longer than the
# line's indent, not before a `#` comment, is such a join (tables and aligned comments are not).
_JOINED_LINE = re.compile(r"^( +)((?:\S*python3?|set|nix|vllm|[A-Z_]+=\S*) .*?\S) ( {2,})(?=[^\s#])")
_JOINED_AGAIN = re.compile(r"^( +)(\S.*?\S) ( {2,})(?=[^\s#])")  # the continuation, joined to the next


def _unjoin(line: str) -> str:
    """An indented example line with each backslash continuation put back on its own line."""
    parts: list[str] = []
    indent = len(line) - len(line.lstrip(" "))  # a continuation is indented deeper than its first line
    pattern = _JOINED_LINE
    while (match := pattern.match(line)) and len(match.group(3)) > indent:
        parts.append(f"{match.group(1)}{match.group(2)} \\")
        line = match.group(3) + line[match.end() :]
        pattern = _JOINED_AGAIN
    return "\n".join([*parts, line])


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help, the description and epilog kept as written.

    A default that says nothing (None, False of a flag, an empty list or string) is not shown,
    nor is one the help already names with %(default)s. An example command split over lines
    with a backslash keeps its lines even where the docstring is not raw (the backslash-newline
    then joined them)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text("\n".join(map(_unjoin, text.splitlines())), width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default in (None, False, [], "") or action.default is argparse.SUPPRESS:
            return help_text
        if action.nargs == 0 and isinstance(action.default, bool):  # a store_false flag: True says nothing
            return help_text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help format is HelpFormatter, its subcommands' too (add_subparsers
    makes them of the parser's own class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def split_doc(doc: str | None) -> tuple[str, str | None]:
    """A module docstring as (description, epilog): its first paragraph, and the rest (None when
    there is no rest)."""
    text = (doc or "").strip("\n")
    head, _, rest = text.partition("\n\n")
    return head.strip(), (rest.strip("\n") or None)


def parser(prog: str | None, doc: str | None, **kwargs) -> Parser:
    """The parser of a tool: `prog` as usage shows it (e.g. "magpie report"; None: argparse's own
    choice from sys.argv[0]), `doc` (the module's __doc__) as description and epilog."""
    description, epilog = split_doc(doc)
    kwargs.setdefault("description", description)
    kwargs.setdefault("epilog", epilog)
    return Parser(prog=prog, **kwargs)


def add_force(p: argparse.ArgumentParser, what: str = "the output file") -> argparse.Action:
    """The one overwrite flag: `--force`, stored as `args.force`; pass it to
    magpie.files.check_output."""
    return p.add_argument("--force", dest="force", action="store_true", help=f"replace {what} if it exists")


def add_server(p: argparse.ArgumentParser) -> None:
    """The options of a tool that talks to a running vLLM server: --url and --model."""
    p.add_argument("--url", default=DEFAULT_URL, help="server base URL")
    p.add_argument("--model", help="model name to request (default: the first one on /v1/models)")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2}
_SIZE_UNITS.update({"g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4})


def parse_size(text: str) -> int:
    """A size option's value in bytes, as an argparse `type`: '6GiB' -> 6442450944 (IEC: KiB,
    MiB, GiB, TiB are powers of 1024), '110G' or '110GB' -> 110000000000 (SI: K, M, G, T, with
    or without B, are powers of 1000), '1048576' or '1048576B' (bytes); case does not matter."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 6GiB, 512MiB, 110G, 1048576)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def format_size(size: float) -> str:
    """A size in bytes as the tools print it: 6442450944 -> '6.00 GiB'."""
    return f"{size / 1024**3:.2f} GiB"


def run_until_stopped(loop: Callable[[], int]) -> int:
    """Run `loop()` (a watch loop, a foreground service) until it returns, or until Ctrl-C or
    SIGTERM, which end it as a KeyboardInterrupt (its `finally` blocks run) and return 0. The
    previous SIGTERM handler is restored afterwards."""

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return loop()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def require_modules(tool: str, *modules: str) -> None:
    """Exit 2 with one line when this Python lacks one of `modules` (e.g. numpy, torch): a tool
    run by the system's python3 instead of the vLLM environment's says which interpreter to use,
    not a ModuleNotFoundError from deep inside."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        sys.stderr.write(
            f"magpie {tool}: this Python ({sys.executable}) has no {', '.join(missing)}; run it with the "
            f"Python of the vLLM environment, e.g. `.venv/bin/python magpie {tool} ...` in a checkout "
            "set up by tests/env/setup.sh, or `nix develop`\n"
        )
        raise SystemExit(2)


def run_piped(entry: Callable[[], int | None]) -> int | None:
    """entry()'s status; a reader that closed our stdout (`| head`) ends it quietly with 141, the
    status of a process killed by SIGPIPE, as a C tool would, not with a traceback. (The patch
    tool, which must run copied on its own, does the same inside its own main.)"""
    try:
        status = entry()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


# --------------------------------------------------------------------------------------------
# The runner of every tool: ordinary errors as one line, SIGTERM as Ctrl-C

TRACEBACK_VARIABLE = "MAGPIE_TRACEBACK"
"""Set to 1 to see the traceback of an error run_tool would otherwise print as one line."""


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the tool was, so that its `finally` blocks (stopping a server it
    started, removing a temporary file) run as on Ctrl-C."""


class _Opened:
    """The last file the tool opened that is not part of Python, the installed packages or magpie
    itself, or the last URL it requested (an audit hook sees every open and urllib request): the
    input an error most likely came from."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.writing = False
        here = os.path.dirname(os.path.abspath(__file__))
        skip = {here, sys.prefix, sys.base_prefix, sys.exec_prefix, "/proc", "/sys", "/dev"}
        skip.update(p for p in sys.path if "-packages" in p)
        self.skip = tuple(os.path.join(os.path.realpath(p), "") for p in skip if p) + tuple(
            os.path.join(p, "") for p in skip if p
        )

    def hook(self, event: str, args: tuple) -> None:
        if event == "urllib.Request" and args and isinstance(args[0], str):
            self.path, self.writing = args[0], False  # a reply read from a server is an input too
            return
        if event != "open" or not args:
            return
        path = args[0]
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str) or path.endswith((".py", ".pyc", ".so", ".pth")):
            return
        if os.path.abspath(path).startswith(self.skip):
            return
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        self.path = path
        self.writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            flags & (os.O_WRONLY | os.O_RDWR)
        )


_opened: _Opened | None = None


def _track_opens() -> _Opened:
    """The one tracker of the process (an audit hook cannot be removed: installed once)."""
    global _opened
    if _opened is None:
        _opened = _Opened()
        sys.addaudithook(_opened.hook)
    return _opened


_ERRNO_FIX = {
    errno.ENOENT: "no such file or folder; check the path",
    errno.EISDIR: "is a folder; give a file",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EACCES: "permission denied; check its permissions (or run as its owner)",
    errno.EPERM: "operation not permitted; check its permissions",
    errno.ENOSPC: "no space left on the device; free space or write elsewhere",
    errno.EROFS: "the file system is read-only; write elsewhere",
    errno.ENAMETOOLONG: "the name is too long; give a shorter path",
    errno.ELOOP: "too many symbolic links; give the file itself",
    errno.EEXIST: "exists, and is in the way (a file where a folder is needed?); choose another path",
}


def describe_error(error: BaseException, opened: str | None = None) -> str:
    """One line for an error of a tool: what went wrong with which input, and what to do."""
    if isinstance(error, OSError) and (error.filename is not None or error.errno in _ERRNO_FIX):
        name = error.filename if error.filename is not None else opened
        what = _ERRNO_FIX.get(error.errno, error.strerror or str(error))
        return f"{os.fsdecode(name)}: {what}" if name is not None else what
    where = f"{opened}: " if opened else ""
    if isinstance(error, json.JSONDecodeError):
        return (
            f"{where}not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); "
            "give a complete JSON file (a truncated copy, or another format?)"
        )
    if isinstance(error, UnicodeDecodeError):
        return f"{where}not UTF-8 text (byte {error.start}); give the text file the tool reads"
    if isinstance(error, re.error):
        return f"bad regular expression {error.pattern!r}: {error.msg}; fix the pattern (Python `re` syntax)"
    if isinstance(error, MemoryError):
        return f"{where}out of memory reading it (a corrupt header claiming a huge size?); check the file"
    if isinstance(error, struct.error):
        return f"{where}truncated, or not the binary format expected ({error}); check the file"
    if isinstance(error, files.InputError) or str(error).startswith("draft_vocab_path "):
        return str(error)  # names the input and the fix itself
    detail = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)[:300]
    while_reading = f" (the input last opened: {opened})" if opened else ""
    return (
        f"{type(error).__name__}: {detail}{while_reading}; check that input, or set {TRACEBACK_VARIABLE}=1 "
        "for the traceback"
    )


def run_tool(name: str, main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """main(argv)'s exit status, as every entry point runs a tool named `name` (e.g.
    "build-keepset"): an ordinary error is one line on stderr, "magpie NAME: INPUT: what; fix",
    and exit 1 (set MAGPIE_TRACEBACK=1 for the traceback); Ctrl-C exits 130 with one line;
    SIGTERM (unless the tool handles it itself) runs the tool's `finally` blocks, then ends the
    process by SIGTERM; a reader that closed stdout ends it with 141 (run_piped)."""
    opened = _track_opens()
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        raise Stopped

    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop)
    try:
        status = run_piped(lambda: main(argv))
        return 0 if status is None else status
    except Stopped:
        sys.stderr.write(f"magpie {name}: stopped by SIGTERM\n")
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return 128 + signal.SIGTERM  # not reached: the signal ends the process
    except KeyboardInterrupt:
        sys.stderr.write(f"magpie {name}: interrupted\n")
        return 130
    except Exception as error:
        if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            raise
        sys.stderr.write(f"magpie {name}: {describe_error(error, opened.path)}\n")
        return 1
    finally:
        if previous == signal.SIG_DFL and signal.getsignal(signal.SIGTERM) in (stop, signal.SIG_IGN):
            signal.signal(signal.SIGTERM, previous)
