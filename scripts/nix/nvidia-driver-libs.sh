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
#   NVIDIA_DRIVER_FARM=...      where the links go
#                               (default: ${XDG_CACHE_HOME:-$HOME/.cache}/magpie-vllm-plugins/nvidia-driver)
# Searched, in order: /run/opengl-driver/lib (NixOS), /usr/lib/$(uname -m)-linux-gnu (Debian,
# Ubuntu, DGX OS), /usr/lib64 (Fedora, RHEL), /usr/lib.
# Exit status: 0 and the folder on stdout; 1 and the places searched on stderr when no
# libcuda.so.1 is found.
set -euo pipefail

root=${NVIDIA_DRIVER_ROOT:-}
root=${root%/}
farm=${NVIDIA_DRIVER_FARM:-${XDG_CACHE_HOME:-$HOME/.cache}/magpie-vllm-plugins/nvidia-driver}

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

mkdir -p "$farm"
# Rebuild the links each time: the driver may have been upgraded since the last run.
find "$farm" -mindepth 1 -maxdepth 1 -type l -delete
count=0
for lib in "$driver_dir"/libcuda.so* "$driver_dir"/libcudadebugger.so* "$driver_dir"/libnvidia-*.so* \
  "$driver_dir"/libnvcuvid.so*; do
  [ -e "$lib" ] || continue
  ln -s "$lib" "$farm/$(basename "$lib")"
  count=$((count + 1))
done
# Linkers (FlashInfer's -lcuda, Triton's launchers) look for the unversioned name.
if [ ! -e "$farm/libcuda.so" ]; then
  ln -s "$driver_dir/libcuda.so.1" "$farm/libcuda.so"
fi
echo "nvidia-driver-libs: $count driver libraries of $driver_dir linked in $farm" >&2
echo "$farm"
