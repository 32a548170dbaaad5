"""The vLLM releases this project knows: one table (magpie/releases.json), read here for Python.

Everything release-specific derives from that table: which releases have a patch series
(patches/vllm-<release>/), their wheel pins (magpie/nix/pin_wheels.py), their Nix outputs and
suffixes (nix/lib.nix reads the same JSON), the sdists the tests patch (tests/env), the GPU
harness's wheel, and how the serving launcher spells the n-gram-table switch for a release.
Adding a release is the rebased series plus one row (docs/vllm-releases.md, "Adding a release").

Standard library only; `MAGPIE_RELEASES` may name another table for the Python readers (the
tests use a copy with a fake release to see every consumer pick it up). nix/lib.nix reads the
magpie/releases.json of the checkout it is evaluated in.

Each fact has one definition. `release_of` (a version's MAJOR.MINOR.PATCH) and `key` (a release
as a sortable tuple) are magpie/patches.py's, imported here: the patch tool must run copied on
its own, so it cannot import this module, and this module can import it. Which releases have a
series is the table's `series: true`; the patch tool, which has no table when copied on its own,
finds the `vllm-<release>/series` folders instead, so loading the table checks that the two
agree (the folders beside the table: patches/ in a checkout, magpie/patch_series/ installed) and
names the row or the folder to fix when they do not.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

from magpie.patches import SERIES_PREFIX, available_series, release_key, release_of

__all__ = [
    "PLE_SWITCHES",
    "ReleaseError",
    "default",
    "gpu_harness_release",
    "has_runner_switch",
    "key",
    "load",
    "nix_suffix",
    "other_series_releases",
    "pins_file",
    "pins_folder",
    "ple_switch",
    "release_of",
    "requirements_file",
    "row",
    "sdist",
    "series_releases",
    "sdists_for_tests",
    "series_root",
    "table_path",
]

TABLE = Path(__file__).resolve().with_name("releases.json")
# hf-overrides: 0.29's ple_ssd patch; engram-config: 0.30-0.33's (our Engram storage mode);
# engram-disk-offload: 0.34+'s upstream EngramConfig.disk_offload.
PLE_SWITCHES = ("hf-overrides", "engram-config", "engram-disk-offload")
# vLLM 0.34.0 removed the V1 model runner and the VLLM_USE_V2_MODEL_RUNNER switch with it (=1
# warns, any other value raises): from it on, nothing may set the variable.
V2_ONLY_FROM = "0.34.0"
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
_MOMENT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


class ReleaseError(ValueError):
    """The table is malformed, or a release is not in it."""


def table_path() -> Path:
    return Path(os.environ.get("MAGPIE_RELEASES") or TABLE)


@cache
def _load(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ReleaseError(f"{path}: cannot read the release table: {exc}") from exc
    releases = data.get("releases")
    if not isinstance(releases, dict) or not releases:
        raise ReleaseError(f"{path}: `releases` must be a non-empty object (release -> row)")
    for release, entry in releases.items():
        where = f"{path}: releases.{release}"
        if not _VERSION.match(release):
            raise ReleaseError(f"{where}: a release is MAJOR.MINOR.PATCH (e.g. 0.34.0)")
        if entry.get("ple_switch") not in PLE_SWITCHES:
            raise ReleaseError(f"{where}.ple_switch must be one of {', '.join(PLE_SWITCHES)}")
        sd = entry.get("sdist")
        if not isinstance(sd, dict) or not {"filename", "sha256", "path"} <= set(sd):
            raise ReleaseError(f"{where}.sdist needs filename, sha256 and path (as the package index lists them)")
        if sd["filename"] != f"vllm-{release}.tar.gz" or not sd["path"].endswith("/" + sd["filename"]):
            raise ReleaseError(f"{where}.sdist: filename must be vllm-{release}.tar.gz and path end in it")
        if not re.fullmatch(r"[0-9a-f]{64}", str(sd["sha256"])):
            raise ReleaseError(f"{where}.sdist.sha256 must be 64 lowercase hex digits")
        if entry.get("series"):
            pins = entry.get("pins")
            if not isinstance(pins, dict) or not isinstance(pins.get("extra_requirements"), list):
                raise ReleaseError(f"{where}: a release with a series needs `pins.extra_requirements` (a list)")
            overrides = pins.get("overrides", {})
            if not isinstance(overrides, dict) or not all(
                isinstance(v, str) and re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", v) for v in overrides.values()
            ):
                raise ReleaseError(
                    f"{where}.pins.overrides must map a package name to the one version it resolves to "
                    '(e.g. {"flashinfer-python": "0.7.4"})'
                )
            if not _MOMENT.match(str(pins.get("uploaded_prior_to"))):
                raise ReleaseError(
                    f"{where}.pins.uploaded_prior_to must be a UTC moment YYYY-MM-DDTHH:MM:SSZ after the release's date"
                )
        elif entry.get("gpu_harness"):
            raise ReleaseError(f"{where}: `gpu_harness` needs a release with a series (the harness applies it)")
        if not entry.get("series") and not entry.get("role"):
            raise ReleaseError(f"{where}: a release without a series says why it is pinned (`role`)")
    if releases.get(data.get("default"), {}).get("series") is not True:
        raise ReleaseError(f"{path}: `default` must name a release with a series")
    _check_series_folders(Path(path), releases)
    harness = [r for r, e in releases.items() if e.get("gpu_harness")]
    if len(harness) != 1:
        raise ReleaseError(
            f"{path}: exactly one release has `gpu_harness: true` (the GPU harness's default), not {len(harness)}"
        )
    return data


def series_root(table: Path) -> Path | None:
    """The folder of the series folders beside a table: magpie/patch_series/ in the installed
    package, patches/ in a checkout (the table at magpie/releases.json); None when there is none."""
    for root in (table.parent / "patch_series", table.parent.parent / "patches"):
        if table.parent.name == "magpie" and root.is_dir():
            return root
    return None


def _check_series_folders(table: Path, releases: dict[str, Any]) -> None:
    """The rows with `series: true` are the series folders beside the table (if there are any)."""
    root = series_root(table)
    if root is None:
        return
    folders = available_series(str(root))
    for release, entry in releases.items():
        if entry.get("series") and release not in folders:
            raise ReleaseError(
                f"{table}: releases.{release} has `series: true` but {root}/{SERIES_PREFIX}{release}/series "
                "does not exist; add the series (patches/README.md, rebase) or drop `series`"
            )
    for release, folder in folders.items():
        if not releases.get(release, {}).get("series"):
            raise ReleaseError(
                f"{folder}: a series folder without a `series: true` row in {table}; add the row "
                "(docs/vllm-releases.md, Adding a release) or remove the folder"
            )


def load() -> dict[str, Any]:
    """The whole table (checked)."""
    return _load(str(table_path()))


def default() -> str:
    """The default release: the flake's unsuffixed outputs, the test environment's CPU build."""
    return load()["default"]


key = release_key  # a MAJOR.MINOR.PATCH release as a tuple that sorts as the releases do
_key = release_key


def series_releases() -> list[str]:
    """The releases with a patch series, oldest first."""
    return sorted((r for r, e in load()["releases"].items() if e.get("series")), key=_key)


def other_series_releases() -> list[str]:
    """The releases with a series other than the default, oldest first: the flake's suffixed
    outputs (nix/lib.nix otherVllmReleases reads the same rows)."""
    return [r for r in series_releases() if r != default()]


def gpu_harness_release() -> str:
    """The release the GPU harness carries unless told otherwise (the row with `gpu_harness`)."""
    return next(r for r, e in load()["releases"].items() if e.get("gpu_harness"))


def sdists_for_tests() -> list[str]:
    """The releases whose sdists tests/env/setup.sh fetches for the tests, oldest first."""
    return sorted((r for r, e in load()["releases"].items() if e.get("test_sdist")), key=_key)


def row(release: str) -> dict[str, Any]:
    """The table's row of `release` (ReleaseError naming the known ones if it has none)."""
    releases = load()["releases"]
    if release not in releases:
        raise ReleaseError(f"vLLM {release} is not in {table_path()}; known: {', '.join(sorted(releases, key=_key))}")
    return releases[release]


