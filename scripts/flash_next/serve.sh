#!/usr/bin/env bash
# Serve Qwen3.8-Flash-Next (or any model) with the patched vLLM 0.29, with the settings that held
# on a 121 GB GB10, after checking everything that would otherwise fail only after the ~10-minute
# weight load.
#
# usage: MODEL=/path/to/checkpoint scripts/flash_next/serve.sh LOG [extra `vllm serve` args...]
#
# Environment (default):
#   MODEL                   required: the checkpoint folder (no path is built in)
#   VLLM_PYTHON             Python of the vLLM environment (default: the interpreter of `vllm` on PATH)
#   HOST=127.0.0.1          bind address; 0.0.0.0 exposes an unauthenticated server to the network
#   PORT=8100
#   GPU_MEM=0.76            --gpu-memory-utilization (0.80 once rebooted a GB10)
#   MAX_NUM_SEQS=4          --max-num-seqs
#   MAX_MODEL_LEN=65536     --max-model-len
#   MTP=3                   MTP speculative tokens per step; 0 turns speculative decoding off
#   DRAFT_VOCAB_PATH=       keep-set of the pruned MTP draft head (absolute path; needs the mtp-pruning patch)
#   PLE=1                   n-gram table on disk: --hf-overrides '{"ple_mmap": true}' (needs the ple-ssd patches)
#   LANGUAGE_MODEL_ONLY=1   --language-model-only (no vision encoder)
#   MEMGUARD=1              run scripts/flash_next/memguard.py on the server; 0 = no guard
#   MEMGUARD_MIN_AVAILABLE=6GiB   the guard stops the server under this MemAvailable
#   MEM_HARD_LIMIT=         cgroup v2 hard memory limit for the server, e.g. 110GiB (empty: none)
#   JIT_CHECK=auto          require ninja + nvcc for FlashInfer's JIT: auto (when an NVIDIA GPU is visible), 1, 0
#   PID_FILE=LOG.pid        holds the server's PID (it leads its own process group)
#   OVERWRITE=0             1 = replace an existing LOG
#
# Extra arguments go to `vllm serve` last, so they override the defaults above. Two GB10s, tensor
# parallel over Ray: start Ray on both nodes, then
#   serve.sh LOG --tensor-parallel-size 2 --distributed-executor-backend ray
# (docs/flash-next.md has the whole recipe).
#
# serve.sh stays in the foreground until the server exits and returns its exit status; SIGINT or
# SIGTERM stops the server's process group. The top of LOG records the exact command, the
# versions and the patch status; scripts/flash_next/log_check.py reads them back.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_tool=${PATCH_TOOL:-$here/../patches.py}

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

MODEL=${MODEL:-}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8100}
GPU_MEM=${GPU_MEM:-0.76}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-4}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-65536}
MTP=${MTP:-3}
DRAFT_VOCAB_PATH=${DRAFT_VOCAB_PATH:-}
PLE=${PLE:-1}
LANGUAGE_MODEL_ONLY=${LANGUAGE_MODEL_ONLY:-1}
MEMGUARD=${MEMGUARD:-1}
MEMGUARD_MIN_AVAILABLE=${MEMGUARD_MIN_AVAILABLE:-6GiB}
MEM_HARD_LIMIT=${MEM_HARD_LIMIT:-}
JIT_CHECK=${JIT_CHECK:-auto}
PID_FILE=${PID_FILE:-$log.pid}
OVERWRITE=${OVERWRITE:-0}

