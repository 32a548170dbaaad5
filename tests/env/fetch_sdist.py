"""Download a vLLM release's source distribution, verify its sha256, unpack it.

The tests patch a pristine vLLM source tree; this fetches it from the package index pip is
configured with (the PEP 691 JSON form of the simple index), never from a hard-coded host.

    python3 tests/env/fetch_sdist.py 0.29.0 .cache/sdist
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

# sha256 of each sdist we test against, as the package index lists them, with the releases'
# roles: tests/env/sdists.json, the one place they are spelled (nix/checks.nix reads it too).
SDISTS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdists.json")
with open(SDISTS_JSON) as _f:
    PINNED_SHA256 = {version: entry["sha256"] for version, entry in json.load(_f)["sdists"].items()}


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
    expected = PINNED_SHA256.get(version)
    if not expected:
        raise SystemExit(f"error: no sha256 pinned for {filename}; add it to {SDISTS_JSON}")
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
    parser.add_argument("version", help="vLLM release, e.g. 0.29.0")
    parser.add_argument("dest", help="folder that receives vllm-VERSION/")
    args = parser.parse_args(argv)
    print(fetch(args.version, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
