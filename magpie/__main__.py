"""The package's entry point: `python3 magpie TOOL [ARGS...]` (by path, from any folder) or
`python3 -m magpie TOOL [ARGS...]`; no TOOL lists them (exit 0), an unknown TOOL exits 2.

Every tool runs under magpie.cli.run_tool: an ordinary error (a missing file, truncated JSON, ...)
is one line naming the input, exit 1 (MAGPIE_TRACEBACK=1 shows the traceback); SIGTERM stops
what the tool started. `magpie.__main__.console_<name>` (e.g. console_build_keepset) is the
same for one tool, as a console script's entry point."""

from __future__ import annotations

import importlib
import os
import sys

if __package__ in (None, ""):
    # Run by path (`python3 /checkout/magpie ...`): the checkout's root makes `magpie` importable.
    # This is the one place the package touches sys.path.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from magpie import TOOLS  # noqa: E402
from magpie.cli import run_piped, run_tool  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        width = max(map(len, TOOLS))
        print("usage: python3 magpie TOOL [ARGS...]   (TOOL --help for its own help)\n\ntools:")
        for name, module in TOOLS.items():
            print(f"  {name:<{width}}  {module}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in TOOLS:
        print(f"magpie: no tool {name!r}; the tools: {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    sys.argv = [f"magpie {name}", *rest]
    return run_tool(name, lambda args: importlib.import_module(TOOLS[name]).main(args), rest)


def __getattr__(attribute: str):
    """console_<tool> (dashes as underscores): a console script's entry point for that tool."""
    tool = attribute.removeprefix("console_").replace("_", "-")
    if not attribute.startswith("console_") or tool not in TOOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")

    def console() -> None:
        sys.exit(run_tool(tool, lambda args: importlib.import_module(TOOLS[tool]).main(args), sys.argv[1:]))

    return console


if __name__ == "__main__":
    sys.exit(run_piped(main))
