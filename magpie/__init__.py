"""magpie-vllm-plugins' tools, one importable package (standard library at import time).

Run a tool from a checkout in either of two ways:

    python3 magpie TOOL [ARGS...]          # from any folder: the package's own entry point
    python3 -m magpie.measure.bench_decode  # from the checkout's root (or with it on PYTHONPATH)

or, once installed (`pip install .`), as the console script `magpie-TOOL`. `python3 magpie`
alone lists the tools. Subpackages, by what they are for:

    magpie.patches      the patch tool (one file that also works copied on its own)
    magpie.serving      starting and watching vLLM: profiles, launch plan, memory guard, watchdog,
                        server process, client, metrics
    magpie.measure      benchmarks, GSM8K, profiles and trace split, log check, report, suite
    magpie.mtp_pruning  keep-set tools and benches of the pruned MTP draft head
    magpie.ple_ssd      the staging benchmark of the n-gram table on disk
    magpie.gpu          the GPU harness (runs on a lent GPU machine)
    magpie.nix          build-time helpers of the flake
    magpie.demo         tiny models and the vLLM overlay the demo (and the tests) use
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["ROOT", "TOOLS", "TOOL_LIST", "tool_command", "tool_env"]

ROOT = Path(__file__).resolve().parent.parent
"""The folder that holds the `magpie` package (a checkout's root)."""

# tool name -> module, from magpie/tools.json: the one tool list (the console script of each is
# `magpie-<name>`; a tool with an `app` there is also the flake's app of that name, nix/lib.nix).
TOOL_LIST = Path(__file__).with_name("tools.json")
TOOLS: dict[str, str] = {name: row["module"] for name, row in json.loads(TOOL_LIST.read_text())["tools"].items()}


def tool_command(python: str, module: str, *args: str) -> list[str]:
    """The command that runs `module` (e.g. "magpie.serving.memguard") under `python` from any
    folder: the package's entry point by path, so no PYTHONPATH is needed."""
    names = {m: n for n, m in TOOLS.items()}
    if module not in names:
        raise KeyError(f"{module} is not a tool of magpie (see magpie.TOOLS)")
    return [python, str(ROOT / "magpie"), names[module], *args]


def tool_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the checkout's root first on PYTHONPATH, for a child
    that imports magpie modules itself (`python -m magpie...`, a worker)."""
    out = dict(os.environ if env is None else env)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *parts])
    return out
