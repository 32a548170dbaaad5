"""The vLLM 0.33.0 series against the pristine 0.33.0 sdist: picked by the patch tool for that
release, applies and reverts byte for byte, every patched module compiles, and its headers say
what it targets and requires."""

from __future__ import annotations

import hashlib
import json
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

from tests.v0_33.tree_033 import SERIES, TOOL, sdist_033

REPO = Path(__file__).resolve().parent.parent.parent
MTP = ["mtp_pruning/0001-draft-vocab-pruning.patch", "mtp_pruning/0002-quantized-pruned-head.patch"]
PLE = ["ple_ssd/0001-engram-mmap-storage.patch"]
PATCHES = MTP + PLE


def run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "vllm").rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def states(*args) -> dict[str, str]:
    proc = run_tool("status", "--json", *args)
    assert proc.returncode in (0, 3), proc.stderr
    return {p["name"]: p["state"] for p in json.loads(proc.stdout)["patches"]}


def test_series_lists_the_mtp_pruning_then_the_ple_ssd_patches():
    entries = [ln for ln in (SERIES / "series").read_text().splitlines() if ln and not ln.startswith("#")]
    assert entries == PATCHES


def test_headers_name_the_release_the_origin_and_the_prerequisite():
    first, second, ple = ((SERIES / name).read_text() for name in PATCHES)
    assert "\nTarget: vllm 0.33.0\nRebased-From: vllm 0.29.0 (magpie/patches.py rebase)\nRequires: none\n" in first
    assert "\nTarget: vllm 0.33.0\nRequires: mtp_pruning/0001\n" in second
    assert '"draft_lm_head_quantization": "fp8"' in second.split("\n---\n")[0]
    assert "\nTarget: vllm 0.33.0\nRequires: none\n" in ple
    assert 'Activation: --engram-config \'{"offload_storage": "mmap"}\'' in ple.split("\n---\n")[0]


def test_series_applies_and_reverts_byte_for_byte_on_the_sdist(tmp_path):
    tree = tmp_path / "vllm-0.33.0"
    shutil.copytree(sdist_033() / "vllm", tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(sdist_033() / "pyproject.toml", tree / "pyproject.toml")
    pristine = digest(tree)
    # Picked by the target's release, with no --series.
    proc = run_tool("status", "--target", str(tree))
    assert proc.returncode == 0 and f"series {SERIES / 'series'}" in proc.stdout, proc.stdout + proc.stderr
    assert states("--target", str(tree)) == dict.fromkeys(PATCHES, "not applied")
    # 0002 alone is refused; the tool names the prerequisite.
    proc = run_tool("apply", "mtp_pruning/0002", "--target", str(tree))
    assert proc.returncode == 1 and "requires mtp_pruning/0001-draft-vocab-pruning.patch" in proc.stderr
    assert digest(tree) == pristine
    proc = run_tool("apply", "mtp_pruning", "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert "6 file(s) changed" in proc.stdout
    assert states("--target", str(tree)) == {**dict.fromkeys(MTP, "applied"), **dict.fromkeys(PLE, "not applied")}
    changed = [rel for rel, sha in digest(tree).items() if pristine.get(rel) != sha]
    assert sorted(changed) == [
        "vllm/config/speculative.py",
        "vllm/model_executor/models/qwen3_5_mtp.py",
        "vllm/models/qwen4_exp/nvidia/mtp.py",
        "vllm/v1/spec_decode/draft_vocab.py",
        "vllm/v1/spec_decode/llm_base_proposer.py",
        "vllm/v1/worker/gpu/spec_decode/eagle/utils.py",
    ]
    for rel in changed:
        py_compile.compile(str(tree / rel), cfile=str(tmp_path / "pyc" / (rel + "c")), doraise=True)
    proc = run_tool("apply", "ple_ssd", "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert states("--target", str(tree)) == dict.fromkeys(PATCHES, "applied")
    ple_changed = [rel for rel, sha in digest(tree).items() if pristine.get(rel) != sha and rel not in changed]
    assert sorted(ple_changed) == [
        "vllm/config/engram.py",
        "vllm/config/vllm.py",
        "vllm/models/qwen4_exp/common/ngram_embedding.py",
        "vllm/models/qwen4_exp/common/ple_mmap.py",
        "vllm/models/qwen4_exp/nvidia/model_state.py",
        "vllm/models/qwen4_exp/nvidia/ngram_embedding.py",
    ]
    for rel in ple_changed:
        py_compile.compile(str(tree / rel), cfile=str(tmp_path / "pyc" / (rel + "c")), doraise=True)
    # Reverting 0001 alone is refused while 0002 is applied.
    proc = run_tool("revert", "mtp_pruning/0001", "--target", str(tree))
    assert proc.returncode == 1 and "requires it" in proc.stderr
    proc = run_tool("revert", "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert digest(tree) == pristine


def test_the_0_33_series_does_not_apply_to_0_29(tmp_path):
    tree = REPO / ".cache" / "sdist" / "vllm-0.29.0"
    proc = run_tool("status", "--series", "0.33.0", "--target", str(tree))
    assert proc.returncode == 3
    assert "mtp_pruning/0001-draft-vocab-pruning.patch    conflicting" in proc.stdout
