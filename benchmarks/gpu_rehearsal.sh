#!/usr/bin/env bash
# The GPU scripts rehearsed on this CPU machine, as they will run on the GPU machine (no network, no package
# registry, no espeak-ng, only the image's Python packages plus the carried wheels), so that an import or a
# path error never costs a lent GPU:
#   1. a venv holding only packages the GPU image has (torch, numpy, safetensors, pytest, prometheus-client,
#      matplotlib: docs/GPU.md) and nothing of cosystream's own requirements;
#   2. the carried folder built by scripts/gpu_carry.sh: wheels for this Python (the GPU's cp312 set is
#      downloaded too, to check that it resolves and that tree + carry fit the 64 MiB a call takes);
#   3. a PATH without espeak-ng; the wheels installed offline (pip --no-index) by scripts/gpu_env.sh;
#   4. GPU_REHEARSAL=1 benchmarks/gpu_check.sh and training/gpu.sh (on a toy pack), each run to the point
#      where CUDA is needed, on the CPU at toy sizes; the check with a fake NVML (tests/fake_nvml, built with
#      cc) standing in for the driver's, so the GPU gauges' path runs too.
# Exit 0 only if both pass. Run by CI; takes 2-4 minutes (the venv is kept in $REHEARSAL between runs).
#
#   bash benchmarks/gpu_rehearsal.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
R=${REHEARSAL:-/tmp/cosystream-gpu-rehearsal}
DEV_PY=${DEV_PYTHON:-$ROOT/.venv/bin/python}  # the dev venv (make install-dev): espeak-ng speech, the toy pack
BASE_PY=${PYTHON:-python3}
LIMIT_MIB=64
mkdir -p "$R"
log() { echo "gpu_rehearsal: $*"; }

# 1. The image's packages only (torch: the CPU build here).
if [ ! -e "$R/venv/.ready" ]; then
  rm -rf "$R/venv"
  "$BASE_PY" -m venv "$R/venv"
  "$R/venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$R/venv/bin/pip" install -q --disable-pip-version-check numpy safetensors pytest prometheus-client matplotlib
  touch "$R/venv/.ready"
fi
VPY=$R/venv/bin/python
if "$VPY" -c 'import grpc' 2>/dev/null || "$VPY" -c 'import soxr' 2>/dev/null; then
  log "the rehearsal venv must not have grpc or soxr of its own"; exit 1
fi

# 2. The carried folder: this Python's wheels, and the GPU machine's set checked for size.
rm -rf "$R/carry" "$R/carry312"
CARRY=$R/carry PYTHON=$VPY WAV_PYTHON=$DEV_PY PYTHON_VERSION=local bash scripts/gpu_carry.sh
CARRY=$R/carry312 PYTHON=$DEV_PY WAV_PYTHON=$DEV_PY bash scripts/gpu_carry.sh
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carry_bytes=$(du -sb "$R/carry312" | cut -f1)
total_mib=$(( (tree_bytes + carry_bytes) / 1048576 ))
log "tree $((tree_bytes / 1048576)) MiB + carry $((carry_bytes / 1048576)) MiB = ${total_mib} MiB of the ${LIMIT_MIB} a call takes"
[ "$total_mib" -lt "$LIMIT_MIB" ] || { log "over the limit"; exit 1; }

