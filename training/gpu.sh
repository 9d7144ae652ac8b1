#!/usr/bin/env bash
# Time-boxed training of the default model in ONE call on a CUDA machine that cannot reach the network, from
# Opus packs of the corpus (training/pack.py), run from the repository root with .gpu carried
# (scripts/gpu_carry.sh) and the packs inside the checkout's ignored folders (the tree travels whole; keep
# tree + .gpu + packs under 64 MiB: the packs at ~30 MB).
#
#   bash training/gpu.sh MINUTES PACK...
#
# Unpacks the packs, then trains two runs side by side on the GPU for MINUTES each, both on the shipped
# model's phoneme units (its lexicon.tsv.gz): "small" fine-tunes the shipped model (same architecture, so
# serving costs do not move), "wide" trains a wider, deeper model from scratch. Then exports each (weights
# averaged over the last checkpoints) and writes to $OUT (default ./gpu-out): small.pt, wide.pt (averaged)
# and wide-last.pt, weights only, for `python -m training.export --checkpoint X.pt` here, plus logs.tar.gz.
# The machine goes back ~30 s after a call and a call is capped at 10 minutes, so everything happens in this
# one: MINUTES + ~2 minutes (unpack, start, final evaluation, export) must fit; docs/GPU.md sizes it.
# Exit status: non-zero if any step failed.
#
# GPU_REHEARSAL=1 runs the same steps on the CPU at toy sizes (two steps per run; benchmarks/gpu_rehearsal.sh
# does, in CI) and ends with "no CUDA here".
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n 2,20p "$0"
  exit 2
fi
MINUTES=$1
shift
OUT=${OUT:-$(pwd)/gpu-out}
CORPUS=${CORPUS:-data/gpu}
RUNS=${RUNS:-runs/gpu}
LEXICON=cosystream/models/default/lexicon.tsv.gz
mkdir -p "$OUT" "$CORPUS" "$RUNS"
source scripts/gpu_env.sh
gpu_env torch numpy safetensors soundfile training.train training.export training.pack || exit 1

if [ "$CUDA" = 1 ]; then
  SIZE=(--workers 7 --batch-seconds 128 --eval-limit 40)
  UNPACK_WORKERS=16
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
elif [ "${GPU_REHEARSAL:-0}" = 1 ]; then
  SIZE=(--workers 1 --batch-seconds 8 --eval-limit 2 --max-steps 2)
  UNPACK_WORKERS=2
  echo "rehearsal (no CUDA): two steps per run on the CPU"
else
  echo "training/gpu.sh: no CUDA device here; GPU_REHEARSAL=1 rehearses on the CPU" >&2
  exit 1
fi

failed=0
for pack in "$@"; do
  [ -d "$pack" ] || { echo "training/gpu.sh: no pack at $pack" >&2; exit 1; }
  "$PY" -m training.pack unpack "$pack" --corpus "$CORPUS" --workers "$UNPACK_WORKERS" || failed=1
done
[ "$failed" = 0 ] || { echo "training/gpu.sh: unpacking failed" >&2; exit 1; }

run() {  # NAME ARGS...: a time-boxed run in the background, its output in $RUNS/NAME.out
  local name=$1
  shift
  timeout --kill-after=20 "$(awk "BEGIN {print int($MINUTES * 60 + 150)}")" \
    "$PY" -m training.train --corpus "$CORPUS" --run "$RUNS/$name" --minutes "$MINUTES" \
    --total-steps 100000 --threads 1 --bf16 --checkpoint-minutes 0.5 --snapshot-progress 0.8 \
    --eval-minutes 1.5 --log-every 100 --vtlp 0.1 --channel-eq 0.7 --lexicon "$LEXICON" "${SIZE[@]}" "$@" \
    > "$RUNS/$name.out" 2>&1 < /dev/null &
  PIDS[$name]=$!
}
declare -A PIDS=()
run small --init cosystream/models/default --peak-lr 1.5e-3 --warmup 300
run wide --peak-lr 3e-3 --warmup 600 \
  --config '{"channels": 256, "dilations": [1, 2, 4, 8, 16, 1, 2, 4, 8, 16, 1, 2, 4, 8]}'
for name in small wide; do
  if ! wait "${PIDS[$name]}"; then
    echo "training/gpu.sh: run $name failed:" >&2
    tail -n 20 "$RUNS/$name.out" >&2
    failed=1
  fi
done

export_run() {  # NAME CHECKPOINT OUT_NAME [--average]
  local name=$1 checkpoint=$2 target=$3 average=${4:-}
  local snaps=()
  [ -n "$average" ] && mapfile -t snaps < <(ls -v "$RUNS/$name"/snap_*.pt 2>/dev/null | tail -4)
  [ -f "$checkpoint" ] || { echo "training/gpu.sh: $checkpoint missing" >&2; failed=1; return; }
  "$PY" -m training.export --checkpoint "$checkpoint" ${snaps[@]:+--average "${snaps[@]}"} --no-eval \
    --lexicon "$LEXICON" --out "$RUNS/export/$target" --save-checkpoint "$OUT/$target.pt" || failed=1
}
export_run small "$RUNS/small/last.pt" small --average
export_run wide "$RUNS/wide/last.pt" wide --average
export_run wide "$RUNS/wide/last.pt" wide-last
tar -czf "$OUT/logs.tar.gz" "$RUNS"/*.out "$RUNS"/*/log.jsonl 2>/dev/null
tail -n 3 "$RUNS"/small.out "$RUNS"/wide.out
ls -la "$OUT"
if [ "$CUDA" != 1 ] && [ "$failed" = 0 ]; then
  echo "training/gpu.sh rehearsal passed: unpack, both runs, export; no CUDA here, so nothing was trained"
fi
exit "$failed"
