"""The patch header convention (patches/README.md): `Last-Update:` and `Proof-Log:` are checked
by the patch tool; log_check takes the lines that prove a patch active from those headers; and
`patches.py extract` writes every file the series create, which tests/lint.sh lints as Python.

Fast: no vLLM is imported. Header copies go to tmp_path; the real series are only read.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from magpie import patches
from magpie.measure import log_check

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "magpie" / "patches.py"
PATCHES = REPO / "patches"
FIXTURES = REPO / "tests" / "fixtures" / "patches"
FIRST = "demo/0001-marker-module.patch"


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def fixture_copy(tmp_path: Path, edit) -> Path:
    """The fixture series with the header of its first patch passed through `edit`."""
    root = tmp_path / "series"
    shutil.copytree(FIXTURES, root)
    patch = root / FIRST
    header, sep, body = patch.read_text().partition("\n---\n")
    patch.write_text(edit(header) + sep + body)
    return root


def drop_field(field: str):
    return lambda header: "\n".join(line for line in header.split("\n") if not line.startswith(field + ":"))


def all_series() -> dict[str, list[patches.Patch]]:
    return {release: patches.load_series(folder) for release, folder in patches.available_series(str(PATCHES)).items()}


@pytest.mark.parametrize("field", ["Last-Update", "Proof-Log", "Target", "Requires", "Activation"])
def test_a_header_without_a_required_field_is_refused_naming_the_file_and_the_field(tmp_path, field):
    root = fixture_copy(tmp_path, drop_field(field))
    sdist = REPO / ".cache" / "sdist" / "vllm-0.29.0"  # status only reads it
    for args in (["list"], ["status", "--target", str(sdist)]):
        proc = run_tool(*args, "--patches-dir", str(root))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"{root / FIRST}: the header has no `{field}:` field" in proc.stderr


@pytest.mark.parametrize(
    "value, message",
    [
        ("1 Dec 2026", "`Last-Update: 1 Dec 2026` is not a date; write it as YYYY-MM-DD"),
        ("2026-13-01", "`Last-Update: 2026-13-01`: month must be in 1..12"),
    ],
)
def test_a_malformed_last_update_is_refused(tmp_path, value, message):
    root = fixture_copy(tmp_path, lambda h: re.sub(r"^Last-Update: .*$", f"Last-Update: {value}", h, flags=re.M))
    proc = run_tool("list", "--patches-dir", str(root))
    assert proc.returncode == 2 and f"{root / FIRST}: {message}" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "value, message",
    [
        ("just a line", "`Proof-Log: just a line`: expected `Proof-Log: NAME: REGEX`"),
        ("marker: unbalanced (group", "`Proof-Log: marker`: the regular expression does not compile"),
    ],
)
def test_a_malformed_proof_log_is_refused(tmp_path, value, message):
    root = fixture_copy(tmp_path, lambda h: re.sub(r"^Proof-Log: .*$", f"Proof-Log: {value}", h, flags=re.M))
    proc = run_tool("list", "--patches-dir", str(root))
    assert proc.returncode == 2 and message in proc.stderr and str(root / FIRST) in proc.stderr, proc.stderr


def test_repeated_proof_log_lines_are_each_kept():
    header = "Description: x\nProof-Log: a: one\nProof-Log: b: two (?P<n>\\d+)\nLast-Update: 2026-12-01\n"
    proofs = patches.proof_logs(patches.parse_header(header))
    assert [(p.name, p.regex.pattern) for p in proofs] == [("a", "one"), ("b", r"two (?P<n>\d+)")]


def test_every_real_patch_carries_a_date_and_at_least_one_proof_line():
    for release, series in all_series().items():
        for patch in series:
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", patch.fields["last-update"]), (release, patch.name)
            assert patch.proof_logs, f"{release} {patch.name}: `Proof-Log: none` is for test fixtures only"


def test_the_0_29_series_declares_every_patch_line_log_check_reads():
    declared = {p.name for patch in all_series()["0.29.0"] for p in patch.proof_logs}
    assert set(log_check.PROOF_LOGS) <= declared


def test_a_header_change_changes_nothing_the_patch_applies(tmp_path):
    """The same diff under the header with and without the new fields parses to the same hunks."""
    for folder in patches.available_series(str(PATCHES)).values():
        for entry in (line.split("#")[0].strip() for line in Path(folder, "series").read_text().splitlines()):
            if not entry:
                continue
            text = Path(folder, entry).read_text()
            bare = re.sub(r"^(Last-Update|Proof-Log): .*\n", "", text, flags=re.M)
            assert bare != text
            assert patches.parse_patch(entry, bare).files == patches.parse_patch(entry, text).files


# --------------------------------------------------------------------------------------------
# log_check reads its patch lines from the headers


def ple_lines(how: str) -> list[str]:
    return [
        "non-default args: {'model': '/m', 'hf_overrides': {'ple_mmap': True}}",
        f"INFO ple_mmap: model.layers.0.ple.ngram_embedding served from the checkpoint's memory mappings "
        f"(4 shards, 2.0 MiB), MADV_RANDOM; {how}",
    ]


def test_log_check_follows_the_proof_lines_of_the_headers(tmp_path):
    lines = ple_lines("rows staged before each forward by Qwen4ExpModelState.prepare_inputs")
    assert log_check.check(lines)["features"]["ple_mmap"]["state"] == "on"
    # The same log against a copy of the series whose 0002 declares another table line.
    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    patch = copy / "vllm-0.29.0" / "ple_ssd" / "0002-stage-rows-before-forward.patch"
    text = patch.read_text()
    patch.write_text(text.replace("(?P<how>rows staged before each forward)", "(?P<how>rows staged elsewhere)"))
    ple = log_check.check(lines, patches_dir=str(copy))["features"]["ple_mmap"]
    assert ple["state"] == "requested, not confirmed"
    # ... and with the line it declares, the check sees it again.
    lines[1] = lines[1].replace("staged before each forward", "staged elsewhere")
    assert log_check.check(lines, patches_dir=str(copy))["features"]["ple_mmap"]["state"] == "on"


def test_log_check_takes_the_series_of_the_release_the_log_names(tmp_path):
    """A 0.29.0 log is read with the 0.29.0 series only: a broken 0.33.0 header does not stop it."""
    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    broken = copy / "vllm-0.33.0" / "mtp_pruning" / "0001-draft-vocab-pruning.patch"
    broken.write_text(re.sub(r"^Last-Update: .*\n", "", broken.read_text(), flags=re.M))
    engine = "Initializing a V1 LLM engine (v0.29.0) with config: model='/m', speculative_config=None"
    lines = [engine, *ple_lines("rows gathered per step by the custom op vllm::qwen4_exp_ple_mmap_lookup")]
    ple = log_check.check(lines, patches_dir=str(copy))["features"]["ple_mmap"]
    assert ple["state"] == "on" and "gathered inside the forward" in ple["rows"]
    # A log that names no release is read with every series: then the broken header is an error.
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(patches.ToolError, match="the header has no `Last-Update:` field"):
        log_check.check(lines[1:], patches_dir=str(copy))


# --------------------------------------------------------------------------------------------
# extract: the files the series create, for the lint step


def created_in_diff_text(text: str) -> list[str]:
    """Paths of the files a patch creates, read from its raw text (`--- /dev/null` then `+++ b/`)."""
    return re.findall(r"^--- /dev/null\n\+\+\+ b/(\S+)$", text, flags=re.M)


def test_extract_writes_every_new_python_file_of_every_series_as_each_patch_leaves_it(tmp_path):
    out = tmp_path / "extracted"
    proc = run_tool("extract", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    written = {str(Path(p).relative_to(out)) for p in proc.stdout.split()}
    assert written == {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    expected = set()
    for release, folder in patches.available_series(str(PATCHES)).items():
        created: set[str] = set()
        for entry in (line.split("#")[0].strip() for line in Path(folder, "series").read_text().splitlines()):
            if not entry:
                continue
            text = Path(folder, entry).read_text()
            created |= set(created_in_diff_text(text))
            touched = set(re.findall(r"^\+\+\+ b/(\S+)$", text, flags=re.M))
            for path in created & touched:
                expected.add(f"vllm-{release}/{entry.removesuffix('.patch')}/{path}")
    assert {p for p in expected if p.endswith(".py")}, "no series creates a Python file?"
    assert written == expected


@pytest.mark.parametrize("release", ["0.29.0", "0.33.0"])
def test_extracted_files_equal_what_apply_writes_into_the_sdist(tmp_path, release):
    """The last version extract writes of each file is the file `apply` leaves in a real tree."""
    sdist = REPO / ".cache" / "sdist" / f"vllm-{release}"
    if not (sdist / "vllm" / "__init__.py").exists():
        pytest.fail(f"{sdist} is missing: run tests/env/setup.sh (tests/run.sh does)")
    out = tmp_path / "extracted"
    assert run_tool("extract", "--series", release, "--output", str(out)).returncode == 0
    tree = tmp_path / "tree"
    shutil.copytree(sdist / "vllm", tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(sdist / "pyproject.toml", tree / "pyproject.toml")
    proc = run_tool("apply", "--target", str(tree))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last: dict[Path, Path] = {}
    for patch in patches.load_series(str(PATCHES / f"vllm-{release}")):  # series order: later wins
        for path in sorted((out / f"vllm-{release}" / patch.name.removesuffix(".patch")).rglob("*")):
            if path.is_file():
                last[path.relative_to(out / f"vllm-{release}" / patch.name.removesuffix(".patch"))] = path
    assert last
    for rel, path in last.items():
        assert path.read_text() == (tree / rel).read_text(), rel


def test_extract_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    proc = run_tool("extract", "--output", str(tmp_path))
    assert proc.returncode == 2 and f"--output {tmp_path} exists and is not empty" in proc.stderr


def test_real_headers_are_short_and_keep_their_history_out():
    """A header says what, why, what stays stock and where the docs are (patches/README.md): at most
    18 lines of description, and no verification log or measured figure of its own."""
    for release, series in all_series().items():
        for patch in series:
            description = patch.fields["description"].splitlines()
            assert len(description) <= 18, (release, patch.name, len(description))
            text = " ".join(description)
            assert not re.search(r"\d+(\.\d+)? ms\b|\bmeasured on\b|\bwas not chosen\b", text), (release, patch.name)
            assert "docs/" in text or "patches/README.md" in text, (release, patch.name)
