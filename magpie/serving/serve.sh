#!/usr/bin/env bash
# Serve Qwen3.8-Flash-Next (or any model) with the patched vLLM 0.29 from a named profile, after
# checking everything that would otherwise fail only after the ~10-minute weight load; a memory
# guard and a liveness watchdog watch the server it starts.
#
# usage: MODEL=/path/to/checkpoint [PROFILE=seed-gb10] magpie/serving/serve.sh LOG [extra `vllm serve` args...]
#
# Profiles (magpie/serving/profiles/NAME.yaml, `vllm serve --config` files):
#   seed-gb10 (default)  the measured GB10 configuration: GPU_MEM=0.76 MAX_NUM_SEQS=4 MAX_MODEL_LEN=65536
#                        MTP=3 PLE=1 LANGUAGE_MODEL_ONLY=1, no parsers
#   gb10-community       FP8 KV cache, 262,144 context, 8 sequences, MTP=3, no FlashInfer autotune,
#                        qwen3_xml tool calls, qwen3 reasoning, served as qwen3.8-flash-next
#   hopper               one H200: GPU_MEM=0.9, 16 sequences, FP8 KV, 262,144 context, parsers
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
#   PLE                     1: n-gram table on disk (--hf-overrides '{"ple_mmap": true}', needs ple_ssd); 0: off
#   LANGUAGE_MODEL_ONLY     1: --language-model-only (no vision encoder); 0: off
#   SERVED_MODEL_NAME TOOL_CALL_PARSER REASONING_PARSER   a name, or `none` to drop the profile's
#   GB10_ENV=auto           allocator and JIT-job settings for a GB10: auto (a GB10 or a gb10 profile), 1, 0
#   JIT_JOBS=4              MAX_JOBS for FlashInfer's JIT build (ninja -j) under GB10_ENV
#   MEMGUARD=1              run memguard.py watch on the server; 0 = no guard
#   MEMGUARD_MIN_AVAILABLE=6GiB   the guard stops the server under this MemAvailable
#   MEMGUARD_ARGS=          more `memguard.py watch` options (PSI, swap, driver errors: see its --help)
#   MEM_HARD_LIMIT=         cgroup v2 hard memory limit for the server, e.g. 110GiB (empty: none)
#   WATCHDOG=stop           liveness watchdog: stop (a stalled server), restart (stop, then launch again),
#                           report (log only), 0 (none)
#   WATCHDOG_RESTARTS=3     at most this many restarts under WATCHDOG=restart
#   WATCHDOG_ARGS=          more `watchdog.py watch` options (--stall-after, --probe-interval, ...)
#   JIT_CHECK=auto          require ninja + nvcc for FlashInfer's JIT: auto (when an NVIDIA GPU is visible), 1, 0
#   WORKDIR=                the server's working directory (default: a new empty one, removed if still empty)
#   PID_FILE=LOG.pid        holds the server's PID (it leads its own process group)
#   STOP_GRACE=30           seconds a stopping server gets after SIGTERM before its group gets SIGKILL
#   OVERWRITE=0             1 = replace an existing LOG
#
# Extra arguments go to `vllm serve` last, so they override the profile and the variables above.
# Two GB10s, tensor parallel over Ray: docs/serving.md has the recipe.
#
# serve.sh stays in the foreground until the server exits and returns its exit status; SIGINT or
# SIGTERM stops the server's process group (SIGKILL after STOP_GRACE seconds if it is still there). The top of LOG records the exact command, the profile,
# the environment, the versions and the patch status; LOG.launch.json holds the same as data (the run manifest).
# The logic lives in launch.py (plan, exec), memguard.py and watchdog.py; this script wires them.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pkg=$(dirname "$here") # the magpie package: `python3 "$pkg" TOOL` runs one of its tools

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
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

[[ $PORT =~ ^[0-9]+$ ]] || die "PORT=$PORT: expected a port number"
[[ $MEMGUARD =~ ^[01]$ ]] || die "MEMGUARD=$MEMGUARD: expected 1 or 0"
[[ $WATCHDOG =~ ^(stop|restart|report|0)$ ]] || die "WATCHDOG=$WATCHDOG: expected stop, restart, report or 0"
[[ $WATCHDOG_RESTARTS =~ ^[0-9]+$ ]] || die "WATCHDOG_RESTARTS=$WATCHDOG_RESTARTS: expected a number"
[[ $STOP_GRACE =~ ^[0-9]+$ ]] || die "STOP_GRACE=$STOP_GRACE: expected a number of seconds"
read -r -a memguard_args <<<"$MEMGUARD_ARGS"
read -r -a watchdog_args <<<"$WATCHDOG_ARGS"

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

