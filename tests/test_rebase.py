"""magpie/patches.py's series selection by release and its `rebase` command, on the real vLLM
sdists (0.28.0, 0.29.0, 0.30.0, 0.33.0 under .cache/sdist, fetched by tests/env/setup.sh) and the
real 0.29.0 series. The merge and the diff writer are also tested as functions of the tool itself.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from magpie import patch_rebase, patches, releases
from tests.releases import sdist_tree

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "magpie" / "patches.py"
PATCHES = REPO / "patches"
FIXTURES = REPO / "tests" / "fixtures" / "patches"
MTP_PATCH = "mtp_pruning/0001-draft-vocab-pruning.patch"

tool = patches  # the tool's functions, in-process (subprocess calls below run the file as users do)


sdist = sdist_tree  # a release's pristine sdist tree (tests/releases.py)


def run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def digest(root: Path, rels) -> dict[str, str | None]:
    out = {}
    for rel in rels:
        path = root / rel
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None
    return out


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "vllm").rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def copy_tree(src: Path, dest: Path) -> Path:
    shutil.copytree(src / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(src / "pyproject.toml", dest / "pyproject.toml")
    return dest


def files_of(patch_file: Path) -> list[str]:
    return [fp.path for fp in tool.parse_patch(patch_file.name, patch_file.read_text()).files]


# --------------------------------------------------------------------------------------------
# Which series the tool picks


def test_status_picks_the_series_of_each_supported_release():
    for version in ("0.29.0", "0.33.0"):
        proc = run_tool("status", "--json", "--target", str(sdist(version)))
        assert proc.returncode == 0, proc.stderr
        record = json.loads(proc.stdout)
        assert record["target"]["version"] == version
        assert Path(record["series"]) == PATCHES / f"vllm-{version}"
        assert record["patches"] and {p["state"] for p in record["patches"]} == {"not applied"}, record


def test_status_on_a_release_without_series_names_the_series_and_the_rebase_command():
    tree = sdist("0.30.0")
    proc = run_tool("status", "--target", str(tree))
    assert proc.returncode == 2
    assert proc.stdout == ""
    err = proc.stderr
    assert f"no series for vLLM 0.30.0; series exist for vLLM {', '.join(releases.series_releases())}." in err
    # The nearest series (0.29.0), with the user's own target in commands they can paste.
    assert f"magpie/patches.py check --series 0.29.0 --target {tree}" in err
    assert f"magpie/patches.py rebase --series 0.29.0 --base PRISTINE-0.29.0-TREE --target {tree}" in err
    assert "tests/env/fetch_sdist.py 0.29.0" in err


def test_nearest_series_prefers_the_closer_release():
    assert tool.nearest_series("0.30.0", ["0.29.0", "0.33.0"]) == "0.29.0"
    assert tool.nearest_series("0.31.0", ["0.29.0", "0.33.0"]) == "0.29.0"  # a tie: the older
    assert tool.nearest_series("0.32.0", ["0.29.0", "0.33.0"]) == "0.33.0"
    assert tool.nearest_series("0.34.1", ["0.29.0", "0.33.0"]) == "0.33.0"


def test_series_flag_tries_another_release_series_and_reports_conflicts():
    proc = run_tool("status", "--series", "0.29.0", "--target", str(sdist("0.30.0")))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "vllm-0.29.0/series" in proc.stdout and "conflicting" in proc.stdout
    proc = run_tool("status", "--series", "0.31.0", "--target", str(sdist("0.30.0")))
    assert (
        proc.returncode == 2 and "--series 0.31.0: no such series; series exist for vLLM 0.29.0, 0.33.0" in proc.stderr
    )


# --------------------------------------------------------------------------------------------
# rebase on the real sdists


def test_rebase_carries_mtp_pruning_onto_0_30_cleanly(tmp_path):
    base, new = sdist("0.29.0"), sdist("0.30.0")
    touched = files_of(PATCHES / "vllm-0.29.0" / MTP_PATCH)
    before = (digest(base, touched), digest(new, touched))
    out = tmp_path / "vllm-0.30.0"
    proc = run_tool("rebase", "mtp_pruning", "--base", str(base), "--target", str(new), "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{MTP_PATCH}: carried (5 merged, 1 new file)" in proc.stdout
    assert (digest(base, touched), digest(new, touched)) == before  # neither tree was changed

    # The series lists only what was carried, its comments naming the new release.
    series = (out / "series").read_text()
    assert "series for vLLM 0.30.0" in series
    assert [ln for ln in series.splitlines() if ln and not ln.startswith("#")] == [MTP_PATCH]
    text = (out / MTP_PATCH).read_text()
    header = text[: text.index("diff --git ")]
    assert "Target: vllm 0.30.0\nRebased-From: vllm 0.29.0 (magpie/patches.py rebase)\n" in header
    # Last-Update: the day of the rebase (UTC); the rest of the header is the 0.29.0 patch's.
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    assert f"\nLast-Update: {today}\n" in header
    old_text = (PATCHES / "vllm-0.29.0" / MTP_PATCH).read_text()
    old_header = old_text[: old_text.index("diff --git ")]
    assert (
        header.replace("Rebased-From: vllm 0.29.0 (magpie/patches.py rebase)\n", "")
        .replace("Target: vllm 0.30.0", "Target: vllm 0.29.0")
        .replace(f"Last-Update: {today}", re.search(r"Last-Update: .*", old_header).group())
        == old_header
    )
    # The module the patch creates is carried as it is (its diff section verbatim).
    new_module = "diff --git a/vllm/v1/spec_decode/draft_vocab.py"

    def module_section(patch_text: str) -> str:
        start = patch_text.index(new_module)
        end = patch_text.find("\ndiff --git ", start)
        return patch_text[start : end if end != -1 else None]

    assert module_section(text) == module_section(old_text)

    # The rebased patch applies to a copy of 0.30.0, compiles, and reverts byte for byte.
    tree = copy_tree(new, tmp_path / "tree")
    pristine = tree_digest(tree)
    status = run_tool("status", "--json", "--patches-dir", str(out), "--target", str(tree))
    assert [p["state"] for p in json.loads(status.stdout)["patches"]] == ["not applied"], status.stdout
    assert run_tool("apply", "--patches-dir", str(out), "--target", str(tree)).returncode == 0
    for rel in touched:
        py_compile.compile(str(tree / rel), cfile=str(tmp_path / "pyc" / rel) + "c", doraise=True)
    assert "draft_vocab_path" in (tree / "vllm/config/speculative.py").read_text()
    status = run_tool("status", "--json", "--patches-dir", str(out), "--target", str(tree))
    assert [p["state"] for p in json.loads(status.stdout)["patches"]] == ["applied"]
    assert run_tool("revert", "--patches-dir", str(out), "--target", str(tree)).returncode == 0
    assert tree_digest(tree) == pristine


def test_rebase_conflict_reports_each_hunk_with_both_sides_and_writes_nothing(tmp_path):
    base, new = sdist("0.29.0"), sdist("0.33.0")
    out = tmp_path / "vllm-0.33.0"
    proc = run_tool("rebase", "mtp_pruning", "--base", str(base), "--target", str(new), "--output", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr
    # 0.33 added SupportsHCSP on the very lines the patch adds LocalArgmaxMixin to.
    assert f"conflict 1: {MTP_PATCH}: vllm/models/qwen4_exp/nvidia/mtp.py hunk 1 (@@ " in err
    assert "vLLM 0.29.0 had (line " in err and "vLLM 0.33.0 has (line " in err and "the patch makes it (line" in err
    assert "| from vllm.model_executor.models.interfaces import SupportsHCSP, SupportsPP" in err
    assert "| from vllm.model_executor.models.interfaces import LocalArgmaxMixin, SupportsPP" in err
    assert "| class Qwen4ExpMTP(nn.Module, SupportsHCSP, SupportsPP, Qwen4ExpMixtureOfExperts):" in err
    assert "hunk(s) need a hand; no series was written" in err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind either


def test_rebase_of_a_stacked_series_keeps_sections_of_files_upstream_left_alone(tmp_path):
    # The fixture series: 0001 edits speculative.py and creates vllm/magpie_fixture.py, 0002 edits
    # both that new file and qwen3_5_mtp.py. Upstream changed speculative.py and qwen3_5_mtp.py.
    out = tmp_path / "demo-0.33.0"
    proc = run_tool(
        "rebase",
        "--patches-dir",
        str(FIXTURES),
        "--base",
        str(sdist("0.29.0")),
        "--target",
        str(sdist("0.33.0")),
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo/0001-marker-module.patch: carried (1 merged, 1 new file)" in proc.stdout
    assert "demo/0002-touch-mtp.patch: carried (1 merged, 1 unchanged upstream)" in proc.stdout
    old = (FIXTURES / "demo" / "0002-touch-mtp.patch").read_text()
    new = (out / "demo" / "0002-touch-mtp.patch").read_text()
    fixture_section = [s for s in tool._sections(old) if s.startswith("diff --git a/vllm/magpie_fixture.py")]
    assert fixture_section and fixture_section[0] in tool._sections(new)  # verbatim: stacked on 0001's file
    tree = copy_tree(sdist("0.33.0"), tmp_path / "tree")
    pristine = tree_digest(tree)
    proc = run_tool("apply", "--patches-dir", str(out), "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert 'MARKER = "demo-0002"' in (tree / "vllm/magpie_fixture.py").read_text()
    assert run_tool("revert", "--patches-dir", str(out), "--target", str(tree)).returncode == 0
    assert tree_digest(tree) == pristine


def test_rebase_reports_a_file_upstream_removed(tmp_path):
    new = copy_tree(sdist("0.30.0"), tmp_path / "moved")
    (new / "vllm/model_executor/models/qwen3_5_mtp.py").unlink()
    out = tmp_path / "out"
    proc = run_tool(
        "rebase",
        "--patches-dir",
        str(FIXTURES),
        "--base",
        str(sdist("0.29.0")),
        "--target",
        str(new),
        "--output",
        str(out),
    )
    assert proc.returncode == 1
    assert "demo/0002-touch-mtp.patch: vllm/model_executor/models/qwen3_5_mtp.py hunk 1 (@@ -" in proc.stderr
    assert "does not exist in vLLM 0.30.0 (moved or removed upstream)" in proc.stderr
    assert "vLLM 0.30.0 has: (no such file)" in proc.stderr
    assert not out.exists()


def test_rebase_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    args = ["rebase", "--patches-dir", str(FIXTURES), "--base", str(sdist("0.29.0")), "--target", str(sdist("0.30.0"))]
    proc = run_tool(*args, "--output", str(out))
    assert proc.returncode == 1 and "exists; pass --force" in proc.stderr and "nothing was written" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    proc = run_tool(*args, "--output", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["demo", "series"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_rebase_refuses_a_base_that_is_not_the_pristine_release(tmp_path):
    new = str(sdist("0.30.0"))
    proc = run_tool("rebase", "--base", str(sdist("0.28.0")), "--series", "0.29.0", "--target", new)
    assert proc.returncode == 2
    assert "is vLLM 0.28.0, but the series" in proc.stderr and "give a pristine 0.29.0 tree" in proc.stderr
    patched = copy_tree(sdist("0.29.0"), tmp_path / "patched")
    assert run_tool("apply", "--patches-dir", str(FIXTURES), "--target", str(patched)).returncode == 0
    proc = run_tool(
        "rebase",
        "--patches-dir",
        str(FIXTURES),
        "--base",
        str(patched),
        "--target",
        new,
        "--output",
        str(tmp_path / "o"),
    )
    assert proc.returncode == 2 and "is not a pristine vLLM 0.29.0" in proc.stderr
    proc = run_tool("rebase", "--target", new)
    assert proc.returncode == 2 and "rebase needs --base DIR" in proc.stderr
    proc = run_tool("rebase", "--base", new, "--target", str(sdist("0.33.0")))
    assert proc.returncode == 2
    assert "is vLLM 0.30.0, which has no series; series exist for vLLM 0.29.0, 0.33.0" in proc.stderr


def test_rebase_help_is_enough_on_its_own():
    proc = run_tool("rebase", "--help")
    assert proc.returncode == 0
    for needed in (
        "--base DIR",
        "--output DIR",
        "--force",
        "three versions are merged",
        "git is not needed",
        "nothing at all is written",
    ):
        assert needed in proc.stdout, needed


# --------------------------------------------------------------------------------------------
# The merge and the diff writer


def lines(text: str) -> list[str]:
    return tool.split_lines(text)


def test_merge3_takes_each_side_and_neighbouring_edits():
    base = lines("a\nb\nc\nd\ne\n")
    ours = lines("a\nb\nc\nX\nd\ne\n")  # upstream inserts after c
    theirs = lines("a\nB\nc\nd\ne\n")  # the patch edits b
    assert patch_rebase.merge3(base, ours, theirs) == (lines("a\nB\nc\nX\nd\ne\n"), [])
    # Adjacent: upstream drops a decorator right above the line the patch edits.
    base = lines("@dec\nclass A(B):\n    x = 1\n")
    ours = lines("class A(B):\n    x = 1\n")
    theirs = lines("@dec\nclass A(M, B):\n    x = 1\n")
    assert patch_rebase.merge3(base, ours, theirs) == (lines("class A(M, B):\n    x = 1\n"), [])
    # The same edit on both sides is no conflict.
    assert patch_rebase.merge3(lines("a\nb\n"), lines("a\nB\n"), lines("a\nB\n")) == (lines("a\nB\n"), [])


def test_merge3_reports_edits_of_the_same_line_and_insertions_at_one_place():
    merged, conflicts = patch_rebase.merge3(lines("a\nb\nc\n"), lines("a\nB1\nc\n"), lines("a\nB2\nc\n"))
    assert merged == lines("a\nB1\nc\n")  # ours kept where it conflicts
    assert conflicts == [(1, ["b\n"], 1, ["B1\n"], 1, ["B2\n"])]
    _, conflicts = patch_rebase.merge3(lines("a\nc\n"), lines("a\nX\nc\n"), lines("a\nY\nc\n"))
    assert len(conflicts) == 1


@pytest.mark.parametrize(
    "before, after",
    [
        ("a\nb\nc\n", "a\nb\nc"),  # the last newline removed
        ("a\nb\nc", "a\nB\nc"),  # no newline at the end on either side
        ("x\n" * 20 + "end", "y\n" + "x\n" * 20 + "end\n"),
        (None, "new\nfile"),
        ("gone\n", None),
    ],
)
def test_file_diff_round_trips_through_the_parser(before, after):
    text = tool.file_diff("vllm/f.py", before, after)
    (fp,) = tool.parse_patch("t.patch", text).files
    assert tool.apply_file(fp, before, reverse=False) == after
    assert tool.apply_file(fp, after, reverse=True) == before


def test_file_diff_between_two_releases_of_a_real_file_round_trips():
    rel = "vllm/config/speculative.py"
    old = (sdist("0.29.0") / rel).read_text()
    new = (sdist("0.33.0") / rel).read_text()
    text = tool.file_diff(rel, old, new)
    assert text.startswith(f"diff --git a/{rel} b/{rel}\nindex ")
    # git's default hunk context: the definition above the hunk.
    assert re.search(r"^@@ -\d+,\d+ \+\d+,\d+ @@ class SpeculativeConfig:$", text, re.M)
    (fp,) = tool.parse_patch("t.patch", text).files
    assert tool.apply_file(fp, old, reverse=False) == new
    assert tool.apply_file(fp, new, reverse=True) == old
    # git's blob ids in the index line, as `git diff` writes them.
    blob = subprocess.run(["git", "hash-object", "--stdin"], input=old, capture_output=True, text=True)
    if blob.returncode == 0:
        assert text.splitlines()[1].startswith(f"index {blob.stdout.strip()[:7]}..")


def test_rebase_work_dir_hand_resolution_then_carry_and_stale_resolutions_are_caught(tmp_path):
    base, new = sdist("0.29.0"), sdist("0.33.0")
    series = tmp_path / "series-0.29.0"
    shutil.copytree(PATCHES / "vllm-0.29.0", series)
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["rebase", "mtp_pruning", "--patches-dir", str(series), "--base", str(base), "--target", str(new)]
    args += ["--output", str(out), "--work", str(work)]
    proc = run_tool(*args)
    assert proc.returncode == 1 and not out.exists()
    merged = work / MTP_PATCH.removesuffix(".patch") / "vllm/models/qwen4_exp/nvidia/mtp.py"
    assert f"resolve it in {merged}" in proc.stderr
    text = merged.read_text()
    blocks = re.findall(
        r"^<<<<<<< vLLM 0.33.0\n(.*?)^\|\|\|\|\|\|\| vLLM 0.29.0\n(.*?)^=======\n(.*?)^>>>>>>> ", text, re.M | re.S
    )
    assert len(blocks) == 2
    assert blocks[0][0] == "from vllm.model_executor.models.interfaces import SupportsHCSP, SupportsPP\n"
    assert "LocalArgmaxMixin, SupportsPP" in blocks[0][2]
    # Resolve both: upstream's SupportsHCSP and the patch's LocalArgmaxMixin.
    text = text.replace(
        "".join(
            ["<<<<<<< vLLM 0.33.0\n", *blocks[0][0], "||||||| vLLM 0.29.0\n", blocks[0][1], "=======\n", blocks[0][2]]
        ),
        "from vllm.model_executor.models.interfaces import LocalArgmaxMixin, SupportsHCSP, SupportsPP\n",
    )
    text = re.sub(
        r"^<<<<<<< vLLM 0.33.0\nclass Qwen4ExpMTP\(nn.Module, .*?^>>>>>>> .*?\n",
        "class Qwen4ExpMTP(LocalArgmaxMixin, nn.Module, SupportsHCSP, SupportsPP, Qwen4ExpMixtureOfExperts):\n",
        re.sub(r"^>>>>>>> .*\n", "", text, count=1, flags=re.M),
        count=1,
        flags=re.M | re.S,
    )
    assert not patch_rebase.has_markers(text)
    merged.write_text(text)
    proc = run_tool(*args)
    assert proc.returncode == 0, proc.stderr
    assert "carried (4 merged, 1 new file, 1 resolved by hand)" in proc.stdout
    tree = copy_tree(new, tmp_path / "tree")
    assert run_tool("apply", "--patches-dir", str(out), "--target", str(tree)).returncode == 0
    assert (tree / "vllm/models/qwen4_exp/nvidia/mtp.py").read_text() == text

    # The patch changes in that file: the old resolution is stale, so it is set aside, not used.
    patch_file = series / MTP_PATCH
    patch_text = patch_file.read_text()
    marker = "+    # speculative_config.draft_vocab_path is honoured (draft_vocab.HOOK_ATTRIBUTE).\n"
    assert patch_text.count(marker) == 2
    patch_file.write_text(patch_text.replace(marker, marker.replace("honoured", "honored")))
    proc = run_tool(*args, "--force")
    assert proc.returncode == 1
    assert "was resolved for other inputs" in proc.stderr
    assert Path(str(merged) + ".old").read_text() == text
    assert patch_rebase.has_markers(merged.read_text())
    assert (out / "series").exists()  # the earlier output is left as it was
