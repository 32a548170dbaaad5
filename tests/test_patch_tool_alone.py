"""magpie/patches.py copied on its own beside a patches/ folder, as patches/README.md promises it
works: no magpie package, Python in isolated mode (-I), the real 0.29.0 series on a copy of the
pristine 0.29.0 sdist. status, apply and revert work there; the subcommands kept in other files
(rebase, diff; refresh, check-sources and extract, which read the module sources) are refused in one
line naming what they need.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def digest(root: Path) -> dict[str, str]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root / "vllm"):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def alone(tmp_path) -> Path:
    """tools/patches.py and patches/ (the committed series), nothing else of the checkout."""
    root = tmp_path / "alone"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "magpie" / "patches.py", root / "tools" / "patches.py")
    shutil.copytree(REPO / "patches", root / "patches")
    return root


@pytest.fixture
def tree(sdist_root, tmp_path) -> Path:
    dest = tmp_path / "tree"
    shutil.copytree(sdist_root / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(sdist_root / "pyproject.toml", dest / "pyproject.toml")
    return dest


def run(alone: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    tool = alone / "tools" / "patches.py"
    return subprocess.run([sys.executable, "-I", str(tool), *args], capture_output=True, text=True, cwd=cwd)


def states(alone: Path, tree: Path) -> dict[str, str]:
    proc = run(alone, "status", "--json", "--target", str(tree), cwd=alone.parent)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["series"] == str(alone / "patches" / "vllm-0.29.0")
    return {p["name"]: p["state"] for p in record["patches"]}


def test_the_tool_copied_alone_applies_reports_and_reverts_byte_for_byte(alone, tree):
    before = digest(tree)
    assert set(states(alone, tree).values()) == {"not applied"}
    applied = run(alone, "apply", "--target", str(tree), cwd=alone.parent)
    assert applied.returncode == 0, applied.stderr
    assert "file(s) changed under" in applied.stdout
    assert set(states(alone, tree).values()) == {"applied"}
    assert digest(tree) != before
    reverted = run(alone, "revert", "--target", str(tree), cwd=alone.parent)
    assert reverted.returncode == 0, reverted.stderr
    assert set(states(alone, tree).values()) == {"not applied"}
    assert digest(tree) == before


@pytest.mark.parametrize(
    ("command", "needs"),
    [
        (["refresh"], "vllm_modules/sources.py not found: extract, refresh and check-sources need"),
        (["check-sources"], "vllm_modules/sources.py not found: extract, refresh and check-sources need"),
        (["extract", "--output", "out"], "vllm_modules/sources.py not found: extract, refresh and check-sources need"),
        (["rebase", "--base", "x", "--target", "y"], "patch_rebase.py not found: rebase needs"),
        (["diff", "ple_ssd/0001", "--base", "x"], "patch_diff.py not found: diff needs"),
    ],
)
def test_the_parts_in_other_files_copied_alone_say_what_they_need(alone, command, needs):
    proc = run(alone, *command, cwd=alone.parent)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needs + " the magpie checkout or installed package this file came from" in proc.stderr
    assert "Traceback" not in proc.stderr and not (alone.parent / "out").exists()


def test_the_tool_copied_alone_ends_quietly_when_its_reader_stops(alone):
    """`patches.py list | head -0`: exit 141 (as for SIGPIPE), no traceback."""
    tool = alone / "tools" / "patches.py"
    proc = subprocess.Popen(
        [sys.executable, "-I", str(tool), "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=alone.parent
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err
