"""Adding a vLLM release is its rebased series, one row of magpie/releases.json and its
regenerated pins: a copy of this checkout gets a fake 0.35.0 that way (the series copied from
0.34.0 with its Target headers moved on, as `patches rebase` writes them; the pins copied from
0.34.0's with the vLLM wheel renamed, as `pin-wheels` would write them, its `overrides` kept), and
every consumer of the table picks it up with no other edit: the table's reader, the pin generator,
nix/lib.nix and the flake's outputs (their `_0_35` names), the sdist fetcher, the serving
launcher's PLE switch, the GPU harness and the tests' parametrization. The copy's own
release-sensitive Nix tests (those parametrized over the table and those that read all of its
rows) then run against it.

Then the real rows' own rules: `pins.overrides` (0.34.0's flashinfer-python), resolved by a real
pip through magpie/nix/pip_target_env.py, and the V2-only releases (has_runner_switch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from magpie import releases
from tests.nix.nixeval import nix_eval
from tests.nix.test_flake_outputs import flake_eval
from tests.releases import each_series, sdist_tree, series_dir

REPO = Path(__file__).resolve().parent.parent
NEW, FROM = "0.35.0", "0.34.0"
SYSTEMS = ["aarch64-linux", "x86_64-linux"]
FAKE_SDIST = {
    "filename": f"vllm-{NEW}.tar.gz",
    "sha256": "ab" * 32,
    "path": f"12/34/{'5' * 60}/vllm-{NEW}.tar.gz",
}


def checkout_files() -> list[str]:
    """What a clone holds (tracked and new files), as the GPU harness counts a checkout."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    return [name for name in out.stdout.decode().split("\0") if name and (REPO / name).is_file()]


def add_release(root: Path) -> None:
    """The three steps of docs/vllm-releases.md ("Adding a release"), done by hand in `root`."""
    # 1. The rebased series (patches rebase writes the new Target: header).
    shutil.copytree(root / "patches" / f"vllm-{FROM}", root / "patches" / f"vllm-{NEW}")
    for patch in (root / "patches" / f"vllm-{NEW}").rglob("*.patch"):
        patch.write_text(patch.read_text().replace(f"Target: vllm {FROM}\n", f"Target: vllm {NEW}\n", 1))
    # 2. One row. Its PLE switch is deliberately not what a 0.30+ release would have, so that a
    # consumer that guesses from the version number instead of reading the row is caught; the
    # GPU harness moves to it too.
    table = json.loads((root / "magpie" / "releases.json").read_text())
    for row in table["releases"].values():
        row.pop("gpu_harness", None)
    table["releases"][NEW] = {
        "series": True,
        "ple_switch": "hf-overrides",
        "pins": {
            "extra_requirements": [],
            "overrides": dict(table["releases"][FROM]["pins"]["overrides"]),
            "uploaded_prior_to": "2027-01-01T00:00:00Z",
            "why": "a test's release",
        },
        "test_sdist": True,
        "sdist": FAKE_SDIST,
        "gpu_harness": True,
    }
    (root / "magpie" / "releases.json").write_text(json.dumps(table, indent=2) + "\n")
    # 3. The pins, as pin-wheels writes them (here: 0.33.0's, with the vLLM wheel renamed).
    for system in SYSTEMS:
        pins_text = (root / releases.pins_file(FROM, system)).read_text()
        pins = json.loads(pins_text)
        vllm = pins["wheels"]["vllm"]
        old_name = vllm["filename"]
        vllm["version"] = NEW
        vllm["filename"] = old_name.replace(f"vllm-{FROM}-", f"vllm-{NEW}-")
        vllm["path"] = vllm["path"].replace(old_name, vllm["filename"])
        pins["requirement"] = f"vllm=={NEW}"
        settings = table["releases"][NEW]["pins"]
        pins["extra_requirements"] = settings["extra_requirements"]
        pins["uploaded_prior_to"] = settings["uploaded_prior_to"]
        pins["overrides"] = settings["overrides"]
        target = root / "nix" / "pins" / f"vllm-{NEW}" / f"{system}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(pins, indent=2) + "\n")
        text = (root / releases.requirements_file(FROM, system)).read_text()
        text = text.replace(f"\nvllm=={FROM} \\", f"\nvllm=={NEW} \\").replace(f"vllm-{FROM}/", f"vllm-{NEW}/")
        target = root / "requirements" / f"vllm-{NEW}" / f"{system}.txt"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checkout")
    for name in checkout_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    add_release(root)
    return root


