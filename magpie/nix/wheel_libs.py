#!/usr/bin/env python3
"""List the shared libraries that the pinned wheels' native code needs from outside the closure.

autoPatchelf (nix/wheels.nix) rewrites every ELF file of the wheel closure to find its
libraries in the Nix store; a library no wheel provides must come from nixpkgs (buildInputs)
or, for the NVIDIA driver's own libraries, from the host at run time (ignored at build time).
This reads each wheel (a zip) of a download folder, parses the ELF dynamic sections itself
(any architecture, no binutils) and prints, as JSON, every DT_NEEDED name that no ELF file of
the closure provides (by DT_SONAME or file name), with the wheels that need it.

    pip download --no-deps --require-hashes --only-binary=:all: --platform manylinux_2_28_aarch64 \
        --python-version 3.12 -r requirements/aarch64-linux.txt -d /tmp/wheels-aarch64
    python3 magpie wheel-libs /tmp/wheels-aarch64
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zipfile

from magpie import cli

DT_NEEDED = 1
DT_SONAME = 14
SHT_DYNAMIC = 6


def elf_dynamic(data: bytes) -> tuple[list[str], str | None] | None:
    """(DT_NEEDED names, DT_SONAME) of an ELF file, or None when `data` is not a dynamic ELF."""
    if data[:4] != b"\x7fELF":
        return None
    is64 = data[4] == 2
    endian = "<" if data[5] == 1 else ">"
    if is64:
        (shoff,) = struct.unpack_from(endian + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x3A)
    else:
        (shoff,) = struct.unpack_from(endian + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x2E)

    def section(index: int) -> tuple[int, int, int, int]:
        base = shoff + index * shentsize
        if is64:
            _, sh_type, _, _, offset, size, link = struct.unpack_from(endian + "IIQQQQI", data, base)
        else:
            _, sh_type, _, _, offset, size, link = struct.unpack_from(endian + "IIIIIII", data, base)
        return sh_type, offset, size, link

    for index in range(shnum):
        sh_type, offset, size, link = section(index)
        if sh_type != SHT_DYNAMIC:
            continue
        _, str_offset, str_size, _ = section(link)
        strings = data[str_offset : str_offset + str_size]
        entry = struct.Struct(endian + ("qQ" if is64 else "iI"))
        needed, soname = [], None
        for pos in range(offset, offset + size, entry.size):
            tag, value = entry.unpack_from(data, pos)
            if tag == 0:
                break
            if tag in (DT_NEEDED, DT_SONAME):
                name = strings[value : strings.index(b"\0", value)].decode()
                if tag == DT_NEEDED:
                    needed.append(name)
                else:
                    soname = name
        return needed, soname
    return None


def scan(folder: str) -> dict:
    provided: set[str] = set()
    needs: dict[str, set[str]] = {}
    for wheel in sorted(os.listdir(folder)):
        if not wheel.endswith(".whl"):
            continue
        with zipfile.ZipFile(os.path.join(folder, wheel)) as archive:
            for info in archive.infolist():
                if info.is_dir() or ".so" not in os.path.basename(info.filename) and "/bin/" not in info.filename:
                    continue
                with archive.open(info) as member:
                    if member.read(4) != b"\x7fELF":
                        continue
                dynamic = elf_dynamic(archive.read(info))
                if dynamic is None:
                    continue
                needed, soname = dynamic
                provided.add(os.path.basename(info.filename))
                if soname:
                    provided.add(soname)
                for name in needed:
                    needs.setdefault(name, set()).add(wheel.split("-", 1)[0])
    missing = {name: sorted(wheels) for name, wheels in sorted(needs.items()) if name not in provided}
    return {"wheels": len([w for w in os.listdir(folder) if w.endswith(".whl")]), "not_in_closure": missing}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie wheel-libs", __doc__)
    parser.add_argument("folder", help="folder with the downloaded wheels of one system")
    args = parser.parse_args(argv)
    json.dump(scan(args.folder), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
