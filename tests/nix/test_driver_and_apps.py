"""The host-driver discovery script against fake directory trees, and every app's wrapper as
the flake builds it (nix/lib.nix's wrapperText, instantiated with local paths) run for real."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nix.nixeval import EXPECTED_APPS, REPO, nix_eval, shellcheck
from tests.nix.test_flake_outputs import flake_eval

DRIVER_SCRIPT = REPO / "magpie" / "nix" / "nvidia-driver-libs.sh"
MACHINE = platform.machine()
DRIVER_FILES = ["libcuda.so.580.65.06", "libnvidia-ml.so.580.65.06", "libnvidia-ptxjitcompiler.so.580.65.06"]
HOST_FILES = ["libc.so.6", "libstdc++.so.6", "libz.so.1", "libcudart.so.13"]


def fake_driver_folder(folder: Path, version: str = "580.65.06") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in DRIVER_FILES + HOST_FILES:
        (folder / name.replace("580.65.06", version)).write_text(name)
    (folder / "libcuda.so.1").symlink_to(f"libcuda.so.{version}")
    (folder / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{version}")
    return folder


def run_driver(env_extra: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), **env_extra}
    return subprocess.run(["bash", str(DRIVER_SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


def test_driver_script_passes_shellcheck():
    subprocess.run([shellcheck(), str(DRIVER_SCRIPT)], check=True)


def test_dgx_os_layout_exposes_only_the_driver_libraries(tmp_path):
    root = tmp_path / "root"
    driver = fake_driver_folder(root / "usr" / "lib" / f"{MACHINE}-linux-gnu")
    out = run_driver({"NVIDIA_DRIVER_ROOT": str(root)}, tmp_path)
    assert out.returncode == 0, out.stderr
    farm = Path(out.stdout.strip())
    assert farm.parent == tmp_path / "home" / ".cache" / "magpie-vllm-plugins" / "nvidia-driver"
    assert re.fullmatch("[0-9a-f]{16}", farm.name), farm.name
    names = sorted(p.name for p in farm.iterdir())
    assert names == sorted(
        ["libcuda.so", "libcuda.so.1", "libcuda.so.580.65.06", "libnvidia-ml.so.1"]
        + ["libnvidia-ml.so.580.65.06", "libnvidia-ptxjitcompiler.so.580.65.06"]
    )
    for link in farm.iterdir():
        assert link.resolve().parent == driver.resolve()
    assert (farm / "libcuda.so").resolve() == (driver / "libcuda.so.580.65.06").resolve()
    assert f"linked in {farm}" in out.stderr


def test_nixos_driver_path_comes_first(tmp_path):
    root = tmp_path / "root"
    fake_driver_folder(root / "usr" / "lib" / f"{MACHINE}-linux-gnu", version="550.1")
    nixos = fake_driver_folder(root / "run" / "opengl-driver" / "lib")
    out = run_driver({"NVIDIA_DRIVER_ROOT": str(root)}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert (Path(out.stdout.strip()) / "libcuda.so.1").resolve() == (nixos / "libcuda.so.580.65.06").resolve()


def test_no_driver_is_reported_with_every_place_searched(tmp_path):
    root = tmp_path / "root"
    (root / "usr" / "lib").mkdir(parents=True)
    out = run_driver({"NVIDIA_DRIVER_ROOT": str(root)}, tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert "no NVIDIA driver library (libcuda.so.1) found" in out.stderr
    for searched in ["run/opengl-driver/lib", f"usr/lib/{MACHINE}-linux-gnu", "usr/lib64"]:
        assert f"{root}/{searched}" in out.stderr
    assert "NVIDIA_DRIVER_LIB_DIR" in out.stderr


def test_dangling_libcuda_link_does_not_count(tmp_path):
    root = tmp_path / "root"
    folder = root / "usr" / "lib" / f"{MACHINE}-linux-gnu"
    folder.mkdir(parents=True)
    (folder / "libcuda.so.1").symlink_to("libcuda.so.470.removed")
    out = run_driver({"NVIDIA_DRIVER_ROOT": str(root)}, tmp_path)
    assert out.returncode == 1


def test_explicit_driver_folder_is_used_without_search(tmp_path):
    chosen = fake_driver_folder(tmp_path / "opt" / "driver")
    fake_driver_folder(tmp_path / "root" / "run" / "opengl-driver" / "lib", version="1.0")
    farm = tmp_path / "farm"
    out = run_driver(
        {
            "NVIDIA_DRIVER_LIB_DIR": str(chosen),
            "NVIDIA_DRIVER_ROOT": str(tmp_path / "root"),
            "NVIDIA_DRIVER_FARM": str(farm),
        },
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(farm)
    assert (farm / "libcuda.so.1").resolve() == (chosen / "libcuda.so.580.65.06").resolve()


def test_driver_upgrade_replaces_the_old_links(tmp_path):
    root = tmp_path / "root"
    folder = root / "usr" / "lib" / f"{MACHINE}-linux-gnu"
    fake_driver_folder(folder, version="550.1")
    assert run_driver({"NVIDIA_DRIVER_ROOT": str(root)}, tmp_path).returncode == 0
    shutil.rmtree(folder)
    fake_driver_folder(folder, version="580.65.06")
    out = run_driver({"NVIDIA_DRIVER_ROOT": str(root)}, tmp_path)
    names = {p.name for p in Path(out.stdout.strip()).iterdir()}
    assert "libcuda.so.580.65.06" in names and "libcuda.so.550.1" not in names


def test_an_explicit_link_folder_of_another_driver_is_replaced(tmp_path):
    farm = tmp_path / "farm"
    first = fake_driver_folder(tmp_path / "driver-a", version="550.1")
    second = fake_driver_folder(tmp_path / "driver-b", version="580.65.06")
    for folder in (first, second):
        env = {"NVIDIA_DRIVER_LIB_DIR": str(folder), "NVIDIA_DRIVER_FARM": str(farm)}
        assert run_driver(env, tmp_path).returncode == 0
    assert (farm / "libcuda.so.1").resolve() == (second / "libcuda.so.580.65.06").resolve()
    assert not (farm / "libcuda.so.550.1").exists()


def test_concurrent_launches_all_get_one_complete_folder(tmp_path):
    root = tmp_path / "root"
    fake_driver_folder(root / "usr" / "lib" / f"{MACHINE}-linux-gnu")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), "NVIDIA_DRIVER_ROOT": str(root)}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    launches = [subprocess.Popen(["bash", str(DRIVER_SCRIPT)], **pipes) for _ in range(8)]
    results = [(p.wait(timeout=60), p.stdout.read().strip()) for p in launches]
    assert {status for status, _ in results} == {0}
    folders = {Path(folder) for _, folder in results}
    assert len(folders) == 1
    (farm,) = folders
    assert len(list(farm.iterdir())) == 6
    leftovers = [p.name for p in farm.parent.iterdir() if p != farm]
    assert leftovers == []


# ------------------------------------------------------------------------------------------
# App wrappers


def write_wrapper(tmp_path: Path, name: str, src: Path, gpu_env: bool = True) -> Path:
    """The wrapper as writeShellApplication writes it (the stand-in's, nixpkgs' header) around
    magpieLib.wrapperText, with its shebang on the bash found on PATH, as nixpkgs puts its own
    bash there (`#!${runtimeShell}`): never /usr/bin/env, which the build sandbox lacks."""
    text = nix_eval(
        'let pkgs = import (/. + standIn) { system = "x86_64-linux"; }; in '
        "(pkgs.writeShellApplication { inherit name; text = "
        "lib.wrapperText { inherit name src envPython stdlibPython driverLibs; "
        'gpuEnv = lib.gpuEnvText { inherit cudaHome; capabilities = [ "12.1" ]; cc = "/usr/bin/gcc"; '
        'cxx = "/usr/bin/g++"; }; }; }).text',
        standIn=str(REPO / "tests" / "nix" / "nixpkgs-stand-in"),
        name=name,
        src=str(src),
        envPython=sys.executable,
        stdlibPython=sys.executable,
        driverLibs=str(driver_program(tmp_path)),
        cudaHome="/nix/store/fake-cuda-home",
    )
    return install_script(tmp_path / "bin" / name, text)


def install_script(path: Path, text: str) -> Path:
    """A writeShellApplication's file, its shebang (the stand-in's bash) on the bash on PATH."""
    bash = shutil.which("bash")
    assert bash, "no bash on PATH"
    shebang, body = text.split("\n", 1)
    assert re.fullmatch("#!/nix/store/[0-9a-z]{32}-bash/bin/bash", shebang), shebang
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{bash}\n{body}")
    path.chmod(0o755)
    return path


def driver_program(tmp_path: Path) -> Path:
    """bin/nvidia-driver-libs as nix/driver.nix builds it (writeShellApplication around the
    script), as the app wrappers call it."""
    text = flake_eval('(scope "x86_64-linux").nvidiaDriverLibs.text')
    return install_script(tmp_path / "driver" / "bin" / "nvidia-driver-libs", text)


APPS = list(EXPECTED_APPS)


@pytest.mark.parametrize("name", APPS)
def test_wrapper_passes_shellcheck(tmp_path, name):
    subprocess.run([shellcheck(), str(write_wrapper(tmp_path, name, REPO))], check=True)


@pytest.mark.parametrize("name", APPS)
def test_wrapper_runs_the_repository_script_with_help(tmp_path, name):
    table = nix_eval("lib.appTable")
    if not (REPO / table[name]["script"]).exists():
        pytest.skip(f"{table[name]['script']} is not in the tree yet")
    wrapper = write_wrapper(tmp_path, name, REPO)
    env = {**os.environ, "HOME": str(tmp_path)}
    out = subprocess.run([str(wrapper), "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in (out.stdout + out.stderr).lower()


def test_patches_app_passes_arguments_through_unchanged(tmp_path):
    wrapper = write_wrapper(tmp_path, "patches", REPO)
    direct = subprocess.run(
        [sys.executable, str(REPO / "magpie" / "patches.py"), "list"], capture_output=True, text=True
    )
    wrapped = subprocess.run([str(wrapper), "list"], capture_output=True, text=True)
    assert (wrapped.returncode, wrapped.stdout) == (direct.returncode, direct.stdout)
    missing = tmp_path / "no such dir"
    out = subprocess.run([str(wrapper), "status", "--target", str(missing)], capture_output=True, text=True)
    assert out.returncode == 2
    assert str(missing) in out.stderr


def test_wrapper_of_a_script_missing_from_the_build_says_so(tmp_path):
    wrapper = write_wrapper(tmp_path, "trace-split", tmp_path / "empty-src")
    out = subprocess.run([str(wrapper)], capture_output=True, text=True)
    assert out.returncode == 2
    assert "magpie/measure/trace_split.py is not part of this build" in out.stderr


def fake_src_with_probe(tmp_path: Path) -> Path:
    """A source tree whose serve.sh prints what the wrapper handed it."""
    script = tmp_path / "src" / "magpie" / "serving" / "serve.sh"
    script.parent.mkdir(parents=True)
    script.write_text(
        "for var in LD_LIBRARY_PATH TRITON_LIBCUDA_PATH CUDA_HOME CC FLASHINFER_CUDA_ARCH_LIST "
        'TORCH_CUDA_ARCH_LIST FLASHINFER_WORKSPACE_BASE VLLM_PYTHON; do echo "$var=${!var}"; done\n'
        'for arg in "$@"; do echo "arg=$arg"; done\n'
    )
    return tmp_path / "src"


def test_serve_wrapper_sets_up_driver_and_flashinfer_jit(tmp_path):
    root = tmp_path / "root"
    fake_driver_folder(root / "usr" / "lib" / f"{MACHINE}-linux-gnu")
    wrapper = write_wrapper(tmp_path, "serve-flash-next", fake_src_with_probe(tmp_path))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "NVIDIA_DRIVER_ROOT": str(root),
        "LD_LIBRARY_PATH": "/already/there",
        "FLASHINFER_CUDA_ARCH_LIST": "12.0",
    }
    out = subprocess.run(
        [str(wrapper), "serve.log", "--max-model-len", "4096 tokens"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines() if not line.startswith("arg="))
    farm = Path(seen["TRITON_LIBCUDA_PATH"])
    assert farm.parent == tmp_path / "home" / ".cache" / "magpie-vllm-plugins" / "nvidia-driver"
    assert seen["LD_LIBRARY_PATH"] == f"{farm}:/already/there"
    assert seen["TRITON_LIBCUDA_PATH"] == str(farm)
    assert seen["CUDA_HOME"] == "/nix/store/fake-cuda-home"
    assert seen["CC"] == "/usr/bin/gcc"
    assert seen["FLASHINFER_CUDA_ARCH_LIST"] == "12.0"  # the user's choice stands
    assert seen["TORCH_CUDA_ARCH_LIST"] == "12.1"
    assert seen["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "home" / ".cache" / "magpie-vllm-plugins")
    assert Path(seen["FLASHINFER_WORKSPACE_BASE"]).is_dir()
    assert seen["VLLM_PYTHON"] == sys.executable
    args = [line[4:] for line in out.stdout.splitlines() if line.startswith("arg=")]
    assert args == ["serve.log", "--max-model-len", "4096 tokens"]


def test_serve_wrapper_refuses_to_start_without_a_driver(tmp_path):
    (tmp_path / "root").mkdir()
    wrapper = write_wrapper(tmp_path, "serve-flash-next", fake_src_with_probe(tmp_path))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), "NVIDIA_DRIVER_ROOT": str(tmp_path / "root")}
    out = subprocess.run([str(wrapper), "serve.log"], capture_output=True, text=True, env=env)
    assert out.returncode == 1
    assert out.stdout == ""  # the launcher never ran
    assert "no NVIDIA driver library (libcuda.so.1) found" in out.stderr
