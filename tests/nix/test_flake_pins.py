"""flake.lock against flake.nix, and the wheel pins of each vLLM release the flake builds (the
releases with a series in magpie/releases.json) against the requirements files, the patch series
and the pin generator's own check against the registry."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from magpie import releases
from tests.nix.nixeval import REPO, NixError, nix_eval

SYSTEMS = ["aarch64-linux", "x86_64-linux"]
# Public facts (shared/FACTS.md, "Pins known to be real").
NIXPKGS_REV = "567a49d1913ce81ac6e9582e3553dd90a955875f"
NIXPKGS_NAR_HASH = "sha256-lrp67w8AulE9Ks53n27I45ADSzbOCn4H+CNW1Ck8B+8="
NIXPKGS_LAST_MODIFIED = 1781577229
# The registry's published sha256 of each vLLM wheel (0.33.0's as pip's report of the resolution
# listed them on 2026-12-01): facts recorded apart from the pins, for the releases they were read for.
VLLM_WHEEL_SHA256 = {
    ("0.29.0", "aarch64-linux"): "e6b0dfc2b6fd307315e9b34b73cd2bfe7b6b08958eda721828e61732bba426b0",
    ("0.29.0", "x86_64-linux"): "09d48617fc2be9c6cdcd5db480651ab0d84817b257204f2cc2e3ecbb70bbb635",
    ("0.33.0", "aarch64-linux"): "e9e404f52c8494b69bd83fe99fe7ecfa9f6b89fbd156d2a9639c24ea41d6d606",
    ("0.33.0", "x86_64-linux"): "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
}
# Every release with a series has a pin set: the default one at the top of nix/pins and
# requirements, the others one folder down (magpie/releases.py pins_file, which
# magpie/nix/pin_wheels.py writes by, and nix/lib.nix pinsFile agree on it).
RELEASES = releases.series_releases()
DEFAULT = releases.default()
PIN_FILES = {
    release: ("nix/pins/{system}.json", "requirements/{system}.txt")
    if release == DEFAULT
    else (f"nix/pins/vllm-{release}/{{system}}.json", f"requirements/vllm-{release}/{{system}}.txt")
    for release in RELEASES
}
# Each release's own torch, as vLLM pins it exactly (read in the releases' metadata).
TORCH = {"0.29.0": "2.13.0", "0.33.0": "2.14.0"}
TOOLS_PYTHON = REPO / ".cache" / "nix-tools" / "bin" / "python"
RELEASE_SYSTEMS = [(release, system) for release in RELEASES for system in SYSTEMS]


def pins_path(release: str, system: str) -> Path:
    return REPO / PIN_FILES[release][0].format(system=system)


def requirements_path(release: str, system: str) -> Path:
    return REPO / PIN_FILES[release][1].format(system=system)


def load_pins(system: str, release: str = DEFAULT) -> dict:
    return json.loads(pins_path(release, system).read_text())


def test_flake_lock_is_version_7_and_locks_exactly_the_flake_inputs():
    lock = json.loads((REPO / "flake.lock").read_text())
    assert lock["version"] == 7 and lock["root"] == "root"
    inputs = nix_eval('builtins.mapAttrs (_: i: i.url) (import (repo + "/flake.nix")).inputs')
    assert inputs == {"nixpkgs": "github:NixOS/nixpkgs/nixos-unstable"}
    outputs_args = nix_eval('builtins.functionArgs (import (repo + "/flake.nix")).outputs')
    assert set(outputs_args) == {"self", *inputs}
    assert lock["nodes"]["root"] == {"inputs": {name: name for name in inputs}}
    assert set(lock["nodes"]) == {"root", *inputs}
    node = lock["nodes"]["nixpkgs"]
    assert node["original"] == {"owner": "NixOS", "repo": "nixpkgs", "ref": "nixos-unstable", "type": "github"}
    assert node["locked"] == {
        "lastModified": NIXPKGS_LAST_MODIFIED,
        "narHash": NIXPKGS_NAR_HASH,
        "owner": "NixOS",
        "repo": "nixpkgs",
        "rev": NIXPKGS_REV,
        "type": "github",
    }


def test_flake_systems_put_the_gb10_first():
    assert nix_eval("lib.systems") == SYSTEMS


def test_pin_files_are_where_the_generator_and_the_flake_look():
    """One layout in three places: these tests, magpie/nix/pin_wheels.py and nix/lib.nix."""
    from magpie.nix import pin_wheels

    assert list(pin_wheels.release_settings()) == RELEASES and len(RELEASES) >= 2
    assert nix_eval("lib.defaultVllmRelease") == DEFAULT
    assert nix_eval("[ lib.defaultVllmRelease ] ++ lib.otherVllmReleases") == [
        DEFAULT,
        *releases.other_series_releases(),
    ]
    for release, system in RELEASE_SYSTEMS:
        pins_file, requirements_file = (f.format(system=system) for f in PIN_FILES[release])
        assert pin_wheels.pins_file(release, system) == pins_file
        assert pin_wheels.requirements_file(release, system) == requirements_file
        assert "nix/pins/" + nix_eval(f'lib.pinsFile "{release}" "{system}"') == pins_file
        assert pins_path(release, system).exists() and requirements_path(release, system).exists()
        # The requirements file's install line names itself.
        assert f"-r {requirements_file}\n" in requirements_path(release, system).read_text()


def test_release_pins_of_another_version_are_refused(tmp_path):
    """The flake reads a release's pins through readReleasePins, which checks the root's version."""
    (tmp_path / "vllm-0.99.0").mkdir()
    pins = load_pins("x86_64-linux", DEFAULT)
    (tmp_path / "vllm-0.99.0" / "x86_64-linux.json").write_text(json.dumps(pins))
    with pytest.raises(NixError, match=rf"vllm-0.99.0/x86_64-linux.json pins vLLM {DEFAULT}, not 0.99.0"):
        nix_eval('(lib.readReleasePins (/. + d) "0.99.0" "x86_64-linux").root', d=str(tmp_path))
    with pytest.raises(NixError, match=r"no pins for vLLM 0.31.0 .*pin-wheels --release 0.31.0"):
        nix_eval('(lib.readReleasePins (/. + d) "0.31.0" "x86_64-linux").root', d=str(tmp_path))
    for release in RELEASES:
        got = nix_eval(f'(lib.readReleasePins (repo + "/nix/pins") "{release}" "aarch64-linux").requirement')
        assert got == f"vllm=={release}"


@pytest.mark.parametrize("release,system", sorted(VLLM_WHEEL_SHA256))
def test_vllm_wheel_pin_is_the_published_one(release, system):
    vllm = load_pins(system, release)["wheels"]["vllm"]
    machine = system.split("-")[0]
    assert vllm["version"] == release
    assert vllm["filename"] == f"vllm-{release}-cp38-abi3-manylinux_2_28_{machine}.whl"
    assert vllm["sha256"] == VLLM_WHEEL_SHA256[release, system]


@pytest.mark.parametrize("release,system", RELEASE_SYSTEMS)
def test_requirements_file_is_the_same_set_as_the_pins(release, system):
    pins = load_pins(system, release)
    text = requirements_path(release, system).read_text()
    pairs = re.findall(r"^([A-Za-z0-9._-]+)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", text, re.M)
    assert len(pairs) == len(pins["wheels"])
    assert {name: (version, sha) for name, version, sha in pairs} == {
        name: (w["version"], w["sha256"]) for name, w in pins["wheels"].items()
    }
    requirement_lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(requirement_lines) == 2 * len(pairs)


@pytest.mark.parametrize("release,system", RELEASE_SYSTEMS)
def test_pins_hold_no_address(release, system):
    for path in (pins_path(release, system), requirements_path(release, system)):
        assert "://" not in path.read_text(), path


@pytest.mark.parametrize("release,system", RELEASE_SYSTEMS)
def test_pins_form_one_closure_of_vllm(release, system):
    pins = load_pins(system, release)
    wheels = pins["wheels"]
    assert pins["root"] == "vllm" and pins["requirement"] == f"vllm=={release}"
    # What the table says the release is resolved with, and its cut-off.
    settings = releases.row(release)["pins"]
    assert pins["extra_requirements"] == settings["extra_requirements"]
    assert pins["uploaded_prior_to"] == settings["uploaded_prior_to"]
    if release in TORCH:  # each release's own torch (vLLM pins it exactly)
        assert wheels["torch"]["version"] == TORCH[release]
    assert pins["marker_environment"]["platform_machine"] == system.split("-")[0]
    reached, todo = set(), ["vllm"]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        assert set(wheels[name]["requires"]) <= set(wheels), name
        todo += wheels[name]["requires"]
    assert reached == set(wheels)
    assert "torch" in wheels["vllm"]["requires"]


def test_pins_python_is_the_overlays_python():
    versions = {load_pins(system, release)["python"] for release, system in RELEASE_SYSTEMS}
    assert versions == {"3.12"}
    overlay = (REPO / "nix" / "overlay.nix").read_text()
    assert "python = final.python312;" in overlay
    for release, system in RELEASE_SYSTEMS:
        for wheel in load_pins(system, release)["wheels"].values():
            assert runs_on_cpython_312(wheel["tags"]["python"], wheel["tags"]["abi"]), wheel["filename"]


def runs_on_cpython_312(python_tags: str, abi_tags: str) -> bool:
    """Whether a wheel's (possibly compressed) python and abi tags accept CPython 3.12."""
    for python in python_tags.split("."):
        for abi in abi_tags.split("."):
            if python == "cp312" and abi in {"none", "cp312", "abi3"}:
                return True
            if python == "py3" and abi == "none":
                return True
            generic = re.fullmatch(r"py3(\d+)", python)  # any CPython from 3.N on
            if generic and abi == "none" and int(generic.group(1)) <= 12:
                return True
            stable = re.fullmatch(r"cp3(\d+)", python)  # the stable ABI from 3.N on
            if stable and abi == "abi3" and int(stable.group(1)) <= 12:
                return True
    return False


