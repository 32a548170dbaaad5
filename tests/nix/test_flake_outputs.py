"""The flake's outputs evaluated by Nix itself, with a stand-in for nixpkgs (nixpkgs-stand-in/:
its callPackage, makeOverridable and makeScope behave as nixpkgs' lib/customisation.nix does).

What `nix flake check` looks at first: every `checks`, `packages`, `devShells` value is a
derivation and `apps` values are apps, with no stray attribute such as `override` (which
callPackage adds to any attribute set a file returns). The stand-in's packages are real
`builtins.derivation`s that are never built (its rules: nixpkgs-stand-in/default.nix), so what
is checked is the structure and the arguments the flake hands them, not a build.
"""

from __future__ import annotations

import pytest

from tests.nix.nixeval import EXPECTED_APPS, EXPECTED_RELEASE_APPS, REPO, NixError, nix_eval

SYSTEMS = ["aarch64-linux", "x86_64-linux"]
STAND_IN = REPO / "tests" / "nix" / "nixpkgs-stand-in"
APPS = set(EXPECTED_APPS) | set(EXPECTED_RELEASE_APPS)
# vLLM 0.33.0 beside the default 0.29.0: its environment, vLLM and closure, and its apps.
RELEASE_PACKAGES = {"vllm-env_0_33", "vllm_0_33", "vllm-wheel-closure_0_33"}
PACKAGES = (
    {
        "default",
        "vllm-env",
        "vllm-env-flashinfer-aot",
        "vllm",
        "vllm-wheel-closure",
        "flashinfer-jit-cache",
        "cuda-home",
        "nvidia-driver-libs",
        "image",
    }
    | RELEASE_PACKAGES
    | APPS
)
CHECKS = {"patch-series", "vllm-patched", "patch-series_0_33", "vllm-patched_0_33", "tests", "ruff", "shellcheck"} | {
    "formatting"
}

# The flake's outputs function applied to itself and the stand-in, as `nix flake check` does
# with the locked nixpkgs.
FLAKE = (
    'let nixpkgs = { outPath = /. + standIn; lib = import (/. + standIn + "/lib.nix"); }; '
    'flake = import (repo + "/flake.nix"); '
    "self = flake.outputs { inherit self nixpkgs; } // { outPath = repo; }; "
    "scope = system: self.legacyPackages.${system}.magpie-vllm-plugins; in "
)


def flake_eval(body: str, **strings: str):
    return nix_eval(FLAKE + body, standIn=str(STAND_IN), **strings)


def test_stand_in_callpackage_adds_override_to_attribute_sets_like_nixpkgs(tmp_path):
    """The property the output checks below rely on: a plain attribute set through callPackage
    comes back with `override` and `overrideDerivation` (nixpkgs' makeOverridable)."""
    (tmp_path / "set.nix").write_text("{ a }: { inherit a; }\n")
    names = nix_eval(
        'let standInLib = import (/. + standIn + "/lib.nix"); in '
        "builtins.attrNames (standInLib.callPackageWith { a = 1; } (/. + file) { })",
        standIn=str(STAND_IN),
        file=str(tmp_path / "set.nix"),
    )
    assert names == ["a", "override", "overrideDerivation"]
    with pytest.raises(NixError, match="the nixpkgs stand-in has no a"):
        nix_eval(
            'let standInLib = import (/. + standIn + "/lib.nix"); in '
            "(standInLib.callPackageWith { } (/. + file) { }).a",
            standIn=str(STAND_IN),
            file=str(tmp_path / "set.nix"),
        )


@pytest.mark.parametrize("system", SYSTEMS)
def test_each_output_of_a_system_holds_only_the_intended_names(system):
    names = flake_eval(
        "builtins.mapAttrs (_: output: builtins.attrNames output.${system}) "
        "{ inherit (self) checks packages apps devShells; }",
        system=system,
    )
    assert set(names["checks"]) == CHECKS
    assert set(names["packages"]) == PACKAGES
    assert set(names["apps"]) == APPS
    assert names["devShells"] == ["default"]


def test_outputs_cover_exactly_the_pinned_systems():
    systems = flake_eval(
        "builtins.mapAttrs (_: builtins.attrNames) "
        "{ inherit (self) checks packages apps devShells formatter legacyPackages; }"
    )
    assert systems == {name: SYSTEMS for name in systems}


@pytest.mark.parametrize("system", SYSTEMS)
def test_checks_packages_shells_and_formatter_are_derivations(system):
    types = flake_eval(
        "let drvType = v: v.type or (builtins.typeOf v); in "
        "{ checks = builtins.mapAttrs (_: drvType) self.checks.${system}; "
        "packages = builtins.mapAttrs (_: drvType) self.packages.${system}; "
        "shell = drvType self.devShells.${system}.default; "
        "formatter = self.formatter.${system}.name; }",
        system=system,
    )
    assert types["checks"] == {name: "derivation" for name in CHECKS}
    assert types["packages"] == {name: "derivation" for name in PACKAGES}
    assert types["shell"] == "derivation"
    assert types["formatter"] == "nixfmt-tree"


