#!/usr/bin/env bash
# Serve Qwen3.8-Flash-Next (or any model) with the patched vLLM 0.29 from a named profile, after
# checking everything that would otherwise fail only after the ~10-minute weight load; a memory
# guard and a liveness watchdog watch the server it starts.
#
# usage: MODEL=/path/to/checkpoint [PROFILE=seed-gb10] magpie/serving/serve.sh LOG [extra `vllm serve` args...]
#
# Profiles (magpie/serving/profiles/NAME.yaml, `vllm serve --config` files; seed-gb10 is the default),
# each with the first words of its file and its values, read from the files as --help runs:
#   @PROFILES@
#   PROFILE=/path/x.yaml any file of that format
#
# Environment (empty = the profile's value):
#   MODEL                   required: the checkpoint folder (no path is built in)
#   VLLM_PYTHON             Python of the vLLM environment (default: the interpreter of `vllm` on PATH)
#   HOST=127.0.0.1          bind address; 0.0.0.0 exposes an unauthenticated server to the network
#   PORT=8100
#   GPU_MEM MAX_NUM_SEQS MAX_MODEL_LEN KV_CACHE_DTYPE   --gpu-memory-utilization ... --kv-cache-dtype
#   MTP                     MTP speculative tokens per step; 0 turns speculative decoding off
#   DRAFT_VOCAB_PATH=       keep-set of the pruned MTP draft head (absolute path; needs the mtp_pruning patch)
#   PLE                     1: n-gram table on disk (0.29 --hf-overrides '{"ple_mmap": true}' and
#                           0.30-0.33 --engram-config '{"offload_storage": "mmap"}' need ple_ssd;
#                           0.34+ --engram-config '{"disk_offload": true}', upstream's); 0: off
#   LANGUAGE_MODEL_ONLY     1: --language-model-only (no vision encoder); 0: off
#   SERVED_MODEL_NAME TOOL_CALL_PARSER REASONING_PARSER   a name, or `none` to drop the profile's
#   GB10_ENV=auto           allocator and JIT-job settings for a GB10: auto (a GB10, or a profile's
#                           `#: gb10-environment: true` line), 1, 0
#   JIT_JOBS=4              MAX_JOBS for FlashInfer's JIT build (ninja -j) under GB10_ENV
#   MEMGUARD=1              guard the server (memguard run, its supervisor); 0 = supervise only, no guard
#   MEMGUARD_MIN_AVAILABLE=6GiB   the guard stops the server under this MemAvailable
#   MEMGUARD_ARGS=          more memory-guard options of `memguard run` (PSI, swap, driver errors: its --help)
#   MEM_HARD_LIMIT=         cgroup v2 hard memory limit for the server, e.g. 110GiB (empty: none)
#   WATCHDOG=stop           liveness watchdog: stop (a stalled server), restart (stop, then launch again;
#                           also after an engine death), report (log only), 0 (none)
#   WATCHDOG_RESTARTS=3     at most this many restarts under WATCHDOG=restart
#   WATCHDOG_ARGS=          more `watchdog.py watch` options (--stall-after, --probe-interval, ...)
#   JIT_CHECK=auto          require ninja + nvcc for FlashInfer's JIT: auto (when an NVIDIA GPU is visible), 1, 0
#   WORKDIR=                the server's working directory (default: a new empty one, removed if still empty)
#   PID_FILE=LOG.pid        holds the server's PID (it leads its own process group); a file there that is
#                           not a stale pid file of ours is refused and left as it is
#   STOP_GRACE=30           seconds a stopping server gets after SIGTERM before its group gets SIGKILL
#   OVERWRITE=0             1 = replace an existing LOG
#
# Extra arguments go to `vllm serve` last, so they override the profile and the variables above,
# except the ones serve.sh checks (MODEL, HOST, PORT, --hf-overrides, --speculative-config,
# --engram-config): an extra argument that changes one is refused (use the variables or a profile).
# Two GB10s, tensor parallel over Ray: docs/serving.md has the recipe.
#
# serve.sh stays in the foreground until the server exits. Exit status: 0 the server stopped
# cleanly after a stop; 1 a refused start (nothing written: a bad variable, MEMGUARD_ARGS,
# WATCHDOG_ARGS, MEM_HARD_LIMIT, a PID_FILE that is not ours); 3 the memory guard stopped it; 4 the
# watchdog stopped it and no restart was left; 5 its engine died (WATCHDOG=restart starts it again,
# if it had served); 7 the watchdog died while the server ran (the server is stopped); 128 + N it
# died of signal N; else vLLM's own status. SIGINT or SIGTERM stops the server's process
# group (SIGKILL after STOP_GRACE seconds if it is still there). The top of LOG records the exact
# command, the profile, the environment, the versions and the patch status; LOG.launch.json holds
# the same as data (the run manifest).
# The logic lives in launch.py (plan, exec), supervisor.py (`memguard run`), memguard.py (the
# guard), watchdog.py and pgroup.py (the one stop sequence); this script wires them.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pkg=$(dirname "$here") # the magpie package: `python3 "$pkg" TOOL` runs one of its tools