# 3. No espeak-ng on the PATH.
rm -rf "$R/bin" && mkdir -p "$R/bin"
for dir in /usr/local/bin /usr/bin /bin; do
  for f in "$dir"/*; do
    name=$(basename "$f")
    case $name in espeak*) continue ;; esac
    [ -e "$R/bin/$name" ] || ln -s "$f" "$R/bin/$name"
  done
done
export PATH="$R/venv/bin:$R/bin"
unset PYTHONPATH
if command -v espeak-ng > /dev/null; then log "espeak-ng is still on the PATH"; exit 1; fi

# 4a. The GPU check, its GPU gauges read from the fake NVML (without a C compiler, from none: no gauges).
rm -rf "$R/site" "$R/check" "$R/nvml"
mkdir -p "$R/nvml"
NVML_NAME=none
if command -v cc > /dev/null; then
  cc -shared -fPIC -o "$R/nvml/libnvidia-ml.so.1" tests/fake_nvml/fake_nvml.c
  NVML_NAME="Fake NVML GPU"
else
  log "no C compiler: the GPU gauges are rehearsed absent"
fi
log "benchmarks/gpu_check.sh"
GPU_REHEARSAL=1 CARRY=$R/carry SITE=$R/site PYTHON=$VPY OUT=$R/check LD_LIBRARY_PATH=$R/nvml \
  FAKE_NVML_NAME="$NVML_NAME" bash benchmarks/gpu_check.sh
"$VPY" - "$R/check" "$NVML_NAME" <<'PY'
import json, sys
from pathlib import Path
out, nvml_name = Path(sys.argv[1]), sys.argv[2]
result = json.loads((out / "gpu_check.json").read_text())
assert result["passed"], result
assert result["tests"]["tests"] > 0 and not result["tests"]["failures"] and not result["tests"]["errors"], result
assert result["step_summary"]["eager_b64_t1_p50_ms"] is None  # toy sizes: batches up to 4
assert result["capacity"]["10ms"]["runs"] and result["capacity"]["20ms"]["runs"], result
for run in result["capacity"]["10ms"]["runs"] + result["capacity"]["20ms"]["runs"]:
    gpu = run["gpu"]
    if nvml_name == "none":
        assert gpu == {}, gpu
    else:  # the fake's values (tests/fake_nvml/fake_nvml.c)
        assert gpu["0"]["name"] == nvml_name and gpu["0"]["memory_total_bytes"] == 150e9, gpu
        assert gpu["0"]["utilization_percent"] == 40 and gpu["0"]["clocks_events"] == ["sw_power_cap"], gpu
overload = result["overload"]["runs"]  # (the flood at toy sizes: every configuration ran, none failed)
assert set(overload) == {"alone", "admission by load"}, overload
flood = overload["admission by load"][0]
assert flood["arrivals_admitted"] + flood["arrivals_refused"] == 3 and flood["batch_errors"] == 0, flood
assert overload["alone"][0]["base_p99_ms"] > 0 and flood["batch_realtime_factor"] > 0, overload
for name in ("step.json", "capacity.json", "capacity.png", "tests.xml", "overload.json", "logs.tar.gz"):
    assert (out / name).stat().st_size > 0, name
assert len(list(out.iterdir())) <= 8, "a call brings back at most 8 files"
PY

# 4b. Training, on a toy pack made here from espeak-ng speech (the dev venv, espeak-ng on its own PATH).
rm -rf "$R/corpus" "$R/packs" "$R/train"
PATH="$ROOT/.venv/bin:/usr/local/bin:/usr/bin:/bin" PYTHONPATH=$ROOT "$DEV_PY" - "$R" <<'PY'
import sys
from pathlib import Path
from training import corpus, pack

root = Path(sys.argv[1])
data = root / "corpus"
(data / "train").mkdir(parents=True)
(data / "eval").mkdir()
sentences = ["the cat sat on the mat", "a big red dog ran home", "we like to sing songs", "call me at nine"]
voices = [corpus.Voice("espeak", "en-us"), corpus.Voice("espeak", "en-gb+f3")]
items = [(s, v) for s in sentences for v in voices]
audios = corpus.synthesize(items, root)
texts, labels = [t for t, _ in items], [v.label for _, v in items]
corpus.save_shard(data / "train" / "shard_00000.npz", audios, texts, labels)
corpus.save_shard(data / "eval" / "train_voices.npz", audios[:2], texts[:2], labels[:2])
pack.main(["build", "--corpus", str(data), "--out", str(root / "packs" / "toy"), "--megabytes", "1",
           "--eval-per-group", "2", "--workers", "1", "--espeak-share", "1"])
PY
log "training/gpu.sh"
GPU_REHEARSAL=1 CARRY=$R/carry SITE=$R/site PYTHON=$VPY OUT=$R/train/out CORPUS=$R/train/corpus \
  RUNS=$R/train/runs bash training/gpu.sh 0.2 "$R/packs/toy"
for name in small.pt wide.pt wide-last.pt logs.tar.gz; do
  [ -s "$R/train/out/$name" ] || { log "training/gpu.sh left no $name"; exit 1; }
done
log "passed: both GPU scripts import and run on the GPU image's packages and the carried wheels alone"
