#!/usr/bin/env bash
# What tests/nix needs: Debian's nix-bin (nix-instantiate parses and evaluates the flake's pure
# parts; nixpkgs itself cannot be fetched here), shellcheck, and a small venv with a pip that
# knows --uploaded-prior-to (26.0+) for scripts/nix/pin_wheels.py --check.
#
# usage: tests/env/setup_nix.sh
#   NIX_TOOLS=.cache/nix-tools   the pip venv (git-ignored)
# Idempotent: a second run only checks, in well under a second.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tools=${NIX_TOOLS:-$root/.cache/nix-tools}
pip_version=26.3

missing=()
command -v nix-instantiate >/dev/null || missing+=(nix-bin)
command -v shellcheck >/dev/null || missing+=(shellcheck)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: missing Debian packages ${missing[*]}; as root: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  start=$(date +%s)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "nix tools: installed ${missing[*]} in $(($(date +%s) - start)) s"
fi

if [ "$("$tools/bin/python" -m pip --version 2>/dev/null | cut -d' ' -f2)" != "$pip_version" ]; then
  start=$(date +%s)
  rm -rf "$tools"
  python3 -m venv "$tools"
  # This machine's pip configuration adds local find-links and constraints: not wanted here.
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$pip_version"
  echo "nix tools: pip $pip_version in $tools ($(($(date +%s) - start)) s)"
fi
echo "nix tools: $(nix-instantiate --version), pip $pip_version in $tools"
