#!/usr/bin/env bash
# Runs queued GPU steps in order under one time budget, a log each under $OUT.
#
#   OUT=/tmp/out LIMIT=550 bash benchmarks/gpu_queue.sh [QUEUE] [NAME_REGEX]
#
# QUEUE (default benchmarks/gpu_queue.txt): one step a line, "name seconds
# command...", '#' comments. A step gets min(its seconds, what is left of
# LIMIT less 5 s) under `timeout` (rc 124 when cut off; its log keeps what it
# printed, and tune_graph writes its --out JSON after every row), and is
# skipped when the budget would cut it to less than 30 s. NAME_REGEX (bash ERE) runs only
# the steps whose name matches. $OUT/steps.txt says what each step did;
# $OUT/queue.tgz holds every step's log and outputs (the steps see $OUT as
# a work folder of their own, packed after each step).
# Why: device calls are short (10 min) and a device session often gets one
# or two; a step cut off must not lose the steps before it, and a device
# call returns at most 8 files from $OUT (the device README), so the logs
# travel as one archive.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
queue=${1:-benchmarks/gpu_queue.txt}
only=${2:-.}
: "${OUT:?set OUT to the folder for the logs}"
dest=$OUT
mkdir -p "$dest"
OUT=$(mktemp -d)
export OUT
trap 'rm -rf "$OUT"' EXIT
limit=${LIMIT:-550}
start=$(date +%s)
while read -r name seconds cmd; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  [[ "$name" =~ $only ]] || continue
  left=$(( limit - ($(date +%s) - start) - 5 ))
  t=$(( seconds < left ? seconds : left ))
  if (( t < seconds && t < 30 )); then
    echo "$name skipped ($left s left)" >> "$OUT/steps.txt"
    continue
  fi
  s=$(date +%s)
  # $OUT in a command is expanded here, so --out "$OUT/x.json" works.
  timeout "$t" bash -c "$cmd" > "$OUT/$name.log" 2>&1 < /dev/null
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s (limit $t)" >> "$OUT/steps.txt"
  tar -czf "$dest/queue.tgz" -C "$OUT" .
  cp "$OUT/steps.txt" "$dest/steps.txt"
done < "$queue"
if [[ -f "$OUT/steps.txt" ]]; then
  cp "$OUT/steps.txt" "$dest/steps.txt"
  tar -czf "$dest/queue.tgz" -C "$OUT" .
  cat "$dest/steps.txt"
fi
