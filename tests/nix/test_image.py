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

import pytest

from tests.nix.nixeval import EXPECTED_APPS, NixError, nix_eval
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
