"""The vLLM releases this project knows: one table (magpie/releases.json), read here for Python.

Everything release-specific derives from that table: which releases have a patch series
(patches/vllm-<release>/), their wheel pins (magpie/nix/pin_wheels.py), their Nix outputs and
suffixes (nix/lib.nix reads the same JSON), the sdists the tests patch (tests/env), the GPU
harness's wheel, and how the serving launcher spells the n-gram-table switch for a release.
Adding a release is the rebased series plus one row (docs/vllm-releases.md, "Adding a release").

Standard library only; `MAGPIE_RELEASES` may name another table (the tests use a copy with a
fake release to see every consumer pick it up).
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "PLE_SWITCHES",
    "ReleaseError",
    "default",
    "load",
    "nix_suffix",
    "ple_switch",
    "release_of",
    "row",
    "sdist",
    "series_releases",
    "sdists_for_tests",
]

TABLE = Path(__file__).resolve().with_name("releases.json")
PLE_SWITCHES = ("hf-overrides", "engram-config")
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


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
        if entry.get("series") and not isinstance(entry.get("pins"), dict):
            raise ReleaseError(f"{where}: a release with a series needs `pins` (extra_requirements, uploaded_prior_to)")
        if not entry.get("series") and not entry.get("role"):
            raise ReleaseError(f"{where}: a release without a series says why it is pinned (`role`)")
    if releases.get(data.get("default"), {}).get("series") is not True:
        raise ReleaseError(f"{path}: `default` must name a release with a series")
    return data


def load() -> dict[str, Any]:
    """The whole table (checked)."""
    return _load(str(table_path()))


def default() -> str:
    """The default release: the flake's unsuffixed outputs, the test environment's CPU build."""
    return load()["default"]


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(n) for n in release.split("."))


def series_releases() -> list[str]:
    """The releases with a patch series, oldest first."""
    return sorted((r for r, e in load()["releases"].items() if e.get("series")), key=_key)


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


def release_of(version: str | None) -> str | None:
    """The release a version string belongs to: "0.29.0+cpu" -> "0.29.0", "0.33.0rc1" -> "0.33.0",
    "0.33.1.dev3" -> "0.33.1"; None when it is not MAJOR.MINOR.PATCH at all."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", (version or "").strip())
    return ".".join(m.groups()) if m else None


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


def nix_suffix(release: str) -> str:
    """The suffix of a release's Nix outputs, as nix/lib.nix's releaseSuffix writes it: "" for the
    default, "_0_33" for 0.33.0 (nixpkgs' `nodejs_22` style)."""
    if release == default():
        return ""
    major, minor, _ = release.split(".")
    return f"_{major}_{minor}"
