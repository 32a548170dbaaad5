#!/usr/bin/env bash
# Find the host's NVIDIA driver and print a folder that holds only the driver's libraries.
#
# Nix-built programs search the store and /run/opengl-driver/lib (NixOS), never the host's
# ld.so cache, so on DGX OS (Ubuntu) they cannot see /usr/lib/aarch64-linux-gnu/libcuda.so.1.
# Putting that whole folder on LD_LIBRARY_PATH would also hand them the host's libc, libstdc++
# and everything else there. This links only the driver's own files (libcuda*, libnvidia-*)
# into a private folder and prints it; the apps put that folder on LD_LIBRARY_PATH.
#
# usage: nvidia-driver-libs.sh
#   NVIDIA_DRIVER_LIB_DIR=DIR   use this folder (must hold libcuda.so.1); no search
#   NVIDIA_DRIVER_ROOT=/        prefix of every searched folder (tests use fake trees)
#   NVIDIA_DRIVER_FARM=...      where the links go (default: one folder per driver under
#                               ${XDG_CACHE_HOME:-$HOME/.cache}/magpie-vllm-plugins/nvidia-driver/,
#                               named by a hash of the driver folder and its libcuda.so.1)
# Searched, in order: /run/opengl-driver/lib (NixOS), /usr/lib/$(uname -m)-linux-gnu (Debian,
# Ubuntu, DGX OS), /usr/lib64 (Fedora, RHEL), /usr/lib.
# Exit status: 0 and the folder on stdout; 1 and the places searched on stderr when no
# libcuda.so.1 is found.
set -euo pipefail

root=${NVIDIA_DRIVER_ROOT:-}
root=${root%/}

if [ -n "${NVIDIA_DRIVER_LIB_DIR:-}" ]; then
  candidates=("$NVIDIA_DRIVER_LIB_DIR")
else
  candidates=(
    "$root/run/opengl-driver/lib"
    "$root/usr/lib/$(uname -m)-linux-gnu"
    "$root/usr/lib64"
    "$root/usr/lib"
  )
fi

driver_dir=
for dir in "${candidates[@]}"; do
  # -e follows the link: a dangling libcuda.so.1 (driver removed) does not count.
  if [ -e "$dir/libcuda.so.1" ]; then
    driver_dir=$dir
    break
  fi
done

if [ -z "$driver_dir" ]; then
  {
    echo "error: no NVIDIA driver library (libcuda.so.1) found; searched:"
    printf '  %s\n' "${candidates[@]}"
    echo "Install the NVIDIA driver, or set NVIDIA_DRIVER_LIB_DIR to the folder that holds libcuda.so.1."
  } >&2
  exit 1
fi

# One folder per driver (folder and libcuda.so.1 target): an upgrade or another host sharing
# the home directory gets its own, and a finished folder is never changed again.
libcuda=$(readlink -f "$driver_dir/libcuda.so.1")
key=$(printf '%s\n%s\n' "$(readlink -f "$driver_dir")" "$libcuda" | sha256sum | cut -c1-16)
farm=${NVIDIA_DRIVER_FARM:-${XDG_CACHE_HOME:-$HOME/.cache}/magpie-vllm-plugins/nvidia-driver/$key}

if [ "$(readlink -f "$farm/libcuda.so.1" 2>/dev/null)" = "$libcuda" ] && [ -e "$farm/libcuda.so" ]; then
  echo "nvidia-driver-libs: driver libraries of $driver_dir already linked in $farm" >&2
  echo "$farm"
  exit 0
fi

# Built beside the target and renamed into place, so concurrent launches never see a half-made
# folder: the first rename wins, a later one finds the folder complete.
parent=$(dirname "$farm")
mkdir -p "$parent"
staging=$(mktemp -d "$parent/.nvidia-driver.XXXXXX")
trap 'rm -rf "$staging"' EXIT
count=0
for lib in "$driver_dir"/libcuda.so* "$driver_dir"/libcudadebugger.so* "$driver_dir"/libnvidia-*.so* \
  "$driver_dir"/libnvcuvid.so*; do
  [ -e "$lib" ] || continue
  ln -s "$lib" "$staging/$(basename "$lib")"
  count=$((count + 1))
done
# Linkers (FlashInfer's -lcuda, Triton's launchers) look for the unversioned name.
if [ ! -e "$staging/libcuda.so" ]; then
  ln -s "$driver_dir/libcuda.so.1" "$staging/libcuda.so"
fi
if ! mv -T "$staging" "$farm" 2>/dev/null; then
  if [ "$(readlink -f "$farm/libcuda.so.1" 2>/dev/null)" != "$libcuda" ]; then
    # An explicit NVIDIA_DRIVER_FARM that holds another driver's links: replace it.
    old=$(mktemp -d "$parent/.nvidia-driver-old.XXXXXX")
    mv -T "$farm" "$old/farm"
    mv -T "$staging" "$farm"
    rm -rf "$old"
  fi
fi
echo "nvidia-driver-libs: $count driver libraries of $driver_dir linked in $farm" >&2
echo "$farm"
