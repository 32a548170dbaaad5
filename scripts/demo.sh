#!/usr/bin/env bash
# The whole Flash-Next workflow, end to end, on a tiny local MTP model on this machine's CPU.
#
# usage: scripts/demo.sh [WORKDIR]
#
#   WORKDIR   where the demo builds and measures (default: .cache/demo/<date-time>; must be new)
#   VENV      the pinned test environment (default: .venv; tests/env/setup.sh creates it)
#   REPORT    where the HTML report goes (default: WORKDIR/flash-next-report.html)
#   REPEATS   bench runs per concurrency (default: 3: each figure gets a median and a range, and
#             the side-by-side table says which differences are within noise; 1 is faster)
#
# Steps: set up the pinned vLLM 0.29.0 (CPU build); apply the patch series into an overlay (the
# venv itself stays stock); build a tiny Qwen3.5 + MTP model and tokenizer locally; then, each
# through magpie/serving/serve.sh on 127.0.0.1 and measured by run_suite.sh (decode bench at
# c=1 and c=4, GSM8K on the fixture problems): MTP off, MTP k=3, and MTP k=3 with the draft head
# pruned to a keep-set fitted from the model's own generations (magpie/mtp_pruning/); the MTP k=3
# server also runs with the torch profiler, and profile_capture.py + trace_split.py show where its
# steps' time goes. Last, the report and a side-by-side table: tok/s, acceptance, and whether
# the outputs are identical.
#
# The tiny model is built so that greedy decoding continues "next id = previous id + 1" and its
# MTP block drafts exactly that; its figures show the tools work, not how fast Flash-Next is.
# On a GPU box the same tools serve Flash-Next: MODEL=... magpie/serving/serve.sh LOG.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
serving="$root/magpie/serving"
workdir=${1:-$root/.cache/demo/$(date +%Y%m%d-%H%M%S)}
venv=${VENV:-$root/.venv}
python="$venv/bin/python"
start=$(date +%s)

say() { printf '\n==> %s\n' "$*"; }

if [ -e "$workdir" ] && [ -n "$(ls -A "$workdir")" ]; then
  echo "demo.sh: $workdir exists and is not empty; give a new WORKDIR" >&2
  exit 2
fi
mkdir -p "$workdir"
workdir=$(cd "$workdir" && pwd) # absolute: serve.sh wants the keep-set by absolute path
report=${REPORT:-$workdir/flash-next-report.html}
repeats=${REPEATS:-3}

say "1. The pinned environment (vLLM 0.29.0, CPU build) in $venv"
VENV=$venv "$root/tests/env/setup.sh"
"$python" "$root/magpie" patches status --python "$python"

say "2. The patch series, applied into an overlay of the installed vLLM (the venv stays stock)"
overlay="$workdir/patched-vllm"
"$python" "$root/magpie" demo-overlay "$overlay" >/dev/null
"$python" "$root/magpie" patches status --target "$overlay"

say "3. A tiny Qwen3.5 + MTP model and its tokenizer, built here (nothing is downloaded)"
model="$workdir/tiny-qwen35-mtp"
"$python" "$root/magpie" demo-model "$workdir/tokenizer" "$model"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
serve_pid=
# shellcheck disable=SC2317  # called by the trap and by measure()
stop_server() {
  if [ -n "$serve_pid" ] && kill -0 "$serve_pid" 2>/dev/null; then
    kill -TERM "$serve_pid" # serve.sh stops the server's process group and waits for it
    wait "$serve_pid" || true
  fi
  serve_pid=
}
trap stop_server EXIT

