"""Download a vLLM release's source distribution, verify its sha256, unpack it.

The tests patch a pristine vLLM source tree; this fetches it from the package index pip is
configured with (the PEP 691 JSON form of the simple index), never from a hard-coded host. The
sha256 of each release is the release table's (magpie/releases.json `sdist`, which the flake's
checks read too); `--for-tests` fetches every release the table marks `test_sdist`.

    python3 tests/env/fetch_sdist.py 0.29.0 .cache/sdist
    python3 tests/env/fetch_sdist.py --for-tests .cache/sdist    # what tests/env/setup.sh fetches
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

if __package__ in (None, ""):  # run by path: the checkout's root makes `magpie` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from magpie import releases  # noqa: E402


def pinned_sha256(version: str) -> str:
    """The sha256 the release table pins for vllm-VERSION.tar.gz (SystemExit naming the table)."""
    try:
        return releases.sdist(version)["sha256"]
    except releases.ReleaseError as exc:
        raise SystemExit(f"error: {exc}; add the release's row (its `sdist` as the package index lists it)") from exc


def index_url() -> str:
    """The index pip would use: its configuration first, else pip's built-in default."""
    env = os.environ.get("PIP_INDEX_URL")
    if env:
        return env
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        out = ""
    if out:
        return out
    from pip._internal.models.index import PyPI  # only for its default URL

    return PyPI.simple_url


def find_file(project: str, filename: str) -> tuple[str, str]:
    base = index_url().rstrip("/") + "/"
    url = urllib.parse.urljoin(base, project + "/")
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        data = json.load(resp)
    for entry in data.get("files", []):
        if entry["filename"] == filename:
            return urllib.parse.urljoin(url, entry["url"]), entry.get("hashes", {}).get("sha256", "")
    raise SystemExit(f"error: {filename} is not listed by the package index for {project!r}")


def fetch(version: str, dest: str) -> str:
    """Return the unpacked tree `dest/vllm-VERSION`, downloading and verifying it if needed."""
    filename = f"vllm-{version}.tar.gz"
    tree = os.path.join(dest, f"vllm-{version}")
    stamp = os.path.join(dest, f".{filename}.sha256")
    expected = pinned_sha256(version)
    if os.path.isdir(tree) and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == expected:
                return tree
    os.makedirs(dest, exist_ok=True)
    url, listed = find_file("vllm", filename)
    if listed and listed != expected:
        raise SystemExit(f"error: the index lists sha256 {listed} for {filename}, expected {expected}")
    print(f"fetching {filename} ...", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=dest, delete=False) as tmp:
        with urllib.request.urlopen(url, timeout=600) as resp:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                tmp.write(chunk)
    if digest.hexdigest() != expected:
        os.unlink(tmp.name)
        raise SystemExit(f"error: sha256 of {filename} is {digest.hexdigest()}, expected {expected}")
    staging = tempfile.mkdtemp(dir=dest)
    with tarfile.open(tmp.name) as tar:
        tar.extractall(staging, filter="data")
    os.unlink(tmp.name)
    shutil.rmtree(tree, ignore_errors=True)
    os.rename(os.path.join(staging, f"vllm-{version}"), tree)
    os.rmdir(staging)
    with open(stamp, "w") as f:
        f.write(expected + "\n")
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", nargs="?", help="vLLM release, e.g. 0.29.0")
    parser.add_argument("dest", help="folder that receives vllm-VERSION/")
    parser.add_argument(
        "--for-tests", action="store_true", help="every release the table marks `test_sdist` instead of one"
    )
    args = parser.parse_args(argv)
    if args.for_tests == (args.version is not None):
        parser.error("give a VERSION or --for-tests, not both")
    for version in releases.sdists_for_tests() if args.for_tests else [args.version]:
        print(fetch(version, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
