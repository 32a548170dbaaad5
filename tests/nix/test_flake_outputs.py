"""The flake's outputs evaluated by Nix itself, with a stand-in for nixpkgs (nixpkgs-stand-in/:
its callPackage, makeOverridable and makeScope behave as nixpkgs' lib/customisation.nix does).

What `nix flake check` looks at first: every `checks`, `packages`, `devShells` value is a
derivation and `apps` values are apps, with no stray attribute such as `override` (which
callPackage adds to any attribute set a file returns). The stand-in's packages are real
`builtins.derivation`s that are never built (its rules: nixpkgs-stand-in/default.nix), so what
is checked is the structure and the arguments the flake hands them, not a build.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from magpie import releases
from tests.nix.nixeval import EXPECTED_APPS, EXPECTED_RELEASE_APPS, OTHER_RELEASES, REPO, NixError, nix_eval

SYSTEMS = ["aarch64-linux", "x86_64-linux"]
STAND_IN = REPO / "tests" / "nix" / "nixpkgs-stand-in"
DEFAULT = releases.default()
APPS = set(EXPECTED_APPS) | set(EXPECTED_RELEASE_APPS)
# Each other release of the table beside the default: its environment, vLLM and closure, and
# its apps, with its suffix (`vllm-env_0_33`).
RELEASE_PACKAGES = {
    name + releases.nix_suffix(release)
    for release in OTHER_RELEASES
    for name in ("vllm-env", "vllm", "vllm-wheel-closure")
}
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
CHECKS = {
    name + releases.nix_suffix(release)
    for release in releases.series_releases()
    for name in ("patch-series", "vllm-patched")
} | {"tests", "ruff", "shellcheck", "formatting"}

# The flake's outputs function applied to itself and the stand-in, as `nix flake check` does
# with the locked nixpkgs.
FLAKE = (
    'let nixpkgs = { outPath = /. + standIn; lib = import (/. + standIn + "/lib.nix"); }; '
    'flake = import (repo + "/flake.nix"); '
    "self = flake.outputs { inherit self nixpkgs; } // { outPath = repo; }; "
    "scope = system: self.legacyPackages.${system}.magpie-vllm-plugins; in "
)


def flake_eval(body: str, *, checkout: Path = REPO, **strings: str):
    """`body` with the flake's outputs (`self`, `scope`) of `checkout` (this one unless a test
    gives a copy)."""
    return nix_eval(FLAKE + body, checkout=checkout, standIn=str(STAND_IN), **strings)


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


def pinned_wheels(release: str, system: str) -> dict:
    return json.loads((REPO / releases.pins_file(release, system)).read_text())["wheels"]


@pytest.mark.parametrize("release", OTHER_RELEASES)
@pytest.mark.parametrize("system", SYSTEMS)
def test_release_packages_are_built_from_that_releases_pins_and_series(system, release):
    suffix = releases.nix_suffix(release)
    got = flake_eval(
        "let p = self.packages.${system}; names = env: map (x: x.name) env.packagesGiven; "
        'vllm = p."vllm${suffix}"; closure = p."vllm-wheel-closure${suffix}"; env = p."vllm-env${suffix}"; in '
        "{ vllm = { inherit (vllm) version preInstall series; folder = toString vllm.patchSeries; "
        "src = vllm.src.name; }; "
        "closure = { inherit (closure) version; wheels = map (w: w.name) closure.wheels; }; "
        "env = { inherit (env) name; given = names env; }; "
        "default = { env = p.vllm-env.name; vllm = p.vllm.version; folder = toString p.vllm.patchSeries; }; }",
        system=system,
        suffix=suffix,
    )
    wheels = pinned_wheels(release, system)
    vllm = got["vllm"]
    assert vllm["version"] == release
    assert vllm["src"] == wheels["vllm"]["filename"]
    assert vllm["folder"] == str(REPO / "patches" / f"vllm-{release}")
    assert vllm["series"] == series_entries(release) and vllm["series"]
    assert vllm["preInstall"].count("patch -p1 --fuzz=0") == len(series_entries(release))
    for entry in series_entries(release):
        assert f'echo "applying {entry}"' in vllm["preInstall"]
    # The closure is the release's own resolution (its pins file), without vLLM itself.
    closure = got["closure"]
    assert closure["version"] == release
    assert sorted(closure["wheels"]) == sorted(w["filename"] for name, w in wheels.items() if name != "vllm")
    default_torch = pinned_wheels(DEFAULT, system)["torch"]["filename"]
    assert (default_torch in closure["wheels"]) == (wheels["torch"]["filename"] == default_torch)
    assert got["env"]["name"] == f"vllm-{release}-magpie-env"
    assert got["env"]["given"] == [f"vllm-wheel-closure-{release}", f"vllm-{release}"]
    # The default stays the table's default.
    assert got["default"] == {
        "env": f"vllm-{DEFAULT}-magpie-env",
        "vllm": DEFAULT,
        "folder": str(REPO / "patches" / f"vllm-{DEFAULT}"),
    }


@pytest.mark.parametrize("release", OTHER_RELEASES)
@pytest.mark.parametrize("system", SYSTEMS)
def test_release_apps_run_that_releases_environment(system, release):
    suffix = releases.nix_suffix(release)
    got = flake_eval(
        "let p = self.packages.${system}; in "
        '{ envOther = toString p."vllm-env${suffix}"; envDefault = toString p.vllm-env; '
        "cudaDefault = toString p.cuda-home; cudaOther = toString (scope system).releases.${release}.cudaHome; "
        "apps = builtins.mapAttrs (name: app: { inherit (app) program; inherit (app.meta) description; "
        "text = p.${name}.text; }) self.apps.${system}; }",
        system=system,
        suffix=suffix,
        release=release,
    )
    apps = got["apps"]
    mine = {name: script for name, (script, of) in EXPECTED_RELEASE_APPS.items() if of == release}
    assert mine
    for name, script in mine.items():
        base = name.removesuffix(suffix)
        app = apps[name]
        assert app["program"].endswith(f"/bin/{name}")
        assert app["description"] == f"{apps[base]['description']} (vLLM {release})"
        assert f"{got['envOther']}/bin/python" in app["text"], name
        assert got["envDefault"] not in app["text"], name
        assert f"/{script}" in app["text"]
        # The same wrapper as the default release's, but for the environment it runs (and the
        # CUDA_HOME made from that release's closure, for FlashInfer's JIT).
        text_other = app["text"].replace(got["envOther"], "ENV").replace(got["cudaOther"], "CUDA")
        text_default = apps[base]["text"].replace(got["envDefault"], "ENV").replace(got["cudaDefault"], "CUDA")
        assert text_other == text_default.replace(f"/bin/{base}", f"/bin/{name}")
    # The other apps do not run vLLM: no per-release copy.
    others = set(EXPECTED_APPS) - {name.removesuffix(suffix) for name in mine}
    for name in others:
        assert got["envOther"] not in apps[name]["text"], name


def test_release_series_check_patches_that_releases_sdist():
    names = {"patch-series" + releases.nix_suffix(release): release for release in releases.series_releases()}
    checks = flake_eval(
        'let c = self.checks."x86_64-linux"; in builtins.mapAttrs (name: _: c.${name}.buildCommand) '
        "(builtins.fromJSON names)",
        names=json.dumps(names),
    )
    assert set(checks) == set(names) and len(names) >= 2
    for name, release in names.items():
        command = checks[name]
        sdist = releases.sdist(release)
        assert f"-{sdist['filename']}\n" in command and f"cd vllm-{release}\n" in command, name
        assert command.count("patch -p1 --fuzz=0") == len(series_entries(release)), name
        assert "status --require-applied --target ." in command


def test_release_series_check_fetches_the_tables_sdist():
    """The patch-series checks' source is the table's sdist: its content-addressed path and sha256."""
    fetched = nix_eval("builtins.listToAttrs (map (r: { name = r; value = lib.sdistPin r; }) lib.seriesReleases)")
    assert set(fetched) == set(releases.series_releases())
    for release, pin in fetched.items():
        sdist = releases.sdist(release)
        assert pin == {
            "name": "vllm-sdist",
            "filename": sdist["filename"],
            "path": sdist["path"],
            "hash": "sha256:" + sdist["sha256"],
        }


def test_app_wrappers_run_on_their_listed_tools_only():
    texts = flake_eval(
        'let s = scope "aarch64-linux"; in builtins.mapAttrs (_: apps: builtins.mapAttrs (_: w: w.text) apps) '
        "({ default = s.apps; } // builtins.mapAttrs (_: r: r.apps) s.releases)"
    )
    assert set(texts) == {"default", *OTHER_RELEASES}
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
    assert drv["preInstall"].count("patch -p1 --fuzz=0") == len(series_entries(DEFAULT)) > 0
    assert "status \\\n  --require-applied" in drv["preInstall"]
    assert "wheel pack" in drv["preInstall"]
    assert "--require-applied" in drv["postInstall"]


def test_patch_series_folder_is_an_option_of_the_vllm_package(tmp_path):
    vllm = flake_eval(
        'let v = (scope "aarch64-linux").vllm; in { folder = toString v.patchSeries; inherit (v) series; }'
    )
    assert vllm["folder"] == str(REPO / "patches" / f"vllm-{DEFAULT}")
    assert vllm["series"] == series_entries(DEFAULT)
    other = tmp_path / "vllm-0.99.0"
    other.mkdir()
    (other / "series").write_text("")
    refusal = rf"patchSeries vllm-0.99.0 is not the pinned vLLM's \(vllm-{DEFAULT}\)"
    overridden = '((scope "aarch64-linux").vllm.override { patchSeries = /. + d; })'
    with pytest.raises(NixError, match=refusal):
        flake_eval(f"toString {overridden}.patchSeries", d=str(other))
    # And each other release's scope's vLLM refuses the default's series.
    for release in OTHER_RELEASES:
        overridden = (
            f'((scope "aarch64-linux").releases."{release}".vllm.override '
            f'{{ patchSeries = repo + "/patches/vllm-{DEFAULT}"; }})'
        )
        with pytest.raises(NixError, match=rf"patchSeries vllm-{DEFAULT} is not the pinned vLLM's \(vllm-{release}\)"):
            flake_eval(f"toString {overridden}.patchSeries")


def test_every_wheel_is_fetched_from_its_immutable_path_under_nixpkgs_pypi_mirror():
    fetched = flake_eval(
        'let s = scope "x86_64-linux"; in map (w: w.name) s.wheelClosure.wheels ++ [ s.vllm.src.name ]'
    )
    wheels = pinned_wheels(DEFAULT, "x86_64-linux")
    assert sorted(fetched) == sorted(w["filename"] for w in wheels.values())
    assert len(fetched) > 100 and all(name.endswith(".whl") for name in fetched)
    bases = flake_eval('(scope "x86_64-linux").registryFileBases')
    assert bases == ["https://registry.invalid/packages/"]


def test_the_default_cuda_capabilities_are_one_per_system_and_overridable():
    """x86_64's apps JIT-build for Hopper only by default (issue 27: 9.0 10.0 12.0 tripled the first
    FlashInfer build on an H100); the GB10's for 12.1; the scope's cudaCapabilities wins."""
    texts = flake_eval(
        "let s = system: (scope system).apps.serve-flash-next.text; "
        'o = (scope "x86_64-linux").overrideScope (f: p: { cudaCapabilities = [ "10.0" "12.0" ]; }); in '
        '{ x86 = s "x86_64-linux"; arm = s "aarch64-linux"; over = o.apps.serve-flash-next.text; }'
    )
    assert 'FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0}"' in texts["x86"]
    assert 'TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"' in texts["x86"]
    assert 'FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-12.1}"' in texts["arm"]
    assert 'FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-10.0 12.0}"' in texts["over"]


@pytest.mark.parametrize("system", SYSTEMS)
def test_the_environments_interpreter_is_its_own_after_the_rename(system):
    """nixpkgs' python.withPackages keeps `interpreter` in passthru, naming the environment it
    built; vllm-env.nix renames it with overrideAttrs (another store path), so it must set it
    again (issue 27), or `env.interpreter` runs a Python that is not the package's."""
    got = flake_eval(
        'let e = self.packages.${system}.vllm-env; in { out = "${e}"; inherit (e) interpreter; '
        'aot = (scope system).envWithFlashinferAot.interpreter; aotOut = "${(scope system).envWithFlashinferAot}"; }',
        system=system,
    )
    assert got["interpreter"] == got["out"] + "/bin/python3.12"
    assert got["aot"] == got["aotOut"] + "/bin/python3.12" and got["aotOut"] != got["out"]