@pytest.mark.parametrize("system", SYSTEMS)
def test_apps_point_at_their_wrappers(system):
    apps = flake_eval(
        "builtins.mapAttrs (name: app: { inherit (app) type program; "
        "wrapper = toString self.packages.${system}.${name}; }) self.apps.${system}",
        system=system,
    )
    for name, app in apps.items():
        assert app["type"] == "app"
        assert app["program"] == f"{app['wrapper']}/bin/{name}"


def series_entries(release: str) -> list[str]:
    text = (REPO / "patches" / f"vllm-{release}" / "series").read_text()
    return [e for e in (line.split("#", 1)[0].strip() for line in text.splitlines()) if e]


@pytest.mark.parametrize("system", SYSTEMS)
def test_release_packages_are_built_from_that_releases_pins_and_series(system):
    got = flake_eval(
        "let p = self.packages.${system}; names = env: map (x: x.name) env.packagesGiven; in "
        "{ vllm = { inherit (p.vllm_0_33) version preInstall series; folder = toString p.vllm_0_33.patchSeries; "
        "src = p.vllm_0_33.src.name; }; "
        "closure = { inherit (p.vllm-wheel-closure_0_33) version; wheels = map (w: w.name) "
        "p.vllm-wheel-closure_0_33.wheels; }; "
        "env = { inherit (p.vllm-env_0_33) name; given = names p.vllm-env_0_33; }; "
        "default = { env = p.vllm-env.name; vllm = p.vllm.version; folder = toString p.vllm.patchSeries; }; }",
        system=system,
    )
    machine = system.split("-")[0]
    vllm = got["vllm"]
    assert vllm["version"] == "0.33.0"
    assert vllm["src"] == f"vllm-0.33.0-cp38-abi3-manylinux_2_28_{machine}.whl"
    assert vllm["folder"] == str(REPO / "patches" / "vllm-0.33.0")
    assert vllm["series"] == series_entries("0.33.0") and vllm["series"]
    assert vllm["preInstall"].count("patch -p1 --fuzz=0") == len(series_entries("0.33.0"))
    for entry in series_entries("0.33.0"):
        assert f'echo "applying {entry}"' in vllm["preInstall"]
    # The 0.33.0 closure is its own resolution (torch 2.14), without vLLM itself.
    closure = got["closure"]
    assert closure["version"] == "0.33.0"
    assert any(name.startswith("torch-2.14.0-") for name in closure["wheels"])
    assert not any(name.startswith(("torch-2.13.", "vllm-")) for name in closure["wheels"])
    assert len(closure["wheels"]) == 198
    assert got["env"]["name"] == "vllm-0.33.0-magpie-env"
    assert got["env"]["given"] == ["vllm-wheel-closure-0.33.0", "vllm-0.33.0"]
    # The default stays 0.29.0.
    assert got["default"] == {
        "env": "vllm-0.29.0-magpie-env",
        "vllm": "0.29.0",
        "folder": str(REPO / "patches" / "vllm-0.29.0"),
    }


@pytest.mark.parametrize("system", SYSTEMS)
def test_release_apps_run_that_releases_environment(system):
    got = flake_eval(
        "let p = self.packages.${system}; in "
        "{ env033 = toString p.vllm-env_0_33; env029 = toString p.vllm-env; cuda029 = toString p.cuda-home; "
        'cuda033 = toString (scope system).releases."0.33.0".cudaHome; '
        "apps = builtins.mapAttrs (name: app: { inherit (app) program; inherit (app.meta) description; "
        "text = p.${name}.text; }) self.apps.${system}; }",
        system=system,
    )
    apps = got["apps"]
    for name, (script, release) in EXPECTED_RELEASE_APPS.items():
        base = name.removesuffix("_0_33")
        app = apps[name]
        assert app["program"].endswith(f"/bin/{name}")
        assert app["description"] == f"{apps[base]['description']} (vLLM {release})"
        assert f"{got['env033']}/bin/python" in app["text"], name
        assert got["env029"] not in app["text"], name
        assert f"/{script}" in app["text"]
        # The same wrapper as the default release's, but for the environment it runs (and the
        # CUDA_HOME made from that release's closure, for FlashInfer's JIT).
        text033 = app["text"].replace(got["env033"], "ENV").replace(got["cuda033"], "CUDA")
        text029 = apps[base]["text"].replace(got["env029"], "ENV").replace(got["cuda029"], "CUDA")
        assert text033 == text029.replace(f"/bin/{base}", f"/bin/{name}")
    # The other apps do not run vLLM: no per-release copy.
    others = set(EXPECTED_APPS) - {name.removesuffix("_0_33") for name in EXPECTED_RELEASE_APPS}
    for name in others:
        assert got["env033"] not in apps[name]["text"], name