# ---- the settings themselves
[ -n "$MODEL" ] || die "MODEL is not set: MODEL=/path/to/checkpoint $0 LOG"
case "$MODEL" in
  /* | ./* | ../*) [ -e "$MODEL" ] || die "MODEL=$MODEL does not exist" ;;
esac
[[ $MTP =~ ^[0-9]+$ ]] || die "MTP=$MTP: expected the number of speculative tokens (0 turns MTP off)"
[[ $PLE =~ ^[01]$ ]] || die "PLE=$PLE: expected 1 (table on disk) or 0 (table resident)"
[[ $MEMGUARD =~ ^[01]$ ]] || die "MEMGUARD=$MEMGUARD: expected 1 or 0"
[[ $JIT_CHECK =~ ^(auto|0|1)$ ]] || die "JIT_CHECK=$JIT_CHECK: expected auto, 1 or 0"
[[ $PORT =~ ^[0-9]+$ ]] || die "PORT=$PORT: expected a port number"
if [ -n "$DRAFT_VOCAB_PATH" ] && [ "$MTP" -eq 0 ]; then
  die "DRAFT_VOCAB_PATH is set but MTP=0: the pruned draft head is part of MTP; set MTP>0 or unset DRAFT_VOCAB_PATH"
fi

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

# ---- files
if [ -s "$log" ] && [ "$OVERWRITE" != 1 ]; then
  die "$log exists; choose another LOG or set OVERWRITE=1"
fi
if [ -f "$PID_FILE" ] && old_pid=$(cat "$PID_FILE") && [ -n "$old_pid" ] && kill -0 "$old_pid" 2>/dev/null; then
  die "$PID_FILE says a server runs as PID $old_pid; stop it first (kill -TERM -- -$old_pid) or choose another PID_FILE"
fi

# ---- patches the requested features need
required=()
[ "$PLE" = 1 ] && required+=(ple-ssd)
[ -n "$DRAFT_VOCAB_PATH" ] && required+=(mtp-pruning)
for selector in "${required[@]}"; do
  case $selector in
    ple-ssd) why="PLE=1 (--hf-overrides '{\"ple_mmap\": true}')" ;;
    *) why="DRAFT_VOCAB_PATH (the pruned MTP draft head)" ;;
  esac
  status=0
  out=$("$python" "$patch_tool" status --require-applied "$selector" --python "$python" 2>&1) || status=$?
  case $status in
    0) ;;
    1) die "$why needs the $selector patches applied to this vLLM, and they are not:
$out
apply them: $patch_tool apply $selector --python $python" ;;
    3) die "$why needs the $selector patches, and they conflict with this vLLM (another version?):
$out" ;;
    *) die "$why needs the $selector patches; the patch tool says:
$out" ;;
  esac
done

# ---- keep-set, JIT tools, versions (Python: it reads the keep-set without unpickling code)
preflight=(--model "$MODEL" --jit-check "$JIT_CHECK" --header)
[ -n "$DRAFT_VOCAB_PATH" ] && preflight+=(--draft-vocab-path "$DRAFT_VOCAB_PATH")
header=$("$python" "$here/preflight.py" "${preflight[@]}") || exit 1
patch_table=$("$python" "$patch_tool" status --python "$python" 2>&1) || true

# ---- the command
cmd=("$python" -m vllm.entrypoints.cli.main serve "$MODEL" --host "$HOST" --port "$PORT"
  --gpu-memory-utilization "$GPU_MEM" --max-num-seqs "$MAX_NUM_SEQS" --max-model-len "$MAX_MODEL_LEN")
[ "$LANGUAGE_MODEL_ONLY" = 1 ] && cmd+=(--language-model-only)
[ "$PLE" = 1 ] && cmd+=(--hf-overrides '{"ple_mmap": true}')
if [ "$MTP" -gt 0 ]; then
  spec=$("$python" -c '
import json, sys
spec = {"method": "mtp", "num_speculative_tokens": int(sys.argv[1])}
if sys.argv[2]:
    spec["draft_vocab_path"] = sys.argv[2]
print(json.dumps(spec))' "$MTP" "$DRAFT_VOCAB_PATH")
  cmd+=(--speculative-config "$spec")
fi
cmd+=("$@")
launch=("${cmd[@]}")
if [ -n "$MEM_HARD_LIMIT" ]; then
  launch=("$python" "$here/memguard.py" exec --max "$MEM_HARD_LIMIT" -- "${cmd[@]}")
fi

{
  echo "# serve.sh: started $(date -Is) by $(id -un)@$(hostname)"
  echo "# command: $(printf '%q ' "${cmd[@]}")"
  echo "# settings: MODEL=$MODEL HOST=$HOST PORT=$PORT GPU_MEM=$GPU_MEM MAX_NUM_SEQS=$MAX_NUM_SEQS" \
    "MAX_MODEL_LEN=$MAX_MODEL_LEN MTP=$MTP PLE=$PLE DRAFT_VOCAB_PATH=${DRAFT_VOCAB_PATH:-none}" \
    "LANGUAGE_MODEL_ONLY=$LANGUAGE_MODEL_ONLY MEMGUARD=$MEMGUARD MEMGUARD_MIN_AVAILABLE=$MEMGUARD_MIN_AVAILABLE" \
    "MEM_HARD_LIMIT=${MEM_HARD_LIMIT:-none}"
  echo "# PYTHONPATH: ${PYTHONPATH:-}"
  echo "$header"
  while IFS= read -r line; do echo "# patches: $line"; done <<<"$patch_table"
  echo "# ---- vLLM output follows"
} >"$log"

# Its own session and process group: the guard and a stop reach the engine core and its workers.
setsid "${launch[@]}" >>"$log" 2>&1 </dev/null &
server_pid=$!
echo "$server_pid" >"$PID_FILE"
echo "serve.sh: server PID $server_pid on http://$HOST:$PORT, log $log, PID file $PID_FILE" >&2

guard_pid=
if [ "$MEMGUARD" = 1 ]; then
  "$python" "$here/memguard.py" watch --pid "$server_pid" --min-available "$MEMGUARD_MIN_AVAILABLE" --log "$log" &
  guard_pid=$!
fi

# shellcheck disable=SC2317  # called by the trap
stop_server() {
  kill -TERM -- "-$server_pid" 2>/dev/null || true
}
trap stop_server INT TERM

status=0
wait "$server_pid" || status=$?
while kill -0 "$server_pid" 2>/dev/null; do # a signal interrupted `wait`; the server is stopping
  status=0
  wait "$server_pid" || status=$?
done
# Workers the server forked into its group, if any outlived it.
kill -TERM -- "-$server_pid" 2>/dev/null || true
guard_status=0
if [ -n "$guard_pid" ]; then
  wait "$guard_pid" || guard_status=$?
fi
if [ "$(cat "$PID_FILE" 2>/dev/null)" = "$server_pid" ]; then
  rm -f "$PID_FILE"
fi
if [ "$guard_status" = 3 ]; then
  echo "serve.sh: the memory guard stopped the server (MemAvailable under $MEMGUARD_MIN_AVAILABLE); see $log" >&2
elif [ "$status" != 0 ]; then
  echo "serve.sh: the server exited with status $status; last lines of $log:" >&2
  tail -n 20 "$log" >&2
fi
exit "$status"
