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

Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import signal
import sys
from collections.abc import Callable

from magpie.patches import run_piped  # the patch tool stands alone, so it holds the one copy

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


def add_force(p: argparse.ArgumentParser, what: str = "the output file", *aliases: str) -> argparse.Action:
    """The one overwrite flag: `--force` (plus any older `aliases`, e.g. "--overwrite"), stored
    as `args.force`; pass it to magpie.files.check_output."""
    return p.add_argument("--force", *aliases, dest="force", action="store_true", help=f"replace {what} if it exists")


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
