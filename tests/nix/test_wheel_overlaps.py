"""`magpie pin-wheels --overlaps` over every committed closure (both systems, every release with
pins): no installed path is shipped by two wheels of one closure unless nix/wheel-overlaps.json
allows it with a reason, because nixpkgs installs the closure with pypa/installer one wheel at a
time and installer refuses to overwrite (tests/nix/test_wheel_install.py runs that install). The
wheels' paths are nix/pins/wheel-files.json.xz (`pin-wheels --wheel-files`, read from each pinned
wheel's RECORD and entry points); the check itself needs no network, so checks.tests runs it."""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

from magpie import releases
from tests.nix.nixeval import REPO


def overlaps(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "magpie"), "pin-wheels", "--overlaps", "--repo", str(repo)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_of_nix(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "nix", repo / "nix")
    return repo


def edit(path: Path, change) -> None:
    packed = path.suffix == ".xz"
    data = json.loads(lzma.decompress(path.read_bytes()) if packed else path.read_text())
    change(data)
    text = json.dumps(data)
    if packed:
        path.write_bytes(lzma.compress(text.encode()))
    else:
        path.write_text(text)


def test_every_committed_closure_has_only_the_allowed_overlaps():
    out = overlaps(REPO)
    assert out.returncode == 0, out.stderr
    closures = len(releases.series_releases()) * 2
    assert f"no unlisted overlaps in {closures} closures" in out.stdout


def test_every_pinned_wheel_of_every_closure_is_recorded():
    recorded = json.loads(lzma.decompress((REPO / "nix" / "pins" / "wheel-files.json.xz").read_bytes()))["wheels"]
    for release in releases.series_releases():
        for system in ("aarch64-linux", "x86_64-linux"):
            pins = json.loads((REPO / releases.pins_file(release, system)).read_text())["wheels"]
            for wheel in pins.values():
                assert recorded[wheel["filename"]]["sha256"] == wheel["sha256"], wheel["filename"]
    torch = next(name for name in recorded if name.startswith("torch-"))
    assert "__init__.py" in recorded[torch]["paths"]["site-packages/torch"]


def test_the_build_backend_overlap_is_refused_without_its_entry(tmp_path):
    """The flake before issue 27: no table, and every closure installs build_backend.py twice."""
    repo = copy_of_nix(tmp_path)
    edit(repo / "nix" / "wheel-overlaps.json", lambda table: table["allowed"].clear())
    out = overlaps(repo)
    assert out.returncode == 1
    refused = [line for line in out.stderr.splitlines() if "site-packages/build_backend.py is installed by" in line]
    assert len(refused) == len(releases.series_releases()) * 2, out.stderr
    assert all("flashinfer-python, torch-c-dlpack-ext" in line for line in refused)


def test_a_new_overlap_is_refused_naming_the_path_and_the_wheels(tmp_path):
    repo = copy_of_nix(tmp_path)
    pins = json.loads((REPO / "nix" / "pins" / "x86_64-linux.json").read_text())["wheels"]
    numpy = pins["numpy"]["filename"]

    def add(files):
        files["wheels"][numpy]["paths"].setdefault("site-packages/torch", []).append("__init__.py")

    edit(repo / "nix" / "pins" / "wheel-files.json.xz", add)
    out = overlaps(repo)
    assert out.returncode == 1
    assert (
        "nix/pins/x86_64-linux.json: site-packages/torch/__init__.py is installed by numpy, torch; "
        "pypa/installer (nixpkgs' pypaInstallHook) refuses the second"
    ) in out.stderr


def test_an_unrecorded_wheel_and_a_stale_entry_are_refused_with_the_fix(tmp_path):
    repo = copy_of_nix(tmp_path)
    pins = json.loads((REPO / "nix" / "pins" / "x86_64-linux.json").read_text())["wheels"]
    edit(repo / "nix" / "pins" / "wheel-files.json.xz", lambda f: f["wheels"].pop(pins["numpy"]["filename"]))
    out = overlaps(repo)
    assert out.returncode == 1
    assert "run `python3 magpie pin-wheels --wheel-files --release" in out.stderr

    repo = copy_of_nix(tmp_path / "second")

    def stale(table):
        table["allowed"]["site-packages/gone.py"] = {"wheels": ["numpy"], "drop_from": ["numpy"], "reason": "x"}

    edit(repo / "nix" / "wheel-overlaps.json", stale)
    out = overlaps(repo)
    assert out.returncode == 1
    assert "site-packages/gone.py is installed by at most one wheel of every closure; remove its entry" in out.stderr


def test_wheel_files_keeps_recorded_wheels_and_drops_unpinned_ones_offline(tmp_path):
    """Every pinned wheel is recorded, so --wheel-files reads nothing from the network and writes
    the committed file again; an entry of a file no closure pins is dropped."""
    repo = copy_of_nix(tmp_path)
    target = repo / "nix" / "pins" / "wheel-files.json.xz"
    committed = lzma.decompress((REPO / "nix" / "pins" / "wheel-files.json.xz").read_bytes())
    edit(target, lambda f: f["wheels"].update({"gone-1.0-py3-none-any.whl": {"sha256": "0", "paths": {}}}))
    out = subprocess.run(
        [sys.executable, str(REPO / "magpie"), "pin-wheels", "--wheel-files", "--repo", str(repo)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "read " not in out.stderr  # no wheel was fetched
    assert lzma.decompress(target.read_bytes()) == committed
