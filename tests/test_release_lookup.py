"""Each release fact has one definition: what release a version string belongs to, how releases
sort, and which releases have a patch series (the table's `series: true` rows are the series
folders the patch tool finds, or loading the table says which to fix)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from magpie import patches, releases

REPO = Path(__file__).resolve().parent.parent

VERSIONS = [
    "0.29.0",
    "0.29.0+cpu",
    "0.33.0rc1",
    "0.33.1.dev3+g1234abc",
    "v0.34.0",
    " 0.34.0\n",
    "0.33",
    "0.33.0.1",
    "unknown",
    "",
    None,
    "vllm 0.29.0",
    "10.2.3",
]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_two_release_of_agree_on_every_version(version):
    assert releases.release_of(version) == patches.release_of(version)


def test_release_of_reads_major_minor_patch_only():
    got = {v: patches.release_of(v) for v in VERSIONS}
    assert got["0.33"] is None and got["unknown"] is None and got[None] is None and got["vllm 0.29.0"] is None
    assert got["0.29.0+cpu"] == "0.29.0" and got["0.33.0rc1"] == "0.33.0" and got["v0.34.0"] == "0.34.0"
    assert got["0.33.1.dev3+g1234abc"] == "0.33.1" and got["0.33.0.1"] == "0.33.0"


def test_the_release_keys_agree_and_sort_as_releases_do():
    names = ["0.10.0", "0.9.1", "0.29.0", "0.9.0", "1.0.0", "0.33.0"]
    assert [releases.key(r) for r in names] == [patches.release_key(r) for r in names]
    assert sorted(names, key=releases.key) == ["0.9.0", "0.9.1", "0.10.0", "0.29.0", "0.33.0", "1.0.0"]


def test_the_table_s_series_are_the_folders_the_patch_tool_finds():
    assert list(patches.available_series(str(REPO / "patches"))) == releases.series_releases()


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "magpie").mkdir(parents=True)
    shutil.copy(REPO / "magpie" / "releases.json", root / "magpie" / "releases.json")
    shutil.copytree(REPO / "patches", root / "patches")
    return root


def test_a_series_row_without_its_folder_is_refused_naming_both(tmp_path, monkeypatch):
    root = _checkout(tmp_path)
    release = releases.series_releases()[0]
    shutil.rmtree(root / "patches" / f"vllm-{release}")
    monkeypatch.setenv("MAGPIE_RELEASES", str(root / "magpie" / "releases.json"))
    with pytest.raises(releases.ReleaseError, match=rf"releases\.{release} has `series: true` but .*/series"):
        releases.series_releases()


def test_a_series_folder_without_its_row_is_refused_naming_it(tmp_path, monkeypatch):
    root = _checkout(tmp_path)
    table = json.loads((root / "magpie" / "releases.json").read_text())
    newest = releases.series_releases()[-1]
    shutil.copytree(root / "patches" / f"vllm-{newest}", root / "patches" / "vllm-9.9.0")
    (root / "magpie" / "releases.json").write_text(json.dumps(table))
    monkeypatch.setenv("MAGPIE_RELEASES", str(root / "magpie" / "releases.json"))
    with pytest.raises(releases.ReleaseError, match=r"vllm-9\.9\.0: a series folder without a `series: true` row"):
        releases.series_releases()
