"""Each series release without a CPU wheel (0.33.0, 0.34.0, ...) against its pristine sdist: the
patch tool picks the release's series for it, the series applies and reverts byte for byte, every
patched module compiles, `git apply --check` agrees with the tool, and the headers say what each
patch targets and requires. Releases are the table's (tree.PYTHON_RELEASES); what differs between
them is written out below."""

from __future__ import annotations

import hashlib
import json
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from magpie import releases
from tests.release_python.tree import TOOL, each_python_release, series_of
from tests.releases import sdist_tree

REPO = Path(__file__).resolve().parent.parent.parent
MTP = ["mtp_pruning/0001-draft-vocab-pruning.patch", "mtp_pruning/0002-quantized-pruned-head.patch"]
COMMON_MTP_FILES = [
    "vllm/config/speculative.py",
    "vllm/model_executor/models/qwen3_5_mtp.py",
    "vllm/models/qwen4_exp/nvidia/mtp.py",
    "vllm/v1/spec_decode/draft_vocab.py",
    "vllm/v1/worker/gpu/spec_decode/eagle/utils.py",
]
# Per release: the release its mtp_pruning was rebased from, the files mtp_pruning changes beyond
# the common ones, and (where this package tests it) its ple_ssd patch and files.
EXPECTED = {
    "0.33.0": {
        "rebased_from": "0.29.0",
        "mtp_files": ["vllm/v1/spec_decode/llm_base_proposer.py"],  # the V1 proposer, gone in 0.34
        "ple": ["ple_ssd/0001-engram-mmap-storage.patch"],
        "ple_files": [
            "vllm/config/engram.py",
            "vllm/config/vllm.py",
            "vllm/models/qwen4_exp/common/ngram_embedding.py",
            "vllm/models/qwen4_exp/common/ple_hash.py",
            "vllm/models/qwen4_exp/common/ple_mmap.py",
            "vllm/models/qwen4_exp/common/ple_rows.py",
            "vllm/models/qwen4_exp/nvidia/model_state.py",
            "vllm/models/qwen4_exp/nvidia/ngram_embedding.py",
        ],
    },
    "0.34.0": {
        "rebased_from": "0.33.0",
        "mtp_files": ["vllm/models/qwen3_5/nvidia/mtp.py"],  # the CUDA Qwen3.5 MTP, new in 0.34
        "ple": None,  # 0.34's ple_ssd lines are another series' business (tests/ple_ssd)
    },
}


def expected(release: str) -> dict:
    if release not in EXPECTED:
        pytest.fail(f"vLLM {release} has a series but no EXPECTED entry in {__file__}: add what its series changes")
    return EXPECTED[release]


def entries(release: str) -> list[str]:
    return [ln for ln in (series_of(release) / "series").read_text().splitlines() if ln and not ln.startswith("#")]


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


@each_python_release
def test_series_lists_the_mtp_pruning_patches_first(release):
    listed = entries(release)
    assert listed[:2] == MTP
    if expected(release)["ple"] is not None:
        assert listed == MTP + expected(release)["ple"]


@each_python_release
def test_headers_name_the_release_the_origin_and_the_prerequisite(release):
    series = series_of(release)
    first, second = ((series / name).read_text() for name in MTP)
    origin = expected(release)["rebased_from"]
    assert (
        f"\nTarget: vllm {release}\nRebased-From: vllm {origin} (magpie/patches.py rebase)\nRequires: none\n" in first
    )
    assert f"\nTarget: vllm {release}\n" in second and "\nRequires: mtp_pruning/0001\n" in second
    assert '"draft_lm_head_quantization": "fp8"' in second.split("\n---\n")[0]
    if release == "0.33.0":
        ple = (series / expected(release)["ple"][0]).read_text()
        assert "\nTarget: vllm 0.33.0\nRequires: none\n" in ple
        assert 'Activation: --engram-config \'{"offload_storage": "mmap"}\'' in ple.split("\n---\n")[0]


