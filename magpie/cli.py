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
import signal
from collections.abc import Callable

__all__ = ["HelpFormatter", "Parser", "add_force", "parser", "run_until_stopped", "split_doc"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help, the description and epilog kept as written.

    A default that says nothing (None, False of a flag, an empty list or string) is not shown,
    nor is one the help already names with %(default)s."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default in (None, False, [], "") or action.default is argparse.SUPPRESS:
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