@pytest.mark.parametrize("release,system", RELEASE_SYSTEMS)
def test_pinned_tools_are_the_versions_ci_installs(release, system):
    """The flake's ruff check uses the wheel pinned here; tests/run.sh the one setup.sh installs."""
    requirements = (REPO / "tests" / "env" / "requirements.txt").read_text()
    pinned = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", requirements, re.M))
    tools = load_pins(system, release)["tools"]
    assert set(tools) == {"ruff"}
    assert tools["ruff"]["version"] == pinned["ruff"]
    assert tools["ruff"]["tags"]["platform"].endswith(system.split("-")[0])


@pytest.mark.parametrize("release", RELEASES)
def test_every_patch_in_the_series_targets_the_pinned_vllm(release):
    series = nix_eval(f'map toString (lib.seriesPatches (repo + "/patches/vllm-{release}"))')
    assert series
    for path in series:
        header = Path(path).read_text().split("\ndiff --git", 1)[0]
        target = re.search(r"^Target: (.+)$", header, re.M)
        assert target and target.group(1).strip() == f"vllm {release}", path
    for system in SYSTEMS:
        assert load_pins(system, release)["wheels"]["vllm"]["version"] == release


def _registry_reachable() -> str | None:
    """None when pip can reach the package index, else the reason."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in {"PIP_CERT", "PIP_INDEX_URL"}}
    env["PIP_CONFIG_FILE"] = os.devnull
    try:
        out = subprocess.run(
            [str(TOOLS_PYTHON), "-m", "pip", "index", "versions", "pip", "--retries", "1", "--timeout", "15"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return "pip could not reach the package index within 60 s"
    return None if out.returncode == 0 else f"pip could not reach the package index: {out.stderr.strip()[-300:]}"


def test_pin_generator_check_passes_against_the_registry():
    """Regenerates both releases' pins for both systems from the registry (one call, the four
    resolutions in parallel: about a minute) and compares."""
    if not TOOLS_PYTHON.exists():
        pytest.fail(f"{TOOLS_PYTHON} is missing: run tests/env/setup_nix.sh (tests/run.sh does)")
    reason = _registry_reachable()
    if reason:
        pytest.skip(f"registry unreachable, the pins cannot be re-resolved: {reason}")
    out = subprocess.run(
        [sys.executable, str(REPO / "magpie"), "pin-wheels", "--check", "--pip-python", str(TOOLS_PYTHON)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pins are current" in out.stdout
    for release, system in RELEASE_SYSTEMS:
        for path in PIN_FILES[release]:
            assert path.format(system=system) in out.stdout, (release, system, out.stdout)


@pytest.mark.parametrize("release,system", RELEASE_SYSTEMS)
def test_cuda_compiler_matches_the_cuda_runtime_headers(release, system):
    """CCCL refuses to compile when nvcc's version differs from the runtime headers' (13.5 vs 13.0
    once broke FlashInfer's JIT); cuda-home.nix builds CUDA_HOME from exactly these wheels, and
    wheels.nix/cuda-home.nix assume CUDA 13 (nvidia/cu13, libcudart.so.13) for every release."""
    wheels = load_pins(system, release)["wheels"]
    major_minor = {
        name: ".".join(wheels[name]["version"].split(".")[:2])
        for name in ["nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime"]
    }
    assert set(major_minor.values()) == {"13.0"}, major_minor


def test_pin_generator_refuses_an_unknown_release_and_overrides_for_several(capsys):
    """Overrides of the root requirement or the cut-off name one release; an unknown release is
    refused with where to add it, not resolved with guessed settings."""
    from magpie.nix import pin_wheels

    release = RELEASES[-1]
    args = pin_wheels.parse_args(["--release", release, "--uploaded-prior-to", "2026-11-30T00:00:00Z"])
    assert args.releases == {
        release: {
            "requirement": f"vllm=={release}",
            "extra_requirements": releases.row(release)["pins"]["extra_requirements"],
            "uploaded_prior_to": "2026-11-30T00:00:00Z",
            "overrides": releases.row(release)["pins"].get("overrides", {}),
        }
    }
    assert list(pin_wheels.parse_args([]).releases) == RELEASES
    with pytest.raises(SystemExit):
        pin_wheels.parse_args(["--requirement", f"vllm=={release}"])
    assert "--requirement: for one release only; add --release" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pin_wheels.parse_args(["--release", "0.31.0"])
    err = capsys.readouterr().err
    assert f"--release 0.31.0: no release with a series in {releases.table_path()} ({', '.join(RELEASES)})" in err
    assert "add its row there" in err