@each_python_release
def test_series_applies_and_reverts_byte_for_byte_on_the_sdist(release, tmp_path):
    want = expected(release)
    sdist = sdist_tree(release)
    tree = tmp_path / f"vllm-{release}"
    shutil.copytree(sdist / "vllm", tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(sdist / "pyproject.toml", tree / "pyproject.toml")
    pristine = digest(tree)
    listed = entries(release)
    series_file = series_of(release) / "series"
    # Picked by the target's release, with no --series.
    proc = run_tool("status", "--target", str(tree))
    assert proc.returncode == 0 and f"series {series_file}" in proc.stdout, proc.stdout + proc.stderr
    assert states("--target", str(tree)) == dict.fromkeys(listed, "not applied")
    # 0002 alone is refused; the tool names the prerequisite.
    proc = run_tool("apply", "mtp_pruning/0002", "--target", str(tree))
    assert proc.returncode == 1 and "requires mtp_pruning/0001-draft-vocab-pruning.patch" in proc.stderr
    assert digest(tree) == pristine
    proc = run_tool("apply", "mtp_pruning", "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    mtp_files = sorted(COMMON_MTP_FILES + want["mtp_files"])
    assert f"{len(mtp_files)} file(s) changed" in proc.stdout
    assert states("--target", str(tree)) == {**dict.fromkeys(listed, "not applied"), **dict.fromkeys(MTP, "applied")}
    changed = sorted(rel for rel, sha in digest(tree).items() if pristine.get(rel) != sha)
    assert changed == mtp_files
    for rel in changed:
        py_compile.compile(str(tree / rel), cfile=str(tmp_path / "pyc" / (rel + "c")), doraise=True)
    proc = run_tool("apply", "--target", str(tree))  # the rest of the series, whatever it lists
    assert proc.returncode == 0, proc.stderr
    assert states("--target", str(tree)) == dict.fromkeys(listed, "applied")
    rest = sorted(rel for rel, sha in digest(tree).items() if pristine.get(rel) != sha and rel not in changed)
    if want["ple"] is not None:
        assert rest == want["ple_files"]
    for rel in rest:
        py_compile.compile(str(tree / rel), cfile=str(tmp_path / "pyc" / (rel + "c")), doraise=True)
    # Reverting 0001 alone is refused while 0002 is applied.
    proc = run_tool("revert", "mtp_pruning/0001", "--target", str(tree))
    assert proc.returncode == 1 and "requires it" in proc.stderr
    proc = run_tool("revert", "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert digest(tree) == pristine


@each_python_release
def test_git_apply_agrees_that_the_series_applies_in_order(release, tmp_path):
    # git apply outside any repository (tmp_path), one patch after the other, as a user with a
    # plain sdist would; the result is what the patch tool makes.
    by_git, by_tool = tmp_path / "git", tmp_path / "tool"
    for tree in (by_git, by_tool):
        shutil.copytree(sdist_tree(release) / "vllm", tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(sdist_tree(release) / "pyproject.toml", tree / "pyproject.toml")
    for name in entries(release):
        patch = series_of(release) / name
        for args in (["--check"], []):
            proc = subprocess.run(["git", "apply", *args, str(patch)], cwd=by_git, capture_output=True, text=True)
            assert proc.returncode == 0, f"git apply {' '.join(args)} {name}: {proc.stderr}"
    proc = run_tool("apply", "--target", str(by_tool))
    assert proc.returncode == 0, proc.stderr
    assert digest(by_git) == digest(by_tool)


@each_python_release
def test_the_series_does_not_apply_to_the_release_before_it(release):
    earlier = releases.series_releases()[releases.series_releases().index(release) - 1]
    proc = run_tool("status", "--series", release, "--target", str(sdist_tree(earlier)))
    assert proc.returncode == 3
    assert "mtp_pruning/0001-draft-vocab-pruning.patch    conflicting" in proc.stdout
