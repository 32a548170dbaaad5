#!/usr/bin/env bash
# The measurement suite against one running server: decode bench at c=1 and c=4, GSM8K, the
# /metrics page before and after, then the server log's check (which optimizations were really
# active); then a one-screen summary. Every step
# writes its own file in OUTDIR, so a failed step leaves the others' results in place.
#
# usage: magpie/measure/run_suite.sh OUTDIR
#
# Environment (default):
#   URL=http://127.0.0.1:8100   the server
#   LABEL=                      configuration name for tables and the report (default: OUTDIR's name)
#   SERVER_LOG=                 the server's log (serve.sh's LOG): checked with log_check.py
#   EXPECT=                     space-separated FEATURE=STATE the log must show, e.g. "mtp=3 draft_head=pruned"
#   N_C1=8  N_C4=16             measured requests at concurrency 1 and 4
#   MAX_TOKENS=256              max_tokens of the bench requests
#   REPEATS=3                   bench runs per concurrency: each figure's median/min/max, and
#                               `report --compare` says "within noise" when ranges overlap
#   BENCH_ARGS=                 more bench_decode.py arguments (e.g. "--ignore-eos --prompts FILE")
#   GSM8K=                      GSM8K-format JSONL/parquet; empty: the GSM8K step is skipped (and says so)
#   GSM8K_LIMIT=                only the first N problems
#   GSM8K_ARGS=                 more gsm8k.py arguments (e.g. "--max-tokens 512")
#   PYTHON=python3              interpreter for the tools (standard library only)
#
# Exit status: 0 when every step ran, 1 when a step failed (its error is in OUTDIR/suite.log).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pkg=$(dirname "$here") # the magpie package: `"$PYTHON" "$pkg" TOOL` runs one of its tools

if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
  [ $# -eq 1 ] && exit 0
  exit 2
fi
out=$1
URL=${URL:-http://127.0.0.1:8100}
LABEL=${LABEL:-$(basename "$out")}
SERVER_LOG=${SERVER_LOG:-}
EXPECT=${EXPECT:-}
N_C1=${N_C1:-8}
N_C4=${N_C4:-16}
MAX_TOKENS=${MAX_TOKENS:-256}
REPEATS=${REPEATS:-3}
BENCH_ARGS=${BENCH_ARGS:-}
GSM8K=${GSM8K:-}
GSM8K_LIMIT=${GSM8K_LIMIT:-}
GSM8K_ARGS=${GSM8K_ARGS:-}
PYTHON=${PYTHON:-python3}

if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "run_suite.sh: $out exists and is not empty; choose a new OUTDIR" >&2
  exit 2
fi
mkdir -p "$out"
log="$out/suite.log"
failed=()

# step NAME COMMAND...: run one step, keep its output in suite.log, remember a failure.
step() {
  local name=$1
  shift
  echo "== $name: $*" >>"$log"
  local status=0
  "$@" >>"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    failed+=("$name (exit $status)")
    echo "run_suite.sh: step $name failed with exit $status (see $log)" >&2
  fi
  return 0
}

# save_metrics FILE: the server's /metrics page.
save_metrics() {
  "$PYTHON" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=60).read().decode())' "$URL" >"$1"
}

read -r -a bench_args <<<"$BENCH_ARGS"
# The launch manifest beside serve.sh's LOG stamps vLLM and the patch states on every bench result.
if [ -n "$SERVER_LOG" ]; then bench_args+=(--server-log "$SERVER_LOG"); fi
bench_args+=(--repeats "$REPEATS")
read -r -a gsm8k_args <<<"$GSM8K_ARGS"
[ -n "$GSM8K_LIMIT" ] && gsm8k_args+=(--limit "$GSM8K_LIMIT")

"$PYTHON" - "$out/suite.json" "$LABEL" "$URL" "$SERVER_LOG" <<'PY'
import datetime, json, os, platform, sys
meminfo = {}
with open("/proc/meminfo") as f:
    for line in f:
        key, value = line.split(":", 1)
        meminfo[key] = int(value.split()[0]) * 1024
path, label, url, server_log = sys.argv[1:5]
json.dump({
    "schema": "magpie/suite/1",
    "label": label,
    "url": url,
    "server_log": os.path.abspath(server_log) if server_log else None,
    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "host": {"name": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
             "mem_total_bytes": meminfo.get("MemTotal"), "mem_available_bytes_at_start": meminfo.get("MemAvailable")},
}, open(path, "w"), indent=1)
PY

step metrics-before save_metrics "$out/metrics-before.prom"
step bench-c1 "$PYTHON" "$pkg" bench-decode --url "$URL" -c 1 -n "$N_C1" --max-tokens "$MAX_TOKENS" \
  --label "$LABEL" --output "$out/bench-c1.json" "${bench_args[@]}"
step bench-c4 "$PYTHON" "$pkg" bench-decode --url "$URL" -c 4 -n "$N_C4" --max-tokens "$MAX_TOKENS" \
  --label "$LABEL" --output "$out/bench-c4.json" "${bench_args[@]}"
if [ -n "$GSM8K" ]; then
  step gsm8k "$PYTHON" "$pkg" gsm8k --url "$URL" --dataset "$GSM8K" --label "$LABEL" \
    --output "$out/gsm8k.json" "${gsm8k_args[@]}"
else
  echo "== gsm8k: skipped (GSM8K is not set)" | tee -a "$log" >&2
fi
step metrics-after save_metrics "$out/metrics-after.prom"
# After the requests: some lines (the pruned draft head in use) appear only once the server decoded.
if [ -n "$SERVER_LOG" ]; then
  read -r -a expect <<<"$EXPECT"
  check=("$PYTHON" "$pkg" log-check "$SERVER_LOG" --output "$out/log_check.json")
  for item in "${expect[@]}"; do check+=(--expect "$item"); done
  step log-check "${check[@]}"
fi

"$PYTHON" "$pkg" report --summary "$out" | tee "$out/summary.txt"
if [ ${#failed[@]} -gt 0 ]; then
  echo "run_suite.sh: failed steps: ${failed[*]}; the results of the others are in $out" >&2
  exit 1
fi
