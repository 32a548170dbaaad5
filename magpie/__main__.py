"""The package's entry point: `python3 magpie TOOL [ARGS...]` (by path, from any folder) or
`python3 -m magpie TOOL [ARGS...]`; no TOOL lists them (exit 0), an unknown TOOL exits 2."""

from __future__ import annotations

import importlib
import os
import sys

if __package__ in (None, ""):
    # Run by path (`python3 /checkout/magpie ...`): the checkout's root makes `magpie` importable.
    # This is the one place the package touches sys.path.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from magpie import TOOLS  # noqa: E402
from magpie.cli import run_piped  # noqa: E402


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
    module = importlib.import_module(TOOLS[name])
    sys.argv = [f"magpie {name}", *rest]
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(run_piped(main))
