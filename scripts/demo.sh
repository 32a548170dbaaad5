#!/usr/bin/env bash
# The whole Flash-Next workflow, end to end, on a tiny local MTP model on this machine's CPU.
#
# usage: scripts/demo.sh
#
# Sets up the pinned test environment (tests/env/setup.sh) and reports the state of the
# patch series against it. The serve/bench/prune/GSM8K steps are added as their tools land.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tests/env/setup.sh"
python="${VENV:-$root/.venv}/bin/python"
"$python" "$root/scripts/patches.py" status --python "$python"
