"""tests/lint.sh's `patches` part: the one source of each module the patch series create
(magpie/vllm_modules/) is linted as Python, as each release's series ships it and with the ruff
settings of that vLLM release; a fault in a source fails the step with the series, patch and file
named, and so does a committed hunk that is not what its source generates. The real ruff (the
venv's, as tests/run.sh uses it) over the real 0.29.0 series and real copies of the sources."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = REPO / "tests" / "lint.sh"
SERIES = REPO / "patches" / "vllm-0.29.0"
MODULES = REPO / "magpie" / "vllm_modules"
MTP = "mtp_pruning/0001-draft-vocab-pruning.patch"
COMMENT = "    # Building the draft head -------------------------------------------------\n"


def lint_patches(patches_dir: Path, modules_dir: Path = MODULES) -> subprocess.CompletedProcess:
    if not (REPO / ".cache" / "sdist" / "vllm-0.29.0" / "pyproject.toml").exists():
        pytest.fail(".cache/sdist/vllm-0.29.0 is missing: run tests/env/setup.sh (tests/run.sh does)")
    env = dict(os.environ, LINT_PATCHES_DIR=str(patches_dir), LINT_MODULES_DIR=str(modules_dir))
    return subprocess.run(["bash", str(LINT), "patches"], capture_output=True, text=True, env=env, cwd=REPO)


@pytest.fixture
def series_029(tmp_path) -> Path:
    """A copy of the 0.29.0 series alone (its own root), to seed faults into."""
    shutil.copytree(SERIES, tmp_path / "patches" / "vllm-0.29.0")
    return tmp_path / "patches"


@pytest.fixture
def modules(tmp_path) -> Path:
    """A copy of the module sources, to seed faults into."""
    return Path(shutil.copytree(MODULES, tmp_path / "vllm_modules", ignore=shutil.ignore_patterns("__pycache__")))


def seed(modules: Path, line: str) -> None:
    source = modules / "draft_vocab.py"
    text = source.read_text()
    assert text.count(COMMENT) == 1
    source.write_text(text.replace(COMMENT, line))


def test_the_0_29_series_python_passes_vllm_s_own_ruff_settings(series_029):
    proc = lint_patches(series_029)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ruff over the 4 Python files the patch series create" in proc.stdout
    assert "every module the series create is what its source generates" in proc.stdout


def test_a_fault_in_a_module_source_fails_the_lint_naming_the_patch_and_file(series_029, modules):
    seed(modules, "    _seeded = undefined_name\n")  # F821
    proc = lint_patches(series_029, modules)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "F821" in out
    assert "vllm-0.29.0/mtp_pruning/0001-draft-vocab-pruning/vllm/v1/spec_decode/draft_vocab.py" in out


def test_the_project_s_line_length_is_not_the_rule_for_vllm_s_tree(series_029, modules):
    """A 100-character line passes the project's ruff (120) but not vLLM's (88): the shipped files
    are held to the tree they go into."""
    long_line = '    _seeded = "' + "x" * 84 + '"\n'
    assert len(long_line) - 1 == 100
    seed(modules, long_line)
    proc = lint_patches(series_029, modules)
    assert proc.returncode == 1 and "E501" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_hunk_that_is_not_what_its_source_generates_fails_the_lint(series_029):
    """The committed patch edited by hand (clean Python, so ruff passes): check-sources fails."""
    patch = series_029 / "vllm-0.29.0" / MTP
    text = patch.read_text()
    assert text.count("+" + COMMENT) == 1
    patch.write_text(text.replace("+" + COMMENT, "+    # Building the head\n"))
    proc = lint_patches(series_029)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{MTP}: vllm/v1/spec_decode/draft_vocab.py is not what" in proc.stderr, proc.stderr
    assert "run `magpie/patches.py refresh`" in proc.stderr


def test_an_unknown_part_is_a_usage_error():
    proc = subprocess.run(["bash", str(LINT), "pyton"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "no part 'pyton' (python, patches, shell, nix, commits)" in proc.stderr