def sdist(release: str) -> dict[str, str]:
    return row(release)["sdist"]


def ple_switch(version: str | None) -> str:
    """How PLE=1 (the n-gram table on disk) is spelled for a vLLM version: the row of its release,
    or of the newest known release before it (a 0.33.1 is spelled as 0.33.0 is); the default
    release's spelling when the version is unknown or older than every row."""
    release = release_of(version)
    releases = load()["releases"]
    if release is not None:
        earlier = [r for r in releases if _key(r) <= _key(release)]
        if earlier:
            return releases[max(earlier, key=_key)]["ple_switch"]
    return releases[default()]["ple_switch"]


def has_runner_switch(version: str | None) -> bool:
    """Whether a vLLM version still reads VLLM_USE_V2_MODEL_RUNNER (before 0.34.0: V1 is its
    default); an unknown version is taken to be the default release."""
    release = release_of(version) or default()
    return _key(release) < _key(V2_ONLY_FROM)


def nix_suffix(release: str) -> str:
    """The suffix of a release's Nix outputs, as nix/lib.nix's releaseSuffix writes it: "" for the
    default, "_0_33" for 0.33.0 (nixpkgs' `nodejs_22` style)."""
    if release == default():
        return ""
    major, minor, _ = release.split(".")
    return f"_{major}_{minor}"


def pins_folder(release: str) -> str:
    """The folder of a release's pins under nix/pins and requirements: "" for the default (its
    files sit at the top), "vllm-<release>" for the others (nix/lib.nix pinsFile: the same)."""
    return "" if release == default() else f"vllm-{release}"


def pins_file(release: str, system: str) -> str:
    """nix/pins/<system>.json (the default release) or nix/pins/vllm-<release>/<system>.json,
    relative to the checkout's root."""
    return "/".join(filter(None, ["nix", "pins", pins_folder(release), f"{system}.json"]))


def requirements_file(release: str, system: str) -> str:
    """requirements/<system>.txt (the default release) or requirements/vllm-<release>/<system>.txt,
    relative to the checkout's root."""
    return "/".join(filter(None, ["requirements", pins_folder(release), f"{system}.txt"]))