@pytest.fixture
def table(checkout, monkeypatch) -> Path:
    """MAGPIE_RELEASES at the copy's table, for the consumers that run in this process."""
    path = checkout / "magpie" / "releases.json"
    monkeypatch.setenv("MAGPIE_RELEASES", str(path))
    return path


def test_the_table_reader_has_the_new_release(table):
    assert releases.table_path() == table
    assert releases.series_releases()[-2:] == [FROM, NEW]
    assert releases.other_series_releases()[-1] == NEW
    assert releases.nix_suffix(NEW) == "_0_35"
    assert releases.pins_file(NEW, "x86_64-linux") == f"nix/pins/vllm-{NEW}/x86_64-linux.json"
    assert releases.requirements_file(NEW, "x86_64-linux") == f"requirements/vllm-{NEW}/x86_64-linux.txt"
    assert releases.gpu_harness_release() == NEW
    assert NEW in releases.sdists_for_tests()


def test_the_pin_generator_pins_it(table):
    from magpie.nix import pin_wheels

    args = pin_wheels.parse_args([])
    assert list(args.releases) == releases.series_releases() and NEW in args.releases
    assert args.releases[NEW] == {
        "requirement": f"vllm=={NEW}",
        "extra_requirements": [],
        "uploaded_prior_to": "2027-01-01T00:00:00Z",
        "overrides": {"flashinfer-python": "0.7.4"},
    }
    assert pin_wheels.pins_file(NEW, "aarch64-linux") == f"nix/pins/vllm-{NEW}/aarch64-linux.json"
    assert list(pin_wheels.parse_args(["--release", NEW]).releases) == [NEW]


def test_nix_lib_and_the_flake_build_it_with_the_suffix(checkout):
    got = nix_eval(
        f'{{ inherit (lib) defaultVllmRelease otherVllmReleases; suffix = lib.releaseSuffix "{NEW}"; '
        f'pins = lib.pinsFile "{NEW}" "x86_64-linux"; sdist = lib.sdistPin "{NEW}"; }}',
        checkout=checkout,
    )
    assert got["defaultVllmRelease"] == releases.default()
    assert got["otherVllmReleases"][-2:] == [FROM, NEW]
    assert got["suffix"] == "_0_35" and got["pins"] == f"vllm-{NEW}/x86_64-linux.json"
    assert got["sdist"] == {"name": "vllm-sdist", **{k: FAKE_SDIST[k] for k in ("filename", "path")}} | {
        "hash": f"sha256:{FAKE_SDIST['sha256']}"
    }
    names = flake_eval(
        'builtins.mapAttrs (_: output: builtins.attrNames output."x86_64-linux") '
        "{ inherit (self) checks packages apps; }",
        checkout=checkout,
    )
    assert {"patch-series_0_35", "vllm-patched_0_35"} <= set(names["checks"])
    assert {"vllm-env_0_35", "vllm_0_35", "vllm-wheel-closure_0_35", "serve-flash-next_0_35"} <= set(names["packages"])
    assert {"serve-flash-next_0_35", "sweep_0_35", "build-keepset_0_35", "count-tokens_0_35"} <= set(names["apps"])
    built = flake_eval(
        'let p = self.packages."x86_64-linux"; c = self.checks."x86_64-linux"; in '
        "{ version = p.vllm_0_35.version; folder = toString p.vllm_0_35.patchSeries; "
        "check = c.patch-series_0_35.buildCommand; }",
        checkout=checkout,
    )
    assert built["version"] == NEW and built["folder"] == str(checkout / "patches" / f"vllm-{NEW}")
    assert f"-vllm-{NEW}.tar.gz\n" in built["check"] and f"cd vllm-{NEW}\n" in built["check"]


def test_the_sdist_fetcher_pins_its_hash(table):
    from tests.env import fetch_sdist

    assert fetch_sdist.pinned_sha256(NEW) == FAKE_SDIST["sha256"]


