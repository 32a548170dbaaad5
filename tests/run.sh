#!/usr/bin/env bash
# The whole test suite from a fresh machine: install what it needs (idempotent), then run it.
#
# usage: tests/run.sh [pytest args...]      e.g. tests/run.sh -k patch_tool
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

"$root/tests/env/setup_system.sh"
"$root/tests/env/setup.sh"
"$root/tests/env/setup_nix.sh"

# Lint first: it takes seconds and fails fast. The same tools as the flake's checks: ruff and
# ShellCheck at the versions tests/env/requirements.txt pins (the venv's), and nixfmt's layout
# rules (nixfmt itself is on no registry reachable here; `nix flake check` runs it).
"$root/.venv/bin/ruff" check .
"$root/.venv/bin/ruff" format --check .
mapfile -t shell_scripts < <(git ls-files '*.sh' .ci/run)
"$root/.venv/bin/shellcheck" "${shell_scripts[@]}"
mapfile -t nix_files < <(git ls-files '*.nix')
"$root/.venv/bin/python" "$root/tests/nix/nix_layout.py" "${nix_files[@]}"

# pytest exits 5 when it collected no test: that is a failure here, as any non-zero exit is.
exec "$root/.venv/bin/python" -m pytest tests -p no:cacheprovider --timeout 1800 "$@"
