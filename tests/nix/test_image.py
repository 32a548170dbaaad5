"""packages.<system>.image (nix/image.nix) evaluated by Nix with the nixpkgs stand-in, whose
dockerTools.buildLayeredImage takes nixpkgs' closed argument set and keeps the image's config
JSON (`{ config, architecture, os }`, as nixpkgs writes it) and the contents' store paths.

What this shows: the entry point is the flake's serve-flash-next wrapper (which runs the patched
environment's Python), every app is in the image's contents, the environment the NVIDIA
container runtime reads, the volumes, the port, the architecture per system. What only a Nix
machine shows: that the image builds and `docker load`s; only one with an NVIDIA GPU and the
container toolkit: that the runtime's driver libraries are found and the server serves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nix.nixeval import EXPECTED_APPS, REPO, NixError, nix_eval
from tests.nix.test_flake_outputs import STAND_IN, flake_eval

IMAGE = (
    "let img = self.packages.${system}.image; pkgs = self.packages.${system}; in "
    "{ config = builtins.fromJSON (builtins.unsafeDiscardStringContext img.imageConfigJson); "
    "contents = img.contentsPaths; inherit (img) name imageName imageTag extraCommands; "
    'serve = "${pkgs.serve-flash-next}"; serveText = pkgs.serve-flash-next.text; '
    'env = "${pkgs.vllm-env}"; '
    'apps = map (name: "${pkgs.${name}}") names; }'
)


def image(system: str) -> dict:
    names = "[ " + " ".join(f'"{n}"' for n in sorted(EXPECTED_APPS)) + " ]"
    return flake_eval(f"let names = {names}; in " + IMAGE, system=system)


@pytest.mark.parametrize(("system", "arch"), [("aarch64-linux", "arm64"), ("x86_64-linux", "amd64")])
def test_the_image_runs_serve_flash_next_of_the_patched_environment(system, arch):
    found = image(system)
    assert found["config"]["architecture"] == arch and found["config"]["os"] == "linux"
    config = found["config"]["config"]
    assert config["Entrypoint"] == [found["serve"] + "/bin/serve-flash-next"]
    assert config["Cmd"] == ["/logs/serve.log"]  # serve.sh's LOG; the manifest goes beside it
    assert f"{found['env']}/bin/python" in found["serveText"]  # the wrapper runs the patched env
    assert found["name"] == "magpie-vllm.tar.gz" and found["imageTag"] == "0.29.0"


@pytest.mark.parametrize("system", ["aarch64-linux", "x86_64-linux"])
def test_every_app_and_the_entry_point_are_in_the_image_contents(system):
    found = image(system)
    contents = found["contents"]
    assert all(path.startswith("/nix/store/") for path in contents)
    assert set(found["apps"]) <= set(contents) and found["serve"] in contents
    assert [p.split("-", 1)[1] for p in contents[:2]] == ["bash", "coreutils"]


def test_the_environment_follows_the_nvidia_container_runtime_and_mounts():
    config = image("aarch64-linux")["config"]["config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "LD_LIBRARY_PATH" not in env  # the driver is the host's, found at run time
    assert env["MODEL"] == "/model" and env["HOST"] == "0.0.0.0" and env["PORT"] == "8100"
    assert set(config["Volumes"]) == {"/model", "/keep", "/logs", "/cache"}
    assert env["XDG_CACHE_HOME"] == "/cache"  # driver-library links, FlashInfer's JIT cache
    assert config["ExposedPorts"] == {"8100/tcp": {}}


def test_the_stand_in_refuses_an_argument_buildlayeredimage_does_not_take():
    body = (
        'let pkgs = import (/. + standIn) { system = "x86_64-linux"; }; in '
        '(pkgs.dockerTools.buildLayeredImage { name = "x"; runAsRoot = "true"; }).drvPath'
    )
    with pytest.raises(NixError, match="unexpected argument 'runAsRoot'"):
        nix_eval(body, standIn=str(STAND_IN))


def test_the_path_finds_the_runtimes_nvidia_smi_and_the_ca_bundle_is_in_the_image():
    found = flake_eval(
        "let img = self.packages.${system}.image; in "
        '{ cacert = "${(import (/. + standIn) { inherit system; }).cacert}"; contents = img.contentsPaths; '
        "config = builtins.fromJSON (builtins.unsafeDiscardStringContext img.imageConfigJson); }",
        system="x86_64-linux",
    )
    env = dict(item.split("=", 1) for item in found["config"]["config"]["Env"])
    # The NVIDIA container runtime puts nvidia-smi (and its other utilities) in /usr/bin.
    assert env["PATH"].split(":") == ["/bin", "/usr/bin"]
    assert env["SSL_CERT_FILE"] == found["cacert"] + "/etc/ssl/certs/ca-bundle.crt"
    assert found["cacert"] in found["contents"]


def emulated_root(tmp_path: Path, env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    """`python -c code` with exactly the image's environment, in a mount namespace whose /etc is an
    empty tmpfs (the image has no /etc/passwd, /etc/group or /etc/ssl: its /etc holds only what
    its contents link there). The interpreter is the test venv's (the image's is the patched
    environment's, which only a Nix build makes)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare (util-linux): the image's root cannot be emulated")
    namespace = [unshare, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        namespace[1:1] = ["--user", "--map-root-user"]
    mount = Path(shutil.which("mount")).resolve()
    script = f'{mount} -t tmpfs tmpfs /etc && exec env -i "$@"'
    argv = [f"{k}={v}" for k, v in env.items()] + [sys.executable, "-c", code]
    return subprocess.run(
        [*namespace, "/bin/sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )


def image_env(tmp_path: Path) -> dict[str, str]:
    """The image's Env, its store paths that a test reads mapped to files here."""
    config = image("x86_64-linux")["config"]["config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    host_bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    if not host_bundle.exists():
        pytest.skip(f"no {host_bundle} to stand for the image's cacert bundle")
    bundle = tmp_path / "ca-bundle.crt"
    shutil.copy(host_bundle, bundle)
    env["SSL_CERT_FILE"] = str(bundle)
    for name in ("TMPDIR", "XDG_CACHE_HOME"):
        (tmp_path / name).mkdir()
        env[name] = str(tmp_path / name)
    env["PYTHONPATH"] = str(REPO)
    return env


def test_the_entry_points_user_lookup_passes_without_etc_passwd(tmp_path):
    """Issue 27: `launch plan` records the user; with no /etc/passwd and no USER/LOGNAME (the
    image's root) getpass.getuser() raises, which killed serve.sh at start. launch.user_name
    (what the plan records) names the uid instead."""
    env = image_env(tmp_path)
    assert not {"USER", "LOGNAME", "HOME"} & set(env)
    code = (
        "import getpass, os\n"
        "try:\n    getpass.getuser(); print('getuser: ok')\n"
        "except (KeyError, OSError) as e:\n    print('getuser:', type(e).__name__)\n"
        "from magpie.serving import launch\n"
        "print('user_name:', launch.user_name())\n"
        "print('passwd:', os.path.exists('/etc/passwd'))\n"
    )
    out = emulated_root(tmp_path, env, code)
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"no private mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "passwd: False" in lines
    assert "getuser: KeyError" in lines or "getuser: OSError" in lines  # what the old line raised
    assert "user_name: uid 0" in lines  # root in the namespace, as the runtime starts the server


def test_the_image_env_ca_bundle_is_what_python_verifies_with(tmp_path):
    """With /etc empty, Python's default TLS context finds CA certificates only through the
    image's SSL_CERT_FILE (none without it: a hub id could not be fetched)."""
    env = image_env(tmp_path)
    code = "import ssl\nprint(ssl.create_default_context().cert_store_stats()['x509_ca'])\n"
    with_bundle = emulated_root(tmp_path, env, code)
    if with_bundle.returncode != 0 and "mount" in with_bundle.stderr:
        pytest.skip(f"no private mount namespace here: {with_bundle.stderr.strip()}")
    assert with_bundle.returncode == 0, with_bundle.stderr
    assert int(with_bundle.stdout) > 50
    without = emulated_root(tmp_path, {k: v for k, v in env.items() if k != "SSL_CERT_FILE"}, code)
    assert without.returncode == 0, without.stderr
    assert int(without.stdout) == 0