def test_the_ple_switch_is_the_rows(table):
    """0.35.0's row says hf-overrides: the table's answer, not a guess from the version number
    (0.34.1 still takes 0.34.0's row, 0.35.2 the new one)."""
    assert releases.ple_switch(NEW) == "hf-overrides"
    assert releases.ple_switch("0.35.2") == "hf-overrides"
    assert releases.ple_switch("0.34.1") == "engram-disk-offload"


def test_the_serving_launcher_spells_ple_as_the_row_says(table):
    from magpie.serving import launch

    config = {"hf-overrides": {"ple_mmap": True}}
    assert launch.ple_for_release(config, NEW) == config
    assert launch.ple_for_release(config, FROM) == {"engram-config": {"disk_offload": True}}


def test_the_gpu_harness_carries_it(checkout):
    """The copy's harness (its own table, no variable) defaults to the new release and names its
    wheel and requirements file."""
    env = {k: v for k, v in os.environ.items() if k != "MAGPIE_RELEASES"}
    code = (
        "from magpie.gpu import gpu_harness as harness; "
        "print(harness.RELEASE, harness.WHEEL_NAME, harness.PINS.relative_to(harness.REPO), sep='\\n')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        NEW,
        f"vllm-{NEW}-cp38-abi3-manylinux_2_28_x86_64.whl",
        f"requirements/vllm-{NEW}/x86_64-linux.txt",
    ]
    help_text = subprocess.run(
        [sys.executable, str(checkout / "magpie"), "gpu-harness", "prepare", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert re.search(rf"--release \{{[0-9., ]*{re.escape(NEW)}\}}", help_text), help_text
    assert f"(default: {NEW}, the table's gpu_harness row)" in " ".join(help_text.split())


# The copy's Nix tests that the new row can change: every test parametrized over the table (its
# ids hold NEW) and the unparametrized ones that read all of the table's rows. The rest read no
# row (or only the default's) and pass the same in the copy as here, where they run anyway.
TABLE_WIDE = (
    "test_each_output_of_a_system_holds_only_the_intended_names",
    "test_checks_packages_shells_and_formatter_are_derivations",
    "test_apps_point_at_their_wrappers",
    "test_release_series_check_patches_that_releases_sdist",
    "test_release_series_check_fetches_the_tables_sdist",
    "test_pin_files_are_where_the_generator_and_the_flake_look",
)
RELEASE_SENSITIVE = f"not registry and ({NEW} or {' or '.join(TABLE_WIDE)})"


def test_the_tests_parametrize_over_it_and_the_copys_nix_suite_passes(checkout):
    """The copy's own tests/nix files, collected from its table: the new release's ids appear, and
    every release-sensitive test passes (the registry ones aside), with no test edited."""
    env = {k: v for k, v in os.environ.items() if k != "MAGPIE_RELEASES"}
    files = ["tests/nix/test_flake_outputs.py", "tests/nix/test_nix_lib.py", "tests/nix/test_flake_pins.py"]
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--noconftest"]
    collected = subprocess.run(
        [*args, "-q", "-k", "not registry", "--collect-only", *files, "tests/test_releases.py"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    ids = collected.stdout
    assert f"test_release_packages_are_built_from_that_releases_pins_and_series[aarch64-linux-{NEW}]" in ids
    assert f"test_release_apps_run_that_releases_environment[x86_64-linux-{NEW}]" in ids
    assert f"test_requirements_file_is_the_same_set_as_the_pins[{NEW}-x86_64-linux]" in ids
    assert f"test_series_of_the_repository_matches_the_patch_tool[{NEW}]" in ids
    assert f"test_each_series_is_collected[{NEW}]" in ids  # tests/releases.py's each_series
    # What the run below must pass: every Nix test id holding NEW, and each table-wide test
    # (asserted present, so that a rename cannot drop it from the run unseen).
    nix_ids = [line for line in ids.splitlines() if line.startswith("tests/nix/")]
    expected = {i for i in nix_ids if NEW in i} | {i for i in nix_ids if i.split("::")[-1].split("[")[0] in TABLE_WIDE}
    assert {i.split("::")[-1].split("[")[0] for i in expected} >= set(TABLE_WIDE), ids[-3000:]
    ran = subprocess.run(
        [*args, "-v", "-k", RELEASE_SENSITIVE, *files],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    passed = set(re.findall(r"^(tests/nix/\S+) PASSED", ran.stdout, re.M))
    assert passed == expected, (sorted(expected - passed), sorted(passed - expected))


@each_series
def test_each_series_is_collected(release):
    """tests/releases.py's marker: one test per row with a series, each with its folder."""
    assert (series_dir(release) / "series").is_file()
    assert release in releases.series_releases()


@pytest.mark.parametrize(
    "edit, refusal",
    [
        (lambda t: t["releases"]["0.33.0"].pop("pins"), r"releases.0.33.0: a release with a series needs `pins"),
        (lambda t: t["releases"]["0.33.0"]["pins"].update(uploaded_prior_to="soon"), r"0.33.0.pins.uploaded_prior_to"),
        (lambda t: t["releases"]["0.31.0"].pop("role"), r"releases.0.31.0: a release without a series says why"),
        (lambda t: t["releases"]["0.33.0"].update(ple_switch="cli"), r"0.33.0.ple_switch must be one of"),
        (lambda t: t["releases"]["0.33.0"].update(gpu_harness=True), r"exactly one release has `gpu_harness: true`"),
        (lambda t: t["releases"]["0.31.0"].update(gpu_harness=True), r"0.31.0: `gpu_harness` needs a release with a"),
        (lambda t: t.update(default="0.31.0"), r"`default` must name a release with a series"),
        (lambda t: t["releases"]["0.32.0"]["sdist"].update(filename="vllm-0.32.1.tar.gz"), r"vllm-0.32.0.tar.gz"),
        (lambda t: t["releases"].update({"0.34": t["releases"]["0.33.0"]}), r"a release is MAJOR.MINOR.PATCH"),
    ],
)
def test_a_malformed_table_is_refused_naming_the_field(tmp_path, monkeypatch, edit, refusal):
    table = json.loads(releases.TABLE.read_text())
    edit(table)
    (tmp_path / "releases.json").write_text(json.dumps(table))
    monkeypatch.setenv("MAGPIE_RELEASES", str(tmp_path / "releases.json"))
    with pytest.raises(releases.ReleaseError, match=refusal):
        releases.series_releases()


# The real rows' own rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, accepted",
    [
        ({"flashinfer-python": "0.7.4"}, True),
        ({"flashinfer-python": "0.7.4.post1", "torch": "2.14.0+cu130"}, True),
        ({}, True),
        (["flashinfer-python==0.7.4"], False),  # a list, not name -> version
        ({"flashinfer-python": ">=0.7.4"}, False),  # a range: the resolution would not be pinned
        ({"flashinfer-python": 74}, False),
        ({"flashinfer-python": "latest"}, False),
    ],
)
def test_pins_overrides_map_a_package_to_one_version(tmp_path, monkeypatch, overrides, accepted):
    table = json.loads(releases.TABLE.read_text())
    table["releases"]["0.34.0"]["pins"]["overrides"] = overrides
    (tmp_path / "releases.json").write_text(json.dumps(table))
    monkeypatch.setenv("MAGPIE_RELEASES", str(tmp_path / "releases.json"))
    if accepted:
        assert releases.row("0.34.0")["pins"]["overrides"] == overrides
    else:
        with pytest.raises(releases.ReleaseError, match=r"releases.0.34.0.pins.overrides must map a package name"):
            releases.series_releases()


def test_the_0_34_row_overrides_flashinfer_and_its_pins_carry_it():
    from magpie.nix import pin_wheels

    assert releases.row("0.34.0")["pins"]["overrides"] == {"flashinfer-python": "0.7.4"}
    assert pin_wheels.parse_args(["--release", "0.34.0"]).releases["0.34.0"]["overrides"] == {
        "flashinfer-python": "0.7.4"
    }
    assert pin_wheels.parse_args(["--release", "0.33.0"]).releases["0.33.0"]["overrides"] == {}
    for system in SYSTEMS:
        pins = json.loads((REPO / releases.pins_file("0.34.0", system)).read_text())
        assert pins["overrides"] == {"flashinfer-python": "0.7.4"}
        assert pins["wheels"]["flashinfer-python"]["version"] == "0.7.4"
        text = (REPO / releases.requirements_file("0.34.0", system)).read_text()
        assert "\n# with flashinfer-python==0.7.4 in place of the version its requirers' metadata pins\n" in text
        assert "\nflashinfer-python==0.7.4 \\" in text
        assert "overrides" not in json.loads((REPO / releases.pins_file("0.33.0", system)).read_text())
    # What the override stands for: 0.34.0's own metadata pins a version that is not published.
    cuda = (sdist_tree("0.34.0") / "requirements" / "cuda.txt").read_text()
    assert "\nflashinfer-python==0.7.3\n" in cuda


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal pure-Python wheel: its METADATA (with Requires-Dist), WHEEL and RECORD."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def test_pip_resolves_an_overridden_pin_to_the_override_through_pip_target_env(tmp_path):
    """A real pip (the one pin-wheels runs: the nix tools', else the test venv's) resolving a
    local index the way pin-wheels resolves the registry: toy-vllm pins toy-flashinfer==0.7.3,
    which the index does not have (0.7.2 and 0.7.4 only), as vLLM 0.34.0 pins flashinfer-python.
    Without an override pip refuses; with {"toy-flashinfer": "0.7.4"} it resolves 0.7.4, its own
    requirements followed, and the dependency edges name it."""
    from magpie.nix import pin_wheels

    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "toy-vllm", "1.0", ("toy-flashinfer==0.7.3", "toy-util; python_version >= '3'"))
    _wheel(index, "toy-flashinfer", "0.7.2")
    _wheel(index, "toy-flashinfer", "0.7.4", ("toy-cuda==13.0",))
    _wheel(index, "toy-util", "1.0")
    _wheel(index, "toy-cuda", "13.0")
    nix_tools = REPO / ".cache" / "nix-tools" / "bin" / "python"
    python = str(nix_tools) if nix_tools.exists() else sys.executable
    environment = json.loads(
        subprocess.run(
            [
                python,
                "-c",
                "import json; from pip._vendor.packaging.markers import default_environment as d; "
                "print(json.dumps(d()))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    (tmp_path / "environment.json").write_text(json.dumps(environment))

    def resolve(*overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
        report = tmp_path / f"report{len(overrides)}.json"
        pip_args = ["install", "--dry-run", "--ignore-installed", "--no-index", "--find-links", str(index)]
        pip_args += ["--quiet", "--report", str(report), "toy-vllm==1.0"]
        command = [python, pin_wheels.RUNNER, str(tmp_path / "environment.json"), str(tmp_path / "edges.json")]
        proc = subprocess.run(
            [*command, *overrides, "--", *pip_args],
            env=pin_wheels.pip_environment(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        return proc, report

    refused, _ = resolve()
    assert refused.returncode != 0 and "toy-flashinfer==0.7.3" in refused.stdout + refused.stderr
    (tmp_path / "overrides.json").write_text(json.dumps({"toy-flashinfer": "0.7.4"}))
    proc, report = resolve(str(tmp_path / "overrides.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resolved = {
        item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]
    }
    assert resolved == {"toy-vllm": "1.0", "toy-flashinfer": "0.7.4", "toy-util": "1.0", "toy-cuda": "13.0"}
    edges = json.loads((tmp_path / "edges.json").read_text())
    assert edges["requires"]["toy-vllm"] == ["toy-flashinfer", "toy-util"]
    assert edges["requires"]["toy-flashinfer"] == ["toy-cuda"]


@pytest.mark.parametrize(
    "version, switch",
    [
        ("0.29.0", True),
        ("0.33.0", True),
        ("0.33.9.dev3", True),
        ("0.34.0", False),
        ("0.34.0rc1", False),
        ("0.34.1+cu130", False),
        ("0.40.0", False),
        (None, True),  # unknown: taken as the default release (0.29.0)
        ("not a version", True),
    ],
)
def test_the_v2_runner_switch_is_gone_from_0_34(version, switch):
    assert releases.has_runner_switch(version) is switch
