#!/usr/bin/env bash
# The whole test suite from a fresh machine: install what it needs (idempotent), then run it.
#
# usage: tests/run.sh [pytest args...]      e.g. tests/run.sh -k patch_tool
#        tests/run.sh -m "not slow"          the fast inner loop: no vLLM server start, no vLLM subprocess
#                                            import (the `slow` marker, pyproject.toml); CI runs everything
#        tests/run.sh -n 0                   one worker (the default is two, below)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

"$root/tests/env/setup_system.sh"
"$root/tests/env/setup.sh"
"$root/tests/env/setup_nix.sh"

# Lint first: it takes seconds and fails fast. tests/lint.sh says which files each linter sees
# (the flake's checks run the same script): ruff and ShellCheck at the versions
# tests/env/requirements.txt pins (the venv's), ruff over the Python the patches ship (with the
# ruff settings of the vLLM release each series is for), and nixfmt (the 1.4.0 beside the
# checkout, ../shared/tools/nixfmt; the part says so when it is not there).
"$root/tests/lint.sh"

# pytest exits 5 when it collected no test: that is a failure here, as any non-zero exit is.
# --durations: the 30 slowest tests close the report, so CI's log shows where the time goes.
# -n 2 --dist loadfile: two pytest-xdist workers, each taking whole test files (a file's module
# fixtures and servers stay in one process). Much of the suite waits (server starts, signals,
# timeouts, the package registry) rather than computes, so a second worker fills that time even
# on two cores; each worker has its own session pool of servers. --no-loadscope-reorder: the files
# go out in collection order, the longest first (tests/conftest.py, LONGEST_FIRST). A later -n in
# "$@" wins.
exec "$root/.venv/bin/python" -m pytest tests -p no:cacheprovider --timeout 1800 --durations=30 \
  -n 2 --dist loadfile --no-loadscope-reorder "$@"
