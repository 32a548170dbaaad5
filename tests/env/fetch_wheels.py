"""Download the wheels tests/nix/test_wheel_install.py installs, each checked against its sha256.

The test installs, one wheel at a time as nixpkgs' pypaInstallHook does, the pinned wheels that
nix/wheel-overlaps.json names (the ones that ship the same installed path) with the installer
release nixpkgs runs. Their sha256 is the pins' (nix/pins, per release, this machine's system);
the installer's is INSTALLER below. Files come from the package index pip is configured with
(tests/env/fetch_sdist.py finds them), never from a hard-coded host; a file already there with
the right sha256 is kept.

    python3 tests/env/fetch_wheels.py .cache/wheels        # what tests/env/setup_nix.sh fetches
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import urllib.request

if __package__ in (None, ""):  # run by path: the checkout's root makes `magpie` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from magpie import releases  # noqa: E402
from tests.env.fetch_sdist import find_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERLAPS = os.path.join(REPO, "nix", "wheel-overlaps.json")
# pypa/installer as nixpkgs' python3Packages.installer packages it (what pypaInstallHook runs).
INSTALLER = {
    "name": "installer",
    "version": "1.1.0",
    "filename": "installer-1.1.0-py3-none-any.whl",
    "sha256": "f55f5728ff61d3dd54dbc5a397cf3f7307cb64b180c20b72afbebf01c9e2c8a0",
}


def this_system() -> str:
    return {"aarch64": "aarch64-linux"}.get(platform.machine(), "x86_64-linux")


def overlapping_wheels(overlaps_path: str = OVERLAPS) -> set[str]:
    """The distributions named by any allowed overlap."""
    with open(overlaps_path) as f:
        table = json.load(f)
    return {name for entry in table["allowed"].values() for name in entry["wheels"]}


def wanted(system: str) -> list[dict]:
    """The installer and, for every release with pins, the pinned wheels of the overlaps."""
    names = overlapping_wheels()
    found = {INSTALLER["filename"]: INSTALLER}
    for release in releases.series_releases():
        path = os.path.join(REPO, releases.pins_file(release, system))
        if not os.path.exists(path):
            continue
        with open(path) as f:
            wheels = json.load(f)["wheels"]
        for name in sorted(names & set(wheels)):
            found.setdefault(wheels[name]["filename"], wheels[name])
    return list(found.values())


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(wheel: dict, dest: str) -> str:
    target = os.path.join(dest, wheel["filename"])
    if os.path.exists(target) and sha256_of(target) == wheel["sha256"]:
        return target
    os.makedirs(dest, exist_ok=True)
    url, listed = find_file(wheel["name"], wheel["filename"])
    if listed and listed != wheel["sha256"]:
        raise SystemExit(f"error: the index lists sha256 {listed} for {wheel['filename']}, pinned {wheel['sha256']}")
    print(f"fetching {wheel['filename']} ...", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=dest, delete=False) as tmp:
        with urllib.request.urlopen(url, timeout=600) as resp:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                tmp.write(chunk)
    if digest.hexdigest() != wheel["sha256"]:
        os.unlink(tmp.name)
        raise SystemExit(f"error: sha256 of {wheel['filename']} is {digest.hexdigest()}, pinned {wheel['sha256']}")
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", help="folder that receives the wheels (.cache/wheels)")
    parser.add_argument("--system", default=this_system(), help="whose pins (default: this machine's)")
    args = parser.parse_args(argv)
    for wheel in wanted(args.system):
        print(fetch(wheel, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
