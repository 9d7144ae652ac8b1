#!/usr/bin/env bash
# Time-boxed training of the default model on one CUDA machine that cannot reach the network, from Opus packs
# of the corpus (training/pack.py), run from the repository root. Two runs share the GPU, each with its own
# data-loading processes: "small" fine-tunes the shipped model (same architecture, so serving costs do not
# move) and "wide" trains a wider, deeper model from scratch.
#
#   bash training/gpu.sh start MINUTES PACK...   # unpack, GPU check, then start both runs in the background
#   bash training/gpu.sh add PACK...             # unpack more packs while they run (picked up at the next epoch)
#   bash training/gpu.sh finish                  # wait for both runs, export them (weights averaged over the
#                                                # last checkpoints), write the results to $OUT
#
# Wheels in .whl/ (soundfile and its cffi/pycparser, soxr: what the machine's own Python lacks) are installed
# into /tmp/site first. Results in $OUT: gpu_check.json and its logs (benchmarks/gpu_check.sh) from start;
# from finish logs.tar.gz and weights-only checkpoints small.pt and wide.pt (each averaged over its last
# checkpoints) and wide-last.pt, for `python -m training.export --checkpoint X.pt` to export and evaluate.
set -uo pipefail
OUT=${OUT:-$(pwd)/gpu-out}
CORPUS=data/gpu
RUNS=runs/gpu
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$CORPUS" "$RUNS"
export PYTHONPATH="$(pwd):/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

wheels() {
  if [ -d .whl ] && [ ! -e /tmp/site/.done ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.done
  fi
}

unpack() {
  for pack in "$@"; do
    "$PY" -m training.pack unpack "$pack" --corpus "$CORPUS" --workers 16 || echo "unpack $pack failed"
  done
}

run() {  # NAME MINUTES ARGS...
  local name=$1 minutes=$2
  shift 2
  setsid nohup "$PY" -m training.train --corpus "$CORPUS" --run "$RUNS/$name" --minutes "$minutes" \
    --total-steps 100000 --workers 7 --threads 1 --bf16 --batch-seconds 128 --checkpoint-minutes 0.5 \
    --snapshot-progress 0.8 --eval-minutes 1.5 --eval-limit 40 --log-every 100 --vtlp 0.1 --channel-eq 0.7 "$@" \
    > "$RUNS/$name.out" 2>&1 < /dev/null &
  echo $! > "$RUNS/$name.pid"
}

case ${1:-} in
  start)
    minutes=$2
    shift 2
    wheels
    unpack "$@"
    OUT="$OUT" timeout 180 bash benchmarks/gpu_check.sh > "$RUNS/gpu_check.out" 2>&1
    tail -n 25 "$RUNS/gpu_check.out"
    run small "$minutes" --init cosystream/models/default --peak-lr 1.5e-3 --warmup 300
    run wide "$minutes" --peak-lr 3e-3 --warmup 600 \
      --config '{"channels": 256, "dilations": [1, 2, 4, 8, 16, 1, 2, 4, 8, 16, 1, 2, 4, 8]}'
    sleep 20
    tail -n 3 "$RUNS"/small.out "$RUNS"/wide.out
    ;;
  add)
    shift
    wheels
    unpack "$@"
    ;;
  finish)
    for name in small wide; do
      pid=$(cat "$RUNS/$name.pid" 2>/dev/null)
      while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; do sleep 2; done
    done
    for name in small wide; do
      snaps=$(ls -v "$RUNS/$name"/snap_*.pt 2>/dev/null | tail -4)
      "$PY" -m training.export --checkpoint "$RUNS/$name/last.pt" ${snaps:+--average $snaps} --no-eval \
        --out "$RUNS/export/$name" --save-checkpoint "$OUT/$name.pt"
    done
    "$PY" -m training.export --checkpoint "$RUNS/wide/last.pt" --out "$RUNS/export/wide-last" --no-eval \
      --save-checkpoint "$OUT/wide-last.pt"
    tar -czf "$OUT/logs.tar.gz" "$RUNS"/*.out "$RUNS"/*/log.jsonl
    tail -n 4 "$RUNS"/small.out "$RUNS"/wide.out
    ls -la "$OUT"
    ;;
  *)
    sed -n 2,16p "$0"
    exit 2
    ;;
esac
