"""The wheel closure's install phase (nix/wheels.nix), as the flake evaluates it, run in the emulated
build sandbox over the real pinned wheels that ship the same path, with the installer nixpkgs runs.

nixpkgs' pypaInstallHook runs pypa/installer once per wheel into one prefix, and installer refuses
to write a file an earlier wheel wrote: flashinfer-python and torch-c-dlpack-ext both ship a
top-level build_backend.py, so the plain hook stops with FileExistsError. The stand-in's hook
(tests/nix/nixpkgs-stand-in) behaves the same way; this runs it with the closure's own unpack
phase and preInstall (which drops the paths nix/wheel-overlaps.json allows, through
magpie/nix/drop_wheel_paths.py), the store paths mapped to the same files here: the wheels
tests/env/fetch_wheels.py fetched into .cache/wheels (checked against the pins' sha256), the
installer 1.1.0 wheel, the repository's script and table. Only the overlapping wheels are
installed (the whole closure is several GB); the overlap check over every closure is
magpie/nix/pin_wheels.py --overlaps (tests/nix/test_wheel_overlaps.py).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from magpie import releases
from tests.env import fetch_wheels
from tests.nix.nixeval import REPO
from tests.nix.test_flake_outputs import flake_eval
from tests.nix.test_sandbox_emulation import SYSTEM, emulate

WHEELS = REPO / ".cache" / "wheels"
INSTALLER = WHEELS / fetch_wheels.INSTALLER["filename"]
STORE_PATH = re.compile(r"/nix/store/[0-9a-z]{32}-[^/\s'\"]+")
STDENV = ["coreutils", "findutils", "diffutils", "gnused", "gnugrep", "gawk", "bash", "patchelf"]


def closure_of(release: str) -> dict:
    scope = f'(scope "{SYSTEM}")'
    if release != releases.default():
        scope += f'.releases."{release}"'
    return flake_eval(
        f"let w = {scope}.wheelClosure; hook = builtins.head "
        '(builtins.filter (p: p.name == "pypa-install-hook") w.nativeBuildInputs); in '
        "{ inherit (w) unpackPhase; preInstall = w.preInstall or null; hook = hook.setupHookText; "
        'wheels = map (p: { path = "${p}"; name = p.name; }) w.wheels; '
        'drop = "${repo + "/magpie/nix/drop_wheel_paths.py"}"; overlaps = "${repo + "/nix/wheel-overlaps.json"}"; '
        f'python = (scope "{SYSTEM}").python.pythonOnBuildForHost.interpreter; }}'
    )


def overlapping(release: str) -> list[dict]:
    pins = json.loads((REPO / releases.pins_file(release, SYSTEM)).read_text())["wheels"]
    names = fetch_wheels.overlapping_wheels()
    return [pins[name] for name in sorted(names & set(pins))]


def install_script(closure: dict, wheels: list[dict], tmp_path: Path, *, with_pre_install: bool) -> str:
    """The build's install as stdenv runs it: the hook sourced, the unpack phase (cut to the
    wheels given), then the install phase, every store path mapped to the file here."""
    local = {wheel["filename"]: WHEELS / wheel["filename"] for wheel in wheels}
    for path in local.values():
        if not path.exists():
            pytest.skip(f"{path.name} is not in .cache/wheels: run `python3 tests/env/fetch_wheels.py .cache/wheels`")
    store = {
        closure["python"]: "python3",
        closure["drop"]: str(REPO / "magpie" / "nix" / "drop_wheel_paths.py"),
        closure["overlaps"]: str(REPO / "nix" / "wheel-overlaps.json"),
    }
    store |= {w["path"]: str(local[w["name"]]) for w in closure["wheels"] if w["name"] in local}
    unpack = [
        line
        for line in closure["unpackPhase"].splitlines()
        if not line.strip().startswith("ln -s ") or any(f"dist/{name}" in line for name in local)
    ]
    pre_install = closure["preInstall"] if with_pre_install and closure["preInstall"] else ""
    text = "\n".join(
        [
            # stdenv's runHook for the hooks this build sets (a variable holding shell text).
            'runHook() { local hook="$1"; if [ -n "${!hook-}" ]; then eval "${!hook}"; fi; }',
            f"preInstall={shlex.quote(pre_install)}",
            # The installer the hook propagates into the build's Python path.
            f'export PYTHONPATH="{INSTALLER}"',
            closure["hook"],
            closure["unpackPhase"] and "\n".join(unpack),
            '[ "$installPhase" = pypaInstallPhase ]',
            "pypaInstallPhase",
            'echo "installed into $out"',
        ]
    )
    for path, here in sorted(store.items(), key=lambda item: -len(item[0])):
        text = text.replace(path, here)
    left = STORE_PATH.findall(text)
    assert not left, f"store paths the emulation does not map: {sorted(set(left))[:5]}"
    return text


def site_packages(out: Path) -> Path:
    found = list(out.glob("lib/python3*/site-packages"))
    assert len(found) == 1, list(out.rglob("*"))[:10]
    return found[0]


RELEASES = [r for r in releases.series_releases() if (REPO / releases.pins_file(r, SYSTEM)).exists()]


@pytest.mark.parametrize("release", RELEASES)
def test_the_closure_installs_its_overlapping_wheels_one_at_a_time(tmp_path, release):
    wheels = overlapping(release)
    assert {w["name"] for w in wheels} == {"flashinfer-python", "torch-c-dlpack-ext"}
    closure = closure_of(release)
    script = install_script(closure, wheels, tmp_path, with_pre_install=True)
    out = emulate(tmp_path, [*STDENV, "python3-installer"], script)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert log.count("Successfully installed ") == 2
    assert "dropped build_backend.py" in log
    site = site_packages(tmp_path / "out")
    assert (site / "flashinfer" / "__init__.py").exists() and (site / "torch_c_dlpack_ext").is_dir()
    assert not (site / "build_backend.py").exists()
    records = list(site.glob("*.dist-info/RECORD"))
    assert len(records) == 2
    for record in records:
        assert not any(line.startswith("build_backend.py,") for line in record.read_text().splitlines())
    # The store's wheels are left as fetched (the rewrite replaces the link in dist/ only).
    for wheel in wheels:
        assert fetch_wheels.sha256_of(str(WHEELS / wheel["filename"])) == wheel["sha256"]


@pytest.mark.parametrize("release", RELEASES[:1])
def test_the_hook_alone_refuses_the_overlap_as_nixpkgs_installer_does(tmp_path, release):
    """Without the closure's preInstall (the flake before this change): installer stops at the
    second wheel's build_backend.py, as it does on real nixpkgs."""
    wheels = overlapping(release)
    script = install_script(closure_of(release), wheels, tmp_path, with_pre_install=False)
    out = emulate(tmp_path, [*STDENV, "python3-installer"], script)
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "FileExistsError" in log and "build_backend.py" in log, log[-4000:]


def test_nothing_installed_imports_the_dropped_build_backend():
    """The reason the table gives: no module of either wheel imports build_backend (it is each
    project's PEP 517 backend, used only to build the wheel)."""
    import zipfile

    pattern = re.compile(r"^\s*(import\s+build_backend|from\s+build_backend\s+import)", re.M)
    checked = 0
    for release in RELEASES:
        for wheel in overlapping(release):
            path = WHEELS / wheel["filename"]
            if not path.exists():
                pytest.skip(f"{path.name} is not in .cache/wheels")
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():
                    if name.endswith(".py") and name != "build_backend.py":
                        checked += 1
                        assert not pattern.search(archive.read(name).decode("utf-8", "replace")), f"{path.name}: {name}"
    assert checked > 100


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