def test_release_series_check_patches_that_releases_sdist():
    checks = flake_eval(
        'let c = self.checks."x86_64-linux"; in builtins.mapAttrs (_: d: d.buildCommand) '
        "{ inherit (c) patch-series patch-series_0_33; }"
    )
    for name, release in (("patch-series", "0.29.0"), ("patch-series_0_33", "0.33.0")):
        command = checks[name]
        assert f"-vllm-{release}.tar.gz\n" in command and f"cd vllm-{release}\n" in command, name
        assert command.count("patch -p1 --fuzz=0") == len(series_entries(release)), name
        assert "status --require-applied --target ." in command


def test_app_wrappers_run_on_their_listed_tools_only():
    texts = flake_eval(
        'let s = scope "aarch64-linux"; in builtins.mapAttrs (_: apps: builtins.mapAttrs (_: w: w.text) apps) '
        '{ default = s.apps; v033 = s.releases."0.33.0".apps; }'
    )
    # serve-flash-next, sweep (which launches it) and memguard call the host driver's nvidia-smi,
    # after their own tools; the same in every release's scope. writeShellApplication's PATH line
    # (its header's fourth line after the shebang and three `set -o`) ends in `:$PATH` for those.
    for apps in texts.values():
        assert set(apps) == set(EXPECTED_APPS)
        for name, text in apps.items():
            lines = text.splitlines()
            assert lines[1:4] == ["set -o errexit", "set -o nounset", "set -o pipefail"], name
            assert lines[5].startswith('export PATH="/nix/store/'), name
            assert lines[5].endswith(':$PATH"') == (name in {"serve-flash-next", "sweep", "memguard"}), name


def test_default_environment_leaves_flashinfer_aot_out_and_the_opt_in_has_it():
    envs = flake_eval(
        "let names = env: map (p: p.name) env.packagesGiven; "
        'pkgs = self.packages."aarch64-linux"; in '
        "{ default = names pkgs.default; aot = names pkgs.vllm-env-flashinfer-aot; }"
    )
    assert not any(name.startswith("flashinfer-jit-cache") for name in envs["default"])
    assert any(name.startswith("flashinfer-jit-cache") for name in envs["aot"])


def test_flashinfer_aot_build_is_capped_and_asks_for_a_big_builder():
    drv = flake_eval(
        'let d = self.packages."x86_64-linux".flashinfer-jit-cache; in '
        "{ inherit (d) requiredSystemFeatures buildPhase; }"
    )
    assert drv["requiredSystemFeatures"] == ["big-parallel"]
    assert 'NVCC_PREPEND_FLAGS="-ccbin ' in drv["buildPhase"]
    assert "export MAX_JOBS=$jobs" in drv["buildPhase"] and "-gt 4" in drv["buildPhase"]


def test_series_check_runs_in_a_phase_that_always_runs():
    drv = flake_eval('let d = self.packages."aarch64-linux".vllm; in { inherit (d) preInstall postInstall; }')
    assert drv["preInstall"].count("patch -p1 --fuzz=0") == 3
    assert "status \\\n  --require-applied" in drv["preInstall"]
    assert "wheel pack" in drv["preInstall"]
    assert "--require-applied" in drv["postInstall"]


def test_patch_series_folder_is_an_option_of_the_vllm_package(tmp_path):
    vllm = flake_eval(
        'let v = (scope "aarch64-linux").vllm; in { folder = toString v.patchSeries; inherit (v) series; }'
    )
    assert vllm["folder"] == str(REPO / "patches" / "vllm-0.29.0")
    text = (REPO / "patches" / "vllm-0.29.0" / "series").read_text()
    assert vllm["series"] == [e for e in (line.split("#", 1)[0].strip() for line in text.splitlines()) if e]
    other = tmp_path / "vllm-0.33.0"
    other.mkdir()
    (other / "series").write_text("")
    refusal = r"patchSeries vllm-0.33.0 is not the pinned vLLM's \(vllm-0.29.0\)"
    overridden = '((scope "aarch64-linux").vllm.override { patchSeries = /. + d; })'
    with pytest.raises(NixError, match=refusal):
        flake_eval(f"toString {overridden}.patchSeries", d=str(other))
    # And the 0.33.0 scope's vLLM refuses the 0.29.0 series.
    overridden = (
        '((scope "aarch64-linux").releases."0.33.0".vllm.override { patchSeries = repo + "/patches/vllm-0.29.0"; })'
    )
    with pytest.raises(NixError, match=r"patchSeries vllm-0.29.0 is not the pinned vLLM's \(vllm-0.33.0\)"):
        flake_eval(f"toString {overridden}.patchSeries")


def test_every_wheel_is_fetched_from_its_immutable_path_under_nixpkgs_pypi_mirror():
    fetched = flake_eval(
        'let s = scope "x86_64-linux"; in map (w: w.name) s.wheelClosure.wheels ++ [ s.vllm.src.name ]'
    )
    assert len(fetched) == 198 and all(name.endswith(".whl") for name in fetched)
    bases = flake_eval('(scope "x86_64-linux").registryFileBases')
    assert bases == ["https://registry.invalid/packages/"]