if [ -f "$PID_FILE" ] && old_pid=$(cat "$PID_FILE") && [ -n "$old_pid" ] && kill -0 "$old_pid" 2>/dev/null; then
  die "$PID_FILE says a server runs as PID $old_pid; stop it first (kill -TERM -- -$old_pid) or choose another PID_FILE"
fi

# ---- profile, overrides, checks, log header, launch plan (exit 1 with the reason on a refusal)
# One Python process, all checks in it; LOG.launch.json is both the plan `launch exec` runs and the
# run manifest (magpie/serving/manifest.py) that log_check and report read.
workdir=$("$python" "$pkg" launch plan --log "$log" --host "$HOST" --port "$PORT" --python "$python" \
  --mem-hard-limit "$MEM_HARD_LIMIT" --workdir "${WORKDIR:-}" -- "$@") || exit 1
plan="$log.launch.json"

server_pid=
killer_pid=
# shellcheck disable=SC2317,SC2329  # called by the trap only
stop_server() {
  WATCHDOG_RESTARTS=0
  [ -n "$server_pid" ] || return 0
  kill -TERM -- "-$server_pid" 2>/dev/null || return 0
  # vLLM can hang in its own shutdown (seen when a stop came while the engine was starting):
  # a stop must end, so the group gets SIGKILL once the grace time has passed.
  if [ -z "$killer_pid" ]; then
    (
      sleep "$STOP_GRACE"
      if kill -0 -- "-$server_pid" 2>/dev/null; then
        echo "# serve.sh: the server was still running ${STOP_GRACE} s after SIGTERM; SIGKILL to its group, $(date -Is)" >>"$log"
        kill -KILL -- "-$server_pid" 2>/dev/null || true
      fi
    ) &
    killer_pid=$!
  fi
  return 0
}
trap stop_server INT TERM

restarts=0
while :; do
  # Its own session and process group: the guard and a stop reach the engine core and its workers.
  setsid "$python" "$pkg" launch exec "$plan" >>"$log" 2>&1 </dev/null &
  server_pid=$!
  echo "$server_pid" >"$PID_FILE"
  echo "serve.sh: server PID $server_pid on http://$HOST:$PORT, log $log, PID file $PID_FILE" >&2

  guard_pid=
  if [ "$MEMGUARD" = 1 ]; then
    "$python" "$pkg" memguard watch --pid "$server_pid" --min-available "$MEMGUARD_MIN_AVAILABLE" --log "$log" \
      --server-log "$log" "${memguard_args[@]}" &
    guard_pid=$!
  fi
  watchdog_pid=
  if [ "$WATCHDOG" != 0 ]; then
    policy=$WATCHDOG
    [ "$policy" = restart ] && policy=stop
    "$python" "$pkg" watchdog watch --pid "$server_pid" --url "http://$HOST:$PORT" --on-stall "$policy" \
      --log "$log" "${watchdog_args[@]}" &
    watchdog_pid=$!
  fi

  status=0
  wait "$server_pid" || status=$?
  while kill -0 "$server_pid" 2>/dev/null; do # a signal interrupted `wait`; the server is stopping
    status=0
    wait "$server_pid" || status=$?
  done
  # Workers the server forked into its group, if any outlived it.
  kill -TERM -- "-$server_pid" 2>/dev/null || true
  guard_status=0
  [ -z "$guard_pid" ] || wait "$guard_pid" || guard_status=$?
  watchdog_status=0
  [ -z "$watchdog_pid" ] || wait "$watchdog_pid" || watchdog_status=$?

  if [ "$guard_status" = 3 ]; then
    echo "serve.sh: the memory guard stopped the server; its reason is in $log ([memguard] lines)" >&2
  elif [ "$watchdog_status" = 4 ]; then
    echo "serve.sh: the watchdog stopped a stalled server; its reason is in $log ([watchdog] lines)" >&2
    if [ "$WATCHDOG" = restart ] && [ "$restarts" -lt "$WATCHDOG_RESTARTS" ]; then
      restarts=$((restarts + 1))
      echo "# serve.sh: restart $restarts of $WATCHDOG_RESTARTS after a stall, $(date -Is)" >>"$log"
      continue
    fi
  elif [ "$status" != 0 ]; then
    echo "serve.sh: the server exited with status $status; last lines of $log:" >&2
    tail -n 20 "$log" >&2
  fi
  break
done
[ -z "$killer_pid" ] || kill "$killer_pid" 2>/dev/null || true
if [ "$(cat "$PID_FILE" 2>/dev/null)" = "$server_pid" ]; then
  rm -f "$PID_FILE"
fi
# The working directory serve.sh made for the server, if the server left nothing in it.
[ -n "${WORKDIR:-}" ] || rmdir "$workdir" 2>/dev/null || true
exit "$status"