# One entry per file of profiles/: its name, its first comment paragraph up to its first `: ` or `. `, and its
# values (`#:` settings, top-level keys, one level of nesting as key.sub) as `key=value` words.
list_profiles() {
  local file name
  for file in "$here"/profiles/*.yaml; do
    [ -f "$file" ] || continue
    name=$(basename "$file" .yaml)
    awk -v name="$name" 'BEGIN { open = 1 }
      open && /^# ./ && !/^#: / { line = $0; sub(/^# */, "", line); what = what " " line; next }
      { open = 0 }
      /^#: / { sub(/^#: */, ""); sub(/: */, "="); values = values " " $0; next }
      /^#/ || /^[ \t]*$/ { next }
      /^[^ \t]/ {
        parent = $0; sub(/:.*/, "", parent); value = $0; sub(/^[^:]*: */, "", value)
        if (value != "") values = values " " parent "=" value
        next
      }
      { line = $0; sub(/^[ \t]*/, "", line); sub(/: */, "=", line); values = values " " parent "." line }
      END {
        sub(/^ *[^ :]*: */, "", what); sub(/(: |\. ).*/, "", what)
        printf "  %-20s %s\n", name, what
        n = split(substr(values, 2), words, " "); line = ""
        for (i = 1; i <= n; i++) {
          if (length(line) + length(words[i]) > 72) { print "                         " line; line = "" }
          line = line (line == "" ? "" : " ") words[i]
        }
        if (line != "") print "                         " line
      }' "$file"
  done
}

usage() {
  local line
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' | while IFS= read -r line; do
    if [ "$line" = "  @PROFILES@" ]; then list_profiles; else printf '%s\n' "$line"; fi
  done
}

die() {
  echo "serve.sh: refusing to start: $*" >&2
  exit 1
}

if [ $# -lt 1 ]; then
  usage >&2
  exit 2
fi
case "$1" in
  -h | --help)
    usage
    exit 0
    ;;
esac
log=$1
shift

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8100}
MEMGUARD=${MEMGUARD:-1}
MEMGUARD_MIN_AVAILABLE=${MEMGUARD_MIN_AVAILABLE:-6GiB}
MEMGUARD_ARGS=${MEMGUARD_ARGS:-}
MEM_HARD_LIMIT=${MEM_HARD_LIMIT:-}
WATCHDOG=${WATCHDOG:-stop}
WATCHDOG_RESTARTS=${WATCHDOG_RESTARTS:-3}
WATCHDOG_ARGS=${WATCHDOG_ARGS:-}
PID_FILE=${PID_FILE:-$log.pid}
STOP_GRACE=${STOP_GRACE:-30}

