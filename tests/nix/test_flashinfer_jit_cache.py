"""The `flashinfer_jit_cache` module nix/flashinfer-aot.nix installs, as the flake renders it for
each vLLM release, loaded by the pinned flashinfer-python wheel's own discovery code.

The wheels come from the registry by pip, checked against requirements/'s hashes, into
.cache/flashinfer-wheels (git-ignored). FlashInfer's package __init__ imports its CUDA
dependencies (pynvml, tvm_ffi, cuda-python, ...), which this CPU machine does not have; so the
packages `flashinfer` and `flashinfer.jit` are entered without running their __init__, and the
wheel's flashinfer/jit/env.py, the module that reads flashinfer_jit_cache while `import
flashinfer` runs, is imported as it is (with the wheel's compilation_context and version)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from magpie import releases
from tests.nix.nixeval import REPO, NixError, nix_eval
from tests.nix.test_flake_outputs import flake_eval

WHEELS = REPO / ".cache" / "flashinfer-wheels"
# Each release with a series: its aarch64 requirements file and its scope in the flake.
REQUIREMENTS = {release: releases.requirements_file(release, "aarch64-linux") for release in releases.series_releases()}
SCOPES = {
    release: '(scope "aarch64-linux")'
    if release == releases.default()
    else f'(scope "aarch64-linux").releases."{release}"'
    for release in releases.series_releases()
}
MODULE = "fused_moe_120"

LOAD = r"""
import importlib, json, logging, sys, types
wheel, site = sys.argv[1:3]
sys.path[:0] = [site, wheel]
for name in ("flashinfer", "flashinfer.jit"):
    package = types.ModuleType(name)
    package.__path__ = [wheel + "/" + name.replace(".", "/")]
    sys.modules[name] = package
warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("flashinfer.jit").addHandler(handler)
env = importlib.import_module("flashinfer.jit.env")
seen = {"warnings": warnings, "aot_dir": str(env.FLASHINFER_AOT_DIR)}
if hasattr(env, "FLASHINFER_AOT_PROVIDERS"):
    seen["providers"] = [
        {"distribution": p.distribution, "version": p.version, "jit_cache_dir": str(p.jit_cache_dir),
         "cuda_architectures": sorted(p.cuda_architectures), "modules": sorted(p.modules)}
        for p in env.FLASHINFER_AOT_PROVIDERS
    ]
    seen["artifacts"] = [str(a.path) for a in env.get_aot_artifacts(sys.argv[3])]
print(json.dumps(seen))
"""


def pinned_wheel(release: str) -> Path:
    text = (REPO / REQUIREMENTS[release]).read_text()
    found = re.search(r"^flashinfer-python==(\S+) \\\n\s+--hash=sha256:([0-9a-f]{64})", text, re.M)
    assert found, f"{REQUIREMENTS[release]} pins no flashinfer-python"
    version, sha256 = found.groups()
    wheel = WHEELS / f"flashinfer_python-{version}-py3-none-any.whl"
    if not wheel.exists():
        WHEELS.mkdir(parents=True, exist_ok=True)
        requirement = WHEELS / f"flashinfer-python-{version}.txt"
        requirement.write_text(f"flashinfer-python=={version} --hash=sha256:{sha256}\n")
        # This machine's pip configuration adds local find-links and constraints: not wanted.
        env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")}
        env["PIP_CONFIG_FILE"] = os.devnull
        args = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:"]
        args += ["--disable-pip-version-check", "--quiet", "--dest", str(WHEELS), "-r", str(requirement)]
        out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
        if out.returncode != 0:
            pytest.skip(f"flashinfer-python {version} could not be fetched from the registry: {out.stderr[-300:]}")
    return wheel


def unpacked(wheel: Path, tmp_path: Path) -> Path:
    folder = tmp_path / wheel.stem
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(folder, [n for n in archive.namelist() if n.startswith("flashinfer/")])
    return folder


def installed_module(release: str, tmp_path: Path, module_text: str | None = None) -> tuple[Path, dict]:
    """The module as installPhase lays it out: __init__.py, jit_cache/<m>/<m>.so and the
    architectures FlashInfer's CompilationContext names for FLASHINFER_CUDA_ARCH_LIST=12.1a."""
    drv = flake_eval(f"let d = {SCOPES[release]}.flashinferJitCache; in {{ inherit (d) version jitCacheModule; }}")
    package = tmp_path / "site" / "flashinfer_jit_cache"
    (package / "jit_cache" / MODULE).mkdir(parents=True)
    (package / "jit_cache" / MODULE / f"{MODULE}.so").write_bytes(b"")
    (package / "__init__.py").write_text(module_text or drv["jitCacheModule"])
    (package / "cuda_architectures.json").write_text('["sm121a"]')
    return package, drv


