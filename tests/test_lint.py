"""tests/lint.sh's `patches` part: the Python the patch series create is linted as Python, with
the ruff settings of the vLLM release each series is for, and a fault in it fails the step with
the series, patch and file named. The real ruff (the venv's, as tests/run.sh uses it) over files
that magpie/patches.py extract writes from the real 0.29.0 series."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = REPO / "tests" / "lint.sh"
SERIES = REPO / "patches" / "vllm-0.29.0"
MTP = "mtp_pruning/0001-draft-vocab-pruning.patch"
COMMENT = "+    # Building the draft head -------------------------------------------------\n"


def lint_patches(patches_dir: Path) -> subprocess.CompletedProcess:
    if not (REPO / ".cache" / "sdist" / "vllm-0.29.0" / "pyproject.toml").exists():
        pytest.fail(".cache/sdist/vllm-0.29.0 is missing: run tests/env/setup.sh (tests/run.sh does)")
    env = dict(os.environ, LINT_PATCHES_DIR=str(patches_dir))
    return subprocess.run(["bash", str(LINT), "patches"], capture_output=True, text=True, env=env, cwd=REPO)


@pytest.fixture
def series_029(tmp_path) -> Path:
    """A copy of the 0.29.0 series alone (its own root), to seed faults into."""
    shutil.copytree(SERIES, tmp_path / "patches" / "vllm-0.29.0")
    return tmp_path / "patches"


def test_the_0_29_series_python_passes_vllm_s_own_ruff_settings(series_029):
    proc = lint_patches(series_029)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ruff over the 2 Python files the patch series create" in proc.stdout


def test_a_fault_in_a_file_a_patch_creates_fails_the_lint_naming_the_patch_and_file(series_029):
    patch = series_029 / "vllm-0.29.0" / MTP
    text = patch.read_text()
    assert text.count(COMMENT) == 1
    patch.write_text(text.replace(COMMENT, "+    _seeded = undefined_name\n"))  # F821, same line count
    proc = lint_patches(series_029)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "F821" in out
    assert "vllm-0.29.0/mtp_pruning/0001-draft-vocab-pruning/vllm/v1/spec_decode/draft_vocab.py" in out


def test_the_project_s_line_length_is_not_the_rule_for_vllm_s_tree(series_029):
    """A 100-character line passes the project's ruff (120) but not vLLM's (88): the shipped files
    are held to the tree they go into."""
    patch = series_029 / "vllm-0.29.0" / MTP
    long_line = '+    _seeded = "' + "x" * 84 + '"\n'
    assert len(long_line) - 2 == 100
    patch.write_text(patch.read_text().replace(COMMENT, long_line))
    proc = lint_patches(series_029)
    assert proc.returncode == 1 and "E501" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_an_unknown_part_is_a_usage_error():
    proc = subprocess.run(["bash", str(LINT), "pyton"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "no part 'pyton' (python, patches, shell, nix)" in proc.stderr
