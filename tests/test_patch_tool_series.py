"""Every committed series against real `git apply`, and the rebase and module-source rules that keep
them git's kind of patch: no empty `diff --git` sections, --drop-removed for files upstream
removed, a release without a module block of its own taking the nearest older release's. Real
sdist trees (.cache/sdist, tests/env/setup.sh), real git, the tool run as a process.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from magpie import patch_rebase
from magpie import patches as tool
from magpie.vllm_modules import sources
from tests.releases import each_series, sdist_tree, series_dir

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "magpie" / "patches.py"
FIXTURES = REPO / "tests" / "fixtures" / "patches"
PATCHES = REPO / "patches"


def run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def copy_tree(release: str, dest: Path) -> Path:
    src = sdist_tree(release)
    shutil.copytree(src / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(src / "pyproject.toml", dest / "pyproject.toml")
    return dest


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "vllm").rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def git_apply(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    # Outside any repository (the ceiling stops git looking above the tree): git applies paths
    # relative to the tree, as patches/README.md tells users to run it.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    return subprocess.run(["git", "apply", *flags, str(patch)], cwd=tree, capture_output=True, text=True, env=env)


@each_series
def test_git_apply_takes_every_committed_series_on_its_pristine_sdist(tmp_path, release):
    """`git apply --check`, then `git apply`, of each patch in series order on the release's sdist;
    the tree git leaves is byte for byte the tree `magpie/patches.py apply` leaves."""
    folder = series_dir(release)
    by_git = copy_tree(release, tmp_path / "git")
    by_tool = copy_tree(release, tmp_path / "tool")
    entries = [entry for _, entry in tool.parse_series((folder / "series").read_text())]
    assert entries
    for entry in entries:
        check = git_apply(by_git, folder / entry, "--check")
        assert check.returncode == 0, f"vllm-{release}/{entry}: git apply --check: {check.stderr}"
        assert git_apply(by_git, folder / entry).returncode == 0
    proc = run_tool("apply", "--patches-dir", str(PATCHES), "--series", release, "--target", str(by_tool))
    assert proc.returncode == 0, proc.stderr
    assert digest(by_git) == digest(by_tool)


def test_a_series_with_an_empty_file_section_is_refused_naming_it(tmp_path):
    root = tmp_path / "demo"
    shutil.copytree(FIXTURES, root)
    patch = root / "demo" / "0002-touch-mtp.patch"
    empty = (
        "diff --git a/vllm/envs.py b/vllm/envs.py\n"
        "index 1111111..1111111 100644\n"
        "--- a/vllm/envs.py\n"
        "+++ b/vllm/envs.py\n"
    )
    patch.write_text(patch.read_text() + empty)
    tree = copy_tree("0.29.0", tmp_path / "tree")
    before = digest(tree)
    for command in ("status", "apply"):
        proc = subprocess.run(
            [sys.executable, str(TOOL), command, "--patches-dir", str(root), "--target", str(tree)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert (
            "error: demo/0002-touch-mtp.patch: the section for vllm/envs.py changes nothing (a `diff --git` "
            "section without hunks" in proc.stderr
        ), proc.stderr
    assert digest(tree) == before
    # git agrees it is no patch.
    assert git_apply(tree, patch, "--check").returncode != 0


def test_rebase_drop_removed_drops_a_removed_file_s_hunks_and_says_which(tmp_path):
    new = copy_tree("0.30.0", tmp_path / "moved")
    (new / "vllm/model_executor/models/qwen3_5_mtp.py").unlink()
    args = ["rebase", "--patches-dir", str(FIXTURES), "--base", str(sdist_tree("0.29.0")), "--target", str(new)]
    out = tmp_path / "out"
    refused = run_tool(*args, "--output", str(out))
    assert refused.returncode == 1 and "--drop-removed drops such a file's hunks" in refused.stderr
    assert not out.exists()
    proc = run_tool(*args, "--output", str(out), "--drop-removed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "demo/0002-touch-mtp.patch: dropped the 1 hunk(s) of vllm/model_executor/models/qwen3_5_mtp.py, which "
        "vLLM 0.30.0 does not have (--drop-removed)" in proc.stdout
    )
    text = (out / "demo" / "0002-touch-mtp.patch").read_text()
    assert "qwen3_5_mtp.py" not in "".join(tool._sections(text))
    assert [fp.path for fp in tool.parse_patch("0002", text).files] == ["vllm/magpie_fixture.py"]
    for entry in ("demo/0001-marker-module.patch", "demo/0002-touch-mtp.patch"):
        assert git_apply(new, out / entry, "--check").returncode == 0 and git_apply(new, out / entry).returncode == 0


def test_a_hand_resolution_equal_to_upstream_gets_no_section_and_git_applies_the_rebase(tmp_path):
    """mtp_pruning/0001 of 0.33.0 onto 0.34.0: the removed V1 proposer dropped, eagle/utils.py
    resolved to 0.34.0's file as it is, qwen3_5_mtp.py resolved to upstream's side of each
    conflict. The written patch has no eagle/utils.py section, and git applies it."""
    new = sdist_tree("0.34.0")
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["rebase", "mtp_pruning/0001", "--series", "0.33.0", "--patches-dir", str(PATCHES)]
    args += ["--base", str(sdist_tree("0.33.0")), "--target", str(new), "--drop-removed"]
    args += ["--work", str(work), "--output", str(out)]
    proc = run_tool(*args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    resolved = work / "mtp_pruning" / "0001-draft-vocab-pruning"
    utils = "vllm/v1/worker/gpu/spec_decode/eagle/utils.py"
    mtp = "vllm/model_executor/models/qwen3_5_mtp.py"
    assert patch_rebase.has_markers((resolved / utils).read_text()) and patch_rebase.has_markers(
        (resolved / mtp).read_text()
    )
    (resolved / utils).write_text((new / utils).read_text())
    upstream_side = re.compile(r"^<<<<<<< .*?\n(.*?)^\|\|\|\|\|\|\| .*?^>>>>>>> .*?\n", re.M | re.S)
    (resolved / mtp).write_text(upstream_side.sub(r"\1", (resolved / mtp).read_text()))
    proc = run_tool(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{utils} resolved to vLLM 0.34.0's file as it is: no section" in proc.stdout
    assert "dropped the 1 hunk(s) of vllm/v1/spec_decode/llm_base_proposer.py" in proc.stdout
    patch = out / "mtp_pruning" / "0001-draft-vocab-pruning.patch"
    sections = tool._sections(patch.read_text())
    assert not [s for s in sections if s.startswith(f"diff --git a/{utils}")]
    assert all("\n@@ " in s or "new file mode" in s for s in sections)
    tree = copy_tree("0.34.0", tmp_path / "tree")
    check = git_apply(tree, patch, "--check")
    assert check.returncode == 0, check.stderr


def test_check_sources_passes_for_0_34_0_and_a_release_without_blocks_takes_the_older_ones(tmp_path):
    proc = run_tool("check-sources", "--series", "0.34.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A release newer than every `# [release ...]` block (ple_mmap.py has 0.29.0 and 0.33.0
    # blocks): 0.33.0's series carried as it is onto a made-up 0.35.0 ships 0.33.0's lines.
    root = tmp_path / "patches"
    shutil.copytree(PATCHES / "vllm-0.33.0", root / "vllm-0.35.0")
    for patch in (root / "vllm-0.35.0").rglob("*.patch"):
        patch.write_text(re.sub(r"^Target: vllm 0\.33\.0$", "Target: vllm 0.35.0", patch.read_text(), flags=re.M))
    assert any("ple_mmap.py" in m.path for m in sources.shipped_modules(str(root / "vllm-0.35.0")))
    proc = run_tool("check-sources", "--patches-dir", str(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every module the series create is what its source generates" in proc.stdout