# measure NAME LABEL EXPECT [VAR=VALUE...]: serve the tiny model with these serve.sh settings,
# run the suite against it (and, with TRACE=1 among them, capture profiler traces), stop it.
# TRACE is the demo's own switch, not passed on (serve.sh's PROFILE names a serving profile).
measure() {
  local name=$1 label=$2 expect=$3
  shift 3
  local port log="$workdir/$name.log" traces="$workdir/traces-$name" profile_args=() settings=() trace=0
  for setting in "$@"; do
    if [ "$setting" = TRACE=1 ]; then trace=1; else settings+=("$setting"); fi
  done
  if [ "$trace" = 1 ]; then
    mkdir -p "$traces"
    # No profiler summary table: building it takes longer than writing the trace.
    profile_args=(--profiler-config "{\"profiler\": \"torch\", \"torch_profiler_dir\": \"$traces\", \"torch_profiler_dump_cuda_time_total\": false}")
  fi
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  say "serve: $label (log $log)"
  env "${settings[@]}" MODEL="$model" VLLM_PYTHON="$python" PYTHONPATH="$overlay" PORT="$port" PLE=0 MAX_MODEL_LEN=2048 \
    "$serving/serve.sh" "$log" --served-model-name tiny --no-enable-prefix-caching "${profile_args[@]}" &
  serve_pid=$!
  local waited=0
  until "$python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=5)' \
    "http://127.0.0.1:$port" 2>/dev/null; do
    if ! kill -0 "$serve_pid" 2>/dev/null; then
      echo "demo.sh: the server did not start; last lines of $log:" >&2
      tail -n 30 "$log" >&2
      exit 1
    fi
    sleep 2
    waited=$((waited + 2))
    if [ "$waited" -ge 900 ]; then
      echo "demo.sh: no healthy server after 900 s; see $log" >&2
      exit 1
    fi
  done
  echo "ready after ${waited} s"
  URL="http://127.0.0.1:$port" LABEL="$label" SERVER_LOG="$log" EXPECT="$expect" N_C1=4 N_C4=16 MAX_TOKENS=256 \
    REPEATS="$repeats" BENCH_ARGS=--ignore-eos GSM8K="$root/tests/fixtures/gsm8k_fixture.jsonl" GSM8K_ARGS="--max-tokens 64" \
    PYTHON="$python" "$root/magpie/measure/run_suite.sh" "$workdir/results/$name"
  if [ ${#profile_args[@]} -gt 0 ]; then
    say "profile: decode c=1, prefill, decode c=4 (torch profiler), split per engine step"
    "$python" "$root/magpie" profile-capture --url "http://127.0.0.1:$port" --trace-dir "$traces" \
      --out "$workdir/results/$name/profile" --decode-steps 8 --min-window-s 0.3 --prefill-tokens 1500
    "$python" "$root/magpie" trace-split "$workdir/results/$name/profile/decode-c1"
  fi
  stop_server
}

say "4. Serve and measure: MTP off"
measure mtp-off "MTP off" "mtp=off" MTP=0
say "5. Serve and measure: MTP k=3, full draft head"
measure mtp3 "MTP k=3" "mtp=3 draft_head=full" MTP=3 TRACE=1

runs=("$workdir/results/mtp-off" "$workdir/results/mtp3")
skipped=()
if [ -f "$root/magpie/mtp_pruning/fit_keepset.py" ] && grep -q '^mtp_pruning/' "$root/patches/vllm-0.29.0/series"; then
  say "6. Fit a keep-set from the model's own generations (MTP k=3 run), serve with the pruned draft head"
  keep="$workdir/keep.npy"
  mtp3="$workdir/results/mtp3"
  "$python" "$root/magpie" fit-keepset "$mtp3/bench-c1.json" "$mtp3/bench-c4.json" "$mtp3/gsm8k.json" \
    --model "$model" -o "$keep"
  measure mtp3-pruned "MTP k=3, pruned draft head" "mtp=3 draft_head=pruned" MTP=3 DRAFT_VOCAB_PATH="$keep"
  runs+=("$workdir/results/mtp3-pruned")
else
  skipped+=("the pruned draft head: magpie/mtp_pruning/fit_keepset.py or the mtp_pruning patch is not in this checkout")
fi
trap - EXIT

say "7. Report"
"$python" "$root/magpie" report "${runs[@]}" --output "$report" --force

# The table says which figure is per request (c=1) and which aggregate (c=4), and why GSM8K
# reads 0 % on this model (report.py tells the counting model from its replies).
say "Side by side (identical outputs: the c=1 bench's token ids against the first row)"
"$python" "$root/magpie" report --compare "${runs[@]}"
echo
echo "results: $workdir/results   report: $report   ($(($(date +%s) - start)) s in all)"
echo "not shown here: ple_ssd (the n-gram table on disk) belongs to Qwen4Exp models; the tiny model has no"
echo "table. tests/ple_ssd exercises it on CPU; on a GPU box serve Flash-Next with PLE=1 (the default)."
for item in "${skipped[@]}"; do
  echo "skipped: $item"
done