def load(wheel_folder: Path, package: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(package.parent.parent), "FLASHINFER_CUDA_ARCH_LIST": "12.1a"}
    env.pop("FLASHINFER_DISABLE_VERSION_CHECK", None)
    return subprocess.run(
        [sys.executable, "-c", LOAD, str(wheel_folder), str(package.parent), MODULE],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("release", releases.series_releases())
def test_each_releases_module_loads_in_its_pinned_flashinfer(tmp_path, release):
    """The module the flake renders for a release, loaded by that release's own FlashInfer: no
    error, no warning, and the kernels' folder is the module's."""
    wheel = unpacked(pinned_wheel(release), tmp_path)
    package, drv = installed_module(release, tmp_path)
    assert drv["version"].endswith("+sm121")
    out = load(wheel, package)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["warnings"] == []
    if "providers" in seen:
        assert [p["jit_cache_dir"] for p in seen["providers"]] == [str(package / "jit_cache")]
    else:
        assert seen["aot_dir"] == str(package / "jit_cache")


def test_registry_flashinfer_0_6_reads_the_0_29_module(tmp_path):
    wheel = unpacked(pinned_wheel("0.29.0"), tmp_path)
    package, drv = installed_module("0.29.0", tmp_path)
    assert drv["version"] == "0.6.18+sm121"
    out = load(wheel, package)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["aot_dir"] == str(package / "jit_cache")
    assert "providers" not in seen  # 0.6 has no provider interface


def test_registry_flashinfer_0_7_finds_the_0_33_modules_kernels(tmp_path):
    wheel = unpacked(pinned_wheel("0.33.0"), tmp_path)
    package, drv = installed_module("0.33.0", tmp_path)
    assert drv["version"] == "0.7.2.post1+sm121"
    out = load(wheel, package)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["warnings"] == []  # no "Ignoring incompatible" provider or shim
    assert seen["providers"] == [
        {
            "distribution": "flashinfer-jit-cache",
            "version": "0.7.2.post1+sm121",
            "jit_cache_dir": str(package / "jit_cache"),
            "cuda_architectures": ["sm121a"],
            "modules": [MODULE],
        }
    ]
    assert seen["artifacts"] == [str(package / "jit_cache" / MODULE / f"{MODULE}.so")]


def test_registry_flashinfer_0_7_crashes_on_the_0_6_interface(tmp_path):
    """What the opt-in environment of vLLM 0.33.0 did before: one module for every release."""
    wheel = unpacked(pinned_wheel("0.33.0"), tmp_path)
    old = nix_eval(
        "lib.flashinferJitCacheModule "
        '{ flashinferVersion = "0.6.18"; version = "0.7.2.post1+sm121"; description = "x"; }'
    )
    package, _ = installed_module("0.33.0", tmp_path, module_text=old)
    out = load(wheel, package)
    assert out.returncode == 1
    assert "has no attribute 'get_jit_cache_providers'" in out.stderr


def test_a_flashinfer_release_whose_interface_was_not_read_is_refused():
    with pytest.raises(NixError, match="no flashinfer_jit_cache interface for FlashInfer 0.8.0: read its"):
        nix_eval('lib.flashinferJitCacheModule { flashinferVersion = "0.8.0"; version = "v"; description = "d"; }')
