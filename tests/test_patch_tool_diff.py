"""`magpie/patches.py diff` writes a patch of the series again from an edited tree, on the real
0.29.0 series and copies of the pristine 0.29.0 sdist: the patch as committed comes back from a
tree it was applied to (the same header and files), and a hand edit of the tree lands in it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from magpie import patches

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "magpie" / "patches.py"
NAME = "mtp_pruning/0001"


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def copy_tree(src: Path, dest: Path) -> Path:
    shutil.copytree(src / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(src / "pyproject.toml", dest / "pyproject.toml")
    return dest


@pytest.fixture
def series(tmp_path) -> Path:
    root = tmp_path / "patches"
    shutil.copytree(REPO / "patches" / "vllm-0.29.0", root / "vllm-0.29.0")
    return root


@pytest.fixture
def edited(sdist_root, tmp_path, series) -> Path:
    """A copy of the pristine sdist with mtp_pruning/0001 applied (the pristine sdist itself is the
    tree before it: diff only reads --base)."""
    tree = copy_tree(sdist_root, tmp_path / "edited")
    proc = tool("apply", NAME, "--target", str(tree), "--patches-dir", str(series))
    assert proc.returncode == 0, proc.stderr
    return tree


def patch_file(series: Path) -> Path:
    (found,) = (series / "vllm-0.29.0" / "mtp_pruning").glob("0001-*.patch")
    return found


def result(sdist_root: Path, text: str) -> dict:
    """The files the patch gives on the pristine tree (the applier `apply` uses, in memory)."""
    return patches.Tree(str(sdist_root)).try_patch(patches.parse_patch(NAME, text), reverse=False)


def test_diff_writes_the_patch_again_and_a_hand_edit_lands_in_it(sdist_root, series, edited, tmp_path):
    committed = patch_file(series).read_text()
    out = tmp_path / "out.patch"
    base = ["--base", str(sdist_root), "--target", str(edited), "--patches-dir", str(series)]
    proc = tool("diff", NAME, *base, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    written = out.read_text()
    assert patch_file(series).read_text() == committed  # --output: the series is left as it is
    # The same header (Last-Update set to today), the same files, each the same after the patch.
    undated = re.compile(r"^Last-Update: .*$", re.M)
    header = written[: written.index("diff --git ")]
    assert undated.sub("", header) == undated.sub("", committed[: committed.index("diff --git ")])
    assert re.search(r"^Last-Update: \d{4}-\d\d-\d\d$", header, re.M)
    assert result(sdist_root, written) == result(sdist_root, committed)

    target = edited / "vllm" / "v1" / "spec_decode" / "draft_vocab.py"
    target.write_text(target.read_text() + "\nHAND_EDIT = True\n")
    proc = tool("diff", NAME, *base)
    assert proc.returncode == 0, proc.stderr
    assert str(patch_file(series)) in proc.stdout
    rewritten = patch_file(series).read_text()
    assert result(sdist_root, rewritten)["vllm/v1/spec_decode/draft_vocab.py"].endswith("\nHAND_EDIT = True\n")
    patches.load_series(str(series / "vllm-0.29.0"))  # the series still reads (headers checked)


def test_diff_of_two_equal_trees_writes_nothing(sdist_root, series):
    committed = patch_file(series).read_text()
    proc = tool("diff", NAME, "--base", str(sdist_root), "--target", str(sdist_root), "--patches-dir", str(series))
    assert proc.returncode == 2 and "have the same vllm/ files: nothing to write" in proc.stderr, proc.stderr
    assert patch_file(series).read_text() == committed
