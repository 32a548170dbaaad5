#!/usr/bin/env bash
# What tests/nix needs besides Debian's nix-bin (tests/env/setup_system.sh installs it;
# nix-instantiate parses and evaluates the flake's pure parts) and the test venv's ShellCheck
# (tests/env/setup.sh): a small venv with a pip that knows --uploaded-prior-to (26.0+) for
# magpie/nix/pin_wheels.py --check, and the pinned wheels tests/nix/test_wheel_install.py installs
# (tests/env/fetch_wheels.py, checked against the pins' sha256).
#
# usage: tests/env/setup_nix.sh
#   NIX_TOOLS=.cache/nix-tools   the pip venv (git-ignored)
# Idempotent: a second run only checks, in well under a second.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tools=${NIX_TOOLS:-$root/.cache/nix-tools}
pip_version=26.3

# nix-bin comes from Debian, installed by tests/env/setup_system.sh.
if ! command -v nix-instantiate >/dev/null; then
  echo "error: nix-instantiate is missing; run tests/env/setup_system.sh (as root) first" >&2
  exit 1
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
"$tools/bin/python" "$root/tests/env/fetch_wheels.py" "$root/.cache/wheels" >/dev/null
echo "nix tools: $(nix-instantiate --version), pip $pip_version in $tools"
