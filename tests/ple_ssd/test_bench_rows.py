"""bench_rows as docs/ple_ssd.md runs it: a real table file, upstream's loop and ours side by side,
warm and cold, the bytes checked by the tool itself."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench_rows(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "magpie.ple_ssd.bench_rows", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_prints_upstream_and_ours_side_by_side_warm_and_cold(tmp_path):
    # Cold rows need a disk whose pages DONTNEED drops: /var/tmp, as the tool's default.
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="bench-rows-test-") as folder:
        out = tmp_path / "rows.json"
        proc = bench_rows(
            "--dir", folder, "--table-mib", "4", "--rows", "16", "512", "--repeats", "3",
            "--states", "warm", "cold", "--conditions", "server", "--json", str(out),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert list(Path(folder).iterdir()) == []  # the table file is removed without --keep
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["condition", "state", "rows"]
    cells = {tuple(line.split()[:3]) for line in lines[1:]}
    assert cells == {("server", s, r) for s in ("warm", "cold") for r in ("16", "512")}
    results = json.loads(out.read_text())
    readers = {(r["state"], r["rows"], r["reader"]) for r in results}
    for rows in (16, 512):
        assert {("warm", rows, "upstream"), ("warm", rows, "ours(fadvise)")} <= readers
        cold = ("upstream", "ours(fadvise)", "ours(populate)", "floor(O_DIRECT)")
        assert {("cold", rows, n) for n in cold} <= readers
        assert ("warm", rows, "floor(O_DIRECT)") not in readers  # the floor is a cold figure
    for r in results:
        assert r["repeats"] == 3 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]


def refusal(capsys, *args: str) -> tuple[object, str]:
    """The exit status and stderr of the tool's main: in this process, as the refusals come from
    argparse before any work (sys.exit(main()) exits with the same status; the test above runs
    the tool as `python -m`)."""
    from magpie.ple_ssd import bench_rows as tool

    with pytest.raises(SystemExit) as exited:
        tool.main(list(args))
    return exited.value.code, capsys.readouterr().err


def test_refuses_too_few_repeats_and_more_rows_than_the_table(capsys):
    code, err = refusal(capsys, "--repeats", "2")
    assert code == 2 and "--repeats must be at least 3" in err
    code, err = refusal(capsys, "--table-mib", "1", "--rows", "100000")
    assert code == 2 and "--rows 100000 exceeds the table's 3276 rows: raise --table-mib" in err
