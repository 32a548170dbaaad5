"""The wheel closure's RUNPATH phases (nix/wheels.nix), as the flake renders them, run by bash on
a real shared library: `$ORIGIN` entries that autoPatchelf's rewrite drops come back after it."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.nix.test_flake_outputs import flake_eval


def runpath(path) -> str:
    return subprocess.run(
        ["patchelf", "--print-rpath", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def phases():
    return flake_eval(
        'let c = (scope "x86_64-linux").wheelClosure; in '
        "{ inherit (c) preFixup restoreOriginRunpathsPhase postPhases; }"
    )


def test_origin_runpaths_survive_a_rewrite_of_the_runpath(tmp_path, phases):
    for tool in ("patchelf", "cc"):
        assert shutil.which(tool), f"{tool} is missing: tests/env/setup_system.sh installs it"
    assert phases["postPhases"] == ["restoreOriginRunpathsPhase"]
    out = tmp_path / "out"
    lib_dir = out / "lib" / "python3.12" / "site-packages" / "nvidia" / "cudnn" / "lib"
    lib_dir.mkdir(parents=True)
    (tmp_path / "a.c").write_text("int cudnn_like(void) { return 1; }\n")
    with_origin = lib_dir / "libcudnn_like.so.9"
    plain = lib_dir / "libplain.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(with_origin), str(tmp_path / "a.c"), "-Wl,-rpath,$ORIGIN:$ORIGIN/../../x"],
        check=True,
    )
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(plain), str(tmp_path / "a.c")], check=True)
    assert runpath(with_origin) == "$ORIGIN:$ORIGIN/../../x"

    # stdenv's shell options; autoPatchelf replaced by what it does to a RUNPATH (--set-rpath).
    script = f"""
set -euo pipefail
out={out}
NIX_BUILD_TOP={tmp_path}
addAutoPatchelfSearchPath() {{ :; }}
{phases["preFixup"]}
for elf in {with_origin} {plain}; do patchelf --set-rpath /nix/store/resolved/lib "$elf"; done
{phases["restoreOriginRunpathsPhase"]}
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert runpath(with_origin) == "/nix/store/resolved/lib:$ORIGIN:$ORIGIN/../../x"
    assert runpath(plain) == "/nix/store/resolved/lib"
