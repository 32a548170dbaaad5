#!/usr/bin/env python3
"""Drop the allowed overlapping paths (nix/wheel-overlaps.json) from the wheels before installing.

pypa/installer, which nixpkgs' pypaInstallHook runs once per wheel into one prefix, refuses to
write a file an earlier wheel wrote (FileExistsError). nix/wheel-overlaps.json lists every
installed path that more than one pinned wheel ships (magpie/nix/pin_wheels.py --overlaps refuses
any other), and the wheels each one is dropped from. This rewrites those wheels in DIST (the
folder the hook installs from; its entries may be links into the store) without the dropped
members and without their RECORD lines, so the installed RECORD stays true; every other wheel
and every other member is left as it is, byte for byte.

    python3 magpie/nix/drop_wheel_paths.py nix/wheel-overlaps.json dist

Standard library only: nix/wheels.nix runs it with the bare interpreter in the closure's
preInstall. Also the one place that maps a wheel's archive paths to installed paths
(installed_path), which pin_wheels.py uses for its overlap check.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import zipfile

# <name>.data/<scheme>/<path> -> where installer puts it, as nixpkgs' prefix lays it out
# (purelib and platlib are both site-packages there).
DATA_SCHEMES = {"purelib": "site-packages", "platlib": "site-packages", "scripts": "bin", "data": "data"}


class DropError(Exception):
    pass


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(filename: str) -> str:
    """The canonical distribution name of a wheel file name."""
    return canonical(os.path.basename(filename).split("-", 1)[0])


def installed_path(member: str) -> str:
    """Where installer writes a wheel's archive member: site-packages/..., bin/..., data/...,
    headers/<dist>/... (headers go under the distribution's own folder)."""
    first, _, rest = member.partition("/")
    if first.endswith(".data") and rest:
        scheme, _, path = rest.partition("/")
        if scheme == "headers":
            return f"headers/{first[: -len('.data')].split('-', 1)[0]}/{path}"
        if scheme not in DATA_SCHEMES:
            raise DropError(f"{member}: unknown wheel data scheme {scheme!r}")
        return f"{DATA_SCHEMES[scheme]}/{path}"
    return f"site-packages/{member}"


def entry_point_scripts(text: str) -> list[str]:
    """bin/<name> of every console and GUI script an entry_points.txt declares (installer writes
    them beside the RECORD's files)."""
    scripts, section = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
        elif section in ("console_scripts", "gui_scripts") and "=" in line and not line.startswith(("#", ";")):
            scripts.append("bin/" + line.split("=", 1)[0].strip())
    return scripts


def drops_by_wheel(table: dict) -> dict[str, set[str]]:
    """distribution -> installed paths to drop from its wheel."""
    drops: dict[str, set[str]] = {}
    for path, entry in table["allowed"].items():
        for name in entry["drop_from"]:
            drops.setdefault(canonical(name), set()).add(path)
    return drops


def rewrite(wheel: str, dropped: set[str]) -> list[str]:
    """Replace `wheel` (a file or a link) by a copy without the members installed at `dropped`;
    return the members dropped ([] and nothing written when it has none of them)."""
    with zipfile.ZipFile(wheel) as source:
        members = source.infolist()
        gone = [info.filename for info in members if installed_path(info.filename) in dropped]
        if not gone:
            return []
        records = [info.filename for info in members if re.fullmatch(r"[^/]+\.dist-info/RECORD", info.filename)]
        if len(records) != 1:
            raise DropError(f"{wheel}: {len(records)} .dist-info/RECORD files, expected one")
        folder = os.path.dirname(os.path.abspath(wheel))
        handle, staging = tempfile.mkstemp(dir=folder, suffix=".whl")
        os.close(handle)
        try:
            with zipfile.ZipFile(staging, "w") as target:
                for info in members:
                    if info.filename in gone:
                        continue
                    data = source.read(info)
                    if info.filename == records[0]:
                        lines = data.decode().splitlines(keepends=True)
                        data = "".join(line for line in lines if line.split(",", 1)[0] not in gone).encode()
                    target.writestr(info, data, compress_type=info.compress_type)
            os.chmod(staging, 0o644)
            os.replace(staging, wheel)  # a link is replaced, its store target left alone
        except BaseException:
            os.unlink(staging)
            raise
    return gone


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: drop_wheel_paths.py OVERLAPS.json DIST", file=sys.stderr)
        return 2
    overlaps, dist = argv
    with open(overlaps) as f:
        drops = drops_by_wheel(json.load(f))
    try:
        for name in sorted(os.listdir(dist)):
            if not name.endswith(".whl") or distribution(name) not in drops:
                continue
            for member in rewrite(os.path.join(dist, name), drops[distribution(name)]):
                print(f"{name}: dropped {member} ({overlaps})")
    except DropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
