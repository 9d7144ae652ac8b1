#!/usr/bin/env bash
# Builds .gpu/, the folder a GPU machine without network access needs beside the checkout (name it in the
# device call's carry):
#   .gpu/whl/   the wheels of scripts/gpu_wheels.txt for its Python (cp312, manylinux x86-64)
#   .gpu/wav/   speech for the latency probe (that machine has no espeak-ng): synthesized here
#
#   bash scripts/gpu_carry.sh                     # for the GPU machine (Python 3.12)
#   PYTHON_VERSION=local bash scripts/gpu_carry.sh  # wheels for this machine's Python (the rehearsal)
#   CARRY=DIR bash scripts/gpu_carry.sh           # somewhere else than .gpu
# PYTHON downloads the wheels (default: the dev venv's); WAV_PYTHON, one with the package's requirements,
# synthesizes the speech (default: the same). Needs pip's network access and espeak-ng here; fails (exit 1)
# if anything is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.gpu}
PY=${PYTHON:-.venv/bin/python}
WAV_PY=${WAV_PYTHON:-$PY}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
mkdir -p "$CARRY/whl" "$CARRY/wav"
rm -f "$CARRY"/whl/*.whl
target=()
if [ "$PYTHON_VERSION" != local ]; then
  target=(--python-version "$PYTHON_VERSION" --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64)
fi
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "${target[@]}" \
  -d "$CARRY/whl" -r scripts/gpu_wheels.txt
# One wheel per line of the list: two versions of one package would stop the install there.
want=$(grep -cvE '^\s*(#|$)' scripts/gpu_wheels.txt)
have=$(ls "$CARRY"/whl/*.whl | wc -l)
if [ "$have" != "$want" ]; then
  echo "gpu_carry: $have wheels for $want requirements in $CARRY/whl" >&2
  exit 1
fi
if [ ! -s "$CARRY/wav/speech.wav" ]; then
  PYTHONPATH=. "$WAV_PY" clients/latency_probe.py --save-wav "$CARRY/wav/speech.wav"
fi
du -sh "$CARRY"/whl "$CARRY"/wav