if ! [[ $PORT =~ ^[0-9]{1,5}$ ]] || ((10#$PORT < 1 || 10#$PORT > 65535)); then
  die "PORT=$PORT: expected a port number from 1 to 65535"
fi
[[ $MEMGUARD =~ ^[01]$ ]] || die "MEMGUARD=$MEMGUARD: expected 1 or 0"
[[ $WATCHDOG =~ ^(stop|restart|report|0)$ ]] || die "WATCHDOG=$WATCHDOG: expected stop, restart, report or 0"
[[ $WATCHDOG_RESTARTS =~ ^[0-9]+$ ]] || die "WATCHDOG_RESTARTS=$WATCHDOG_RESTARTS: expected a number"
if ! [[ $STOP_GRACE =~ ^[0-9]{1,5}$ ]] || ((10#$STOP_GRACE > 86400)); then
  die "STOP_GRACE=$STOP_GRACE: expected a whole number of seconds from 0 to 86400"
fi
read -r -a memguard_args <<<"$MEMGUARD_ARGS"

# ---- the vLLM environment
if [ -n "${VLLM_PYTHON:-}" ]; then
  python=$VLLM_PYTHON
else
  vllm_bin=$(command -v vllm) || die "VLLM_PYTHON is not set and there is no vllm on PATH"
  read -r shebang <"$vllm_bin"
  python=${shebang#\#!}
  [[ $python == */python* ]] || die "cannot tell the Python of $vllm_bin (first line: $shebang); set VLLM_PYTHON"
fi
[ -x "$python" ] || die "VLLM_PYTHON=$python is not an executable"
# As activating the environment would: FlashInfer's JIT finds the environment's ninja on PATH.
PATH="$(dirname "$python"):$PATH"
if ! command -v nvcc >/dev/null && [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
  PATH="$CUDA_HOME/bin:$PATH"
fi
export PATH

# ---- supervision: memguard run starts the server in its own session (its PID leads the group vLLM
# forks into), writes PID_FILE, guards it (MEMGUARD=0: --no-guard, the same path), starts the
# watchdog on it, restarts it under WATCHDOG=restart, and stops its group on SIGTERM (SIGKILL
# after STOP_GRACE). Its options (MEMGUARD_ARGS, WATCHDOG_ARGS) and PID_FILE are checked first
# (by `launch plan`, as `memguard run --check` would), before anything is written: a PID_FILE that
# is not one of ours (a file of yours, a PID now of another process) is refused and left as it is.
sup=(--pid-file "$PID_FILE" --output "$log" --log "$log" --grace "$STOP_GRACE")
if [ "$MEMGUARD" = 1 ]; then
  sup+=(--min-available "$MEMGUARD_MIN_AVAILABLE" --server-log "$log" "${memguard_args[@]}")
else
  sup+=(--no-guard)
fi
if [ "$WATCHDOG" != 0 ]; then
  sup+=(--watchdog "$WATCHDOG" --watchdog-url "http://$HOST:$PORT" --restarts "$WATCHDOG_RESTARTS")
  sup+=("--watchdog-args=$WATCHDOG_ARGS")
fi
sup_checks=()
for option in "${sup[@]}"; do
  sup_checks+=("--supervisor-option=$option")
done

# ---- the supervisor's options, profile, overrides, checks, log header, launch plan (exit 1 with the
# reason on a refusal). One Python process, all checks in it (`memguard run --check`'s too);
# LOG.launch.json is both the plan `launch exec` runs and the run manifest
# (magpie/serving/manifest.py) that log_check and report read.
workdir=$("$python" "$pkg" launch plan --log "$log" --host "$HOST" --port "$PORT" --python "$python" \
  --mem-hard-limit "$MEM_HARD_LIMIT" --workdir "${WORKDIR:-}" "${sup_checks[@]}" -- "$@") || exit 1
plan="$log.launch.json"

echo "serve.sh: serving on http://$HOST:$PORT, log $log, PID file $PID_FILE" >&2
supervisor_pid=
# shellcheck disable=SC2317,SC2329  # called by the trap only
stop_server() {
  [ -z "$supervisor_pid" ] || kill -TERM "$supervisor_pid" 2>/dev/null || true
}
trap stop_server INT TERM
"$python" "$pkg" memguard run "${sup[@]}" -- "$python" "$pkg" launch exec "$plan" &
supervisor_pid=$!
status=0
wait "$supervisor_pid" || status=$?
while kill -0 "$supervisor_pid" 2>/dev/null; do # a signal interrupted `wait`; the server is stopping
  status=0
  wait "$supervisor_pid" || status=$?
done
# The working directory serve.sh made for the server, if the server left nothing in it.
[ -n "${WORKDIR:-}" ] || rmdir "$workdir" 2>/dev/null || true
exit "$status"
