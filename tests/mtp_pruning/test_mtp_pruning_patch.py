"""The mtp_pruning patch as a file: it stands alone, applies to the pristine vLLM 0.29.0 sdist with
magpie/patches.py, and reverts to the exact bytes."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
PATCH = REPO / "patches" / "vllm-0.29.0" / "mtp_pruning" / "0001-draft-vocab-pruning.patch"
TOOL = REPO / "magpie" / "patches.py"
TOUCHED = [
    "vllm/config/speculative.py",
    "vllm/model_executor/models/qwen3_5_mtp.py",
    "vllm/models/qwen4_exp/nvidia/mtp.py",
    "vllm/v1/spec_decode/draft_vocab.py",
    "vllm/v1/spec_decode/llm_base_proposer.py",
    "vllm/v1/worker/gpu/spec_decode/eagle/utils.py",
]


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def states(target: Path) -> dict[str, str]:
    proc = tool("status", "--target", str(target), "--json")
    return {p["name"]: p["state"] for p in json.loads(proc.stdout)["patches"]}


def test_patch_header_states_target_requirements_and_activation():
    header = PATCH.read_text().split("\n---\n", 1)[0]
    fields = dict(line.split(": ", 1) for line in header.splitlines() if line and not line.startswith(" "))
    assert fields["Target"] == "vllm 0.29.0"
    assert fields["Requires"] == "none"
    assert '"draft_vocab_path": "/abs/keep.pt"' in fields["Activation"]
    assert [line.split(" b/")[1] for line in PATCH.read_text().splitlines() if line.startswith("diff --git")] == TOUCHED


def test_patch_applies_alone_to_the_sdist_and_reverts_to_the_same_bytes(sdist_root, tmp_path):
    target = tmp_path / "vllm-0.29.0"
    shutil.copytree(sdist_root / "vllm", target / "vllm")
    shutil.copy(sdist_root / "PKG-INFO", target / "PKG-INFO")
    name = "mtp_pruning/0001-draft-vocab-pruning.patch"
    assert states(target)[name] == "not applied"
    applied = tool("apply", "mtp_pruning", "--target", str(target))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    after = states(target)
    assert after[name] == "applied"
    assert all(state == "not applied" for patch, state in after.items() if patch != name)  # nothing else needed
    assert "draft_vocab_path: str | None = None" in (target / TOUCHED[0]).read_text()
    reverted = tool("revert", "mtp_pruning", "--target", str(target))
    assert reverted.returncode == 0, reverted.stdout + reverted.stderr
    assert not (target / TOUCHED[3]).exists()
    for path in TOUCHED[:3] + TOUCHED[4:]:
        assert filecmp.cmp(sdist_root / path, target / path, shallow=False), path
