"""The one schema prefix: every tool writes "magpie/<name>/<version>" (files.schema), and every
schema string a committed result file carries, under an older prefix too, reads back as a
(name, version) pair (files.schema_of), so readers keep reading what was measured before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from magpie import files

REPO = Path(__file__).resolve().parent.parent


def committed_schemas() -> dict[str, str]:
    """path -> schema string, for every committed JSON result file that has one."""
    found = {}
    for path in sorted([*REPO.glob("measurements/**/*.json"), *REPO.glob("docs/data/**/*.json")]):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and "schema" in data:
            found[str(path.relative_to(REPO))] = data["schema"]
    return found


def test_schema_writes_the_one_prefix_and_reads_it_back():
    assert files.schema("bench-decode", 3) == "magpie/bench-decode/3"
    assert files.schema_of(files.schema("bench-decode", 3)) == ("bench-decode", 3)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("flash-next/sweep/2", ("sweep", 2)),
        ("mtp_pruning/count-tokens/1", ("count-tokens", 1)),
        ("mtp-pruning/bench-draft-head/2", ("bench-draft-head", 2)),
        ("gpu-harness/results/1", ("gpu-harness-results", 1)),
        ("magpie/sweep/x", None),
        ("other/sweep/1", None),
        ("flash-next/a/b/1", None),
        (3, None),
    ],
)
def test_schema_of_reads_the_older_prefixes_and_refuses_the_rest(value, expected):
    assert files.schema_of(value) == expected


def test_every_committed_result_file_has_a_readable_schema():
    found = committed_schemas()
    assert len(found) >= 10, found  # the measurements of issues 13-19 and the docs' data
    unreadable = {path: value for path, value in found.items() if files.schema_of(value) is None}
    assert not unreadable, f"schema strings files.schema_of cannot read: {unreadable}"
