#!/usr/bin/env bash
# The GPU check, in one call on a CUDA machine, from the repository root:
#   bash benchmarks/gpu_check.sh            # writes $OUT (default ./gpu-check) with gpu_check.json
# Runs the GPU tests (graph replay == eager, no capture after start-up) and the model/runtime tests on
# that machine, then the step benchmark on CUDA with graphs vs eager up to 4096 sessions.
# Needs only torch, numpy, safetensors and pytest (the server's packages are not imported).
set -uo pipefail
OUT=${OUT:-$(pwd)/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
"$PY" -m pytest -q -p no:cacheprovider tests/test_runtime.py tests/test_model_streaming.py \
  --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
"$PY" benchmarks/step.py --device cuda --max-batch 4096 --frames 1 4 16 --iterations 30 \
  --json "$OUT/step_cuda.json" 2>&1 | tee "$OUT/step_cuda.log"
bench_rc=${PIPESTATUS[0]}

"$PY" - "$OUT" "$tests_rc" "$bench_rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, tests_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
suite = ET.parse(out / "tests.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
step = json.loads((out / "step_cuda.json").read_text()) if (out / "step_cuda.json").exists() else None
result = {
    "device": (out / "device.txt").read_text().strip(),
    "tests": {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {"exit_code": tests_rc},
    "benchmark_exit_code": bench_rc,
    "step": step,
}
if step:
    result["targets"] = {
        "graph_vs_eager_at_batch_le_64": {
            f"b{g['batch']}_t{g['frames']}": round(g["speedup"], 2)
            for g in step["graph_speedup"] if g["batch"] <= 64
        },
        "b4096_t1_graph_p50_ms": next(
            (g["p50_ms"] for g in step["graphs"] if g["batch"] == 4096 and g["frames"] == 1), None
        ),
    }
(out / "gpu_check.json").write_text(json.dumps(result, indent=2))
print(json.dumps({k: v for k, v in result.items() if k != "step"}, indent=2))
PY
